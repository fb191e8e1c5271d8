"""`fits/ladder/`: the pre-registered ladder analysis (smelt_jax.scaling.ladder) written as tables, a README
with every verdict and the gap-against-compute figure, by `make fits` (`fit.json`: {"analysis": "ladder",
"reference_suites": ["nano", "nano2"]})."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from smelt_jax.design import paper
from smelt_jax.scaling import figures, ladder, tables

# The registered prediction points: each ladder pair's 4M and 10M endpoints (the tokens nano's branches end at).
POINT_WIDTHS, POINT_HORIZONS = (96, 128, 160), (4e6, 10e6)


def prediction_points(nano: pd.DataFrame, budgets: dict[int, dict]) -> pd.DataFrame:
    """label, flops (Baseline F), tokens, and the paper laws' gap at each registered point. `budgets`:
    width -> {"flops_baseline", "sparsity_baseline", "flops_smelt", "sparsity_smelt"} of the ladder's pair."""
    from smelt_jax.scaling.nano2 import horizon
    tokens = {horizon(t): int(t) for t in nano["tokens"].unique()}
    rows = []
    for width in POINT_WIDTHS:
        b = budgets[width]
        for at in POINT_HORIZONS:
            rows.append({"label": f"d{width} {at / 1e6:g}M", "flops": b["flops_baseline"], "tokens": tokens[at],
                         "paper": float(ladder.paper_gap(b["flops_baseline"], b["sparsity_baseline"], b["flops_smelt"],
                                                         b["sparsity_smelt"], tokens[at]))})
    return pd.DataFrame(rows)


def suite_budgets() -> dict[int, dict]:
    """The ladder pairs' F and S from the suite itself (through the registry, as every library reader)."""
    from smelt_jax.design import suites
    from smelt_jax.design.budget import budget
    out: dict[int, dict] = {}
    for run in suites.load_suite("ladder"):
        if run.pair_id in {f"ladder-d{w}" for w in POINT_WIDTHS}:
            b = budget(run.model, run.control)
            out.setdefault(int(run.scale[1:]), {}).update(
                {f"flops_{run.arch}": b.train_flops_per_token, f"sparsity_{run.arch}": b.sparsity})
    return out


def registered_predictions(nano: pd.DataFrame, points: pd.DataFrame) -> pd.DataFrame:
    """docs/results-ladder.md's prediction table: every form's gap and 90% interval at each point, the
    forms' zero crossings at 10M tokens, and the paper laws' gap and break-even."""
    table = ladder.bootstrap(ladder.matched_gaps(nano), points)
    low, middle, high = ladder.tokens_per_flop_span(ladder.matched_gaps(nano))
    paper_rows = [{"form": "paper", "point": row.label, "tokens": int(row.tokens), "compute": row.flops * row.tokens,
                   "predicted": row.paper, "low": math.nan, "high": math.nan} for row in points.itertuples()]
    paper_rows.append({"form": "paper", "point": f"break-even at D/F {middle:.2f} [{low:.2f}, {high:.2f}]",
                       "tokens": math.nan, "compute": ladder.paper_break_even(middle)[0], "predicted": math.nan,
                       "low": ladder.paper_break_even(high)[0], "high": ladder.paper_break_even(low)[0],
                       "share_crossing": math.nan})
    return pd.concat([table, pd.DataFrame(paper_rows)], ignore_index=True)


def write(folder: Path, results: pd.DataFrame, references: dict[str, pd.DataFrame]) -> list[Path]:
    """Every ladder table, the README and the figure into `folder`."""
    nano, nano2_results = references["nano"], references["nano2"]
    points = prediction_points(nano, suite_budgets())
    predictions = registered_predictions(nano, points)
    drift = ladder.pair_drift(results, nano)
    drift_word, delta = ladder.drift_verdict(drift)
    forms = ladder.forms_check(predictions, results)
    trend, trend_word = ladder.trend(results)
    parts = {"predictions": predictions, "drift": drift, "standing": ladder.standing(results), "forms": forms,
             "trend": trend, "seeds": ladder.seeds(results), "gqa4": ladder.gqa4(results, nano2_results),
             "breakeven": refit_break_even(nano, results)}
    paths = []
    for stem, frame in parts.items():
        paths += tables.write_frame(folder, stem, frame)
    verdicts = {
        "T0: the d96 pair's drift since nano": {"the pair has drifted": drift_word,
                                                "delta for comparisons with nano and the forms": f"{delta:.4f}"},
        "T1: where each pair stands (4/7/10M, one seed)": dict(zip(
            (f"d{w}" for w in parts["standing"]["width"]), parts["standing"]["verdict"])),
        "T2: the registered forms at d128 and d160": ladder.forms_verdicts(forms),
        "T3: the gap still shrinks with width past d96": {"d160 below d96 by more than delta": trend_word},
        "T5: looping or reshaping at d96, 4M tokens, across seeds": ladder.seed_verdicts(parts["seeds"]),
        "T6: finer routing at the paper's geometry (4M, one seed)": dict(zip(parts["gqa4"]["pair"],
                                                                            parts["gqa4"]["verdict"])),
    }
    readme = folder / "README.md"
    readme.write_text(_readme(results, verdicts))
    return paths + [readme] + gap_figure(folder, nano, nano2_results, results, predictions)


def refit_break_even(nano: pd.DataFrame, results: pd.DataFrame) -> pd.DataFrame:
    """T4: the forms refitted to nano's and the ladder's >= 4M pairs together; their zero crossings at 10M."""
    own = ladder.matched_gaps(results)
    own = own[~own["pair_id"].str.contains("seed|gqa")] if len(own) else own
    if own.empty:
        return pd.DataFrame([{"form": f, "compute": math.nan, "low": math.nan, "high": math.nan, "pairs": 0}
                             for f in ladder.FORMS])
    both = pd.concat([ladder.matched_gaps(nano), own], ignore_index=True)
    empty = pd.DataFrame({"label": [], "flops": [], "tokens": []})
    crossings = ladder.bootstrap(both, empty)
    return pd.DataFrame([{"form": row.form, "compute": row.compute, "low": row.low, "high": row.high,
                          "pairs": both["pair_id"].nunique()} for row in crossings.itertuples()])


def _readme(results: pd.DataFrame, verdicts: dict) -> str:
    runs = results["run_id"].nunique() if len(results) else 0
    lines = ["# ladder: where SMELT starts to win (generated by `make fits`; do not edit)", "",
             "The protocol is docs/results-ladder.md (committed before the runs); the inputs are `results.csv` "
             f"({len(results)} endpoint rows of {runs} runs) and nano's and nano2's results. A verdict is "
             "\"pending\" while its endpoints are not all in.", ""]
    for group, found in verdicts.items():
        lines += [f"## {group}", ""] + [f"- {name}: **{value}**" for name, value in found.items()] + [""]
    lines += ["Tables: `predictions.md` (registered before the runs), `drift.md` (T0), `standing.md` (T1), "
              "`forms.md` (T2), `trend.md` (T3), `breakeven.md` (T4), `seeds.md` (T5), `gqa4.md` (T6). "
              "Figure: `gap_vs_compute.png`.", ""]
    return "\n".join(lines)


def gap_figure(folder: Path, nano: pd.DataFrame, nano2_results: pd.DataFrame, results: pd.DataFrame,
               predictions: pd.DataFrame) -> list[Path]:
    """SMELT - Baseline gap against the Baseline's training compute for every matched endpoint of nano,
    nano2 and the ladder; the registered forms (left: CPU scale) and the paper laws (right: up to its
    break-even), solid inside the compute their fit saw and dashed outside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (near, far) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.2, 1]})
    fitted = ladder.matched_gaps(nano)
    lo, hi = fitted["compute"].min(), fitted["compute"].max()
    for (name, table, marker), color in zip((("nano", nano, "o"), ("nano2", nano2_results, "s"),
                                             ("ladder", results, "D")), ("tab:blue", "tab:orange", "black")):
        gaps = ladder.matched_gaps(table, 0)
        if len(gaps):
            long = gaps["tokens"] >= ladder.MIN_TOKENS
            near.scatter(gaps["compute"][long], gaps["gap"][long], marker=marker, s=24, color=color,
                         label=f"{name}, >= 4M tokens")
            near.scatter(gaps["compute"][~long], gaps["gap"][~long], marker=marker, s=24, facecolors="none",
                         edgecolors=color, label=f"{name}, < 4M tokens")
    grid = np.logspace(math.log10(lo) - 0.3, 14.5, 200)
    ten_m = 10e6
    for form, color in zip(ladder.FORMS, ("tab:red", "tab:purple", "tab:green")):
        coef = ladder.fit_form(form, fitted)
        curve = ladder.predict_form(form, coef, grid / ten_m, np.full_like(grid, ten_m))
        _inside_dashed(near, grid, curve, lo, hi, color, f"{form} (fitted to nano >= 4M)")
    near.axhline(0, color="black", lw=0.8)
    near.set_xscale("log")
    near.set_xlabel("training compute C = F D of the Baseline (FLOPs)")
    near.set_ylabel("validation loss, SMELT - Baseline (nats)")
    near.set_title("CPU scale: every matched endpoint; forms registered before the ladder ran\n"
                   "(width+tokens drawn at 10M tokens; dashed: outside the compute they were fitted on)", fontsize=9)
    near.legend(fontsize=7)
    _, middle, _ = ladder.tokens_per_flop_span(fitted)
    wide = np.logspace(11.3, 22.5, 300)
    flops = np.sqrt(wide / middle)
    gap = ladder.paper_gap(flops, ladder.PAPER_SPARSITY, flops, ladder.PAPER_SPARSITY, wide / flops)
    _inside_dashed(far, wide, gap, *paper.COMPUTE_RANGE, "tab:blue", f"paper's laws (D/F = {middle:.1f}, S = 0.937)")
    coef = ladder.fit_form("log-linear", fitted)
    _inside_dashed(far, wide, ladder.predict_form("log-linear", coef, wide / ten_m, np.full_like(wide, ten_m)),
                   lo, hi, "tab:red", "log-linear form (nano)")
    breakeven = predictions[(predictions["form"] == "paper") & predictions["point"].str.startswith("break")].iloc[0]
    far.axvspan(breakeven["low"], breakeven["high"], color="tab:blue", alpha=0.12, label="paper break-even range")
    far.axhline(0, color="black", lw=0.8)
    far.set_xscale("log")
    far.set_yscale("symlog", linthresh=0.05)
    far.set_xlabel("training compute C (FLOPs)")
    far.set_title("Up to the paper's scale (symlog): where each curve crosses zero", fontsize=9)
    far.legend(fontsize=7)
    fig.tight_layout()
    return figures.save_figure(fig, folder, "gap_vs_compute")


def _inside_dashed(ax, x, y, lo, hi, color, label):
    inside = (x >= lo) & (x <= hi)
    ax.plot(x[inside], y[inside], color=color, lw=1.6, label=label)
    for part in (x < lo, x > hi):
        if part.any():
            ax.plot(x[part], y[part], color=color, lw=1.2, ls="--")

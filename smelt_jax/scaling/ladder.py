"""The pre-registered `ladder` predictions (docs/results-ladder.md): pure functions of endpoint tables.

A *gap* is L(SMELT) - L(Baseline) of one matched pair at one horizon; its compute is the Baseline's
C = F x D (training FLOPs per token times tokens). The registered forms, each fitted by least squares to
nano's matched endpoints at >= 4M tokens (`nano_gaps`):

    log-linear     gap = a + b log10 C                  (crosses zero at C = 10^(-a/b) when b < 0)
    power          gap = 10^a C^b                       (never crosses zero)
    width+tokens   gap = a + b log10 F + c log10 D      (width and tokens as separate terms)

Intervals resample whole pairs (a run's horizons are branches of one trajectory, not independent
points): each draw refits every form on the drawn pairs and adds one of that fit's residuals, so the
90% interval is a prediction interval for one new pair's gap, not only for the fitted mean.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from smelt_jax.design import paper

MIN_TOKENS = 3.5e6  # "at >= 4M tokens": the 4, 7 and 10M branches (endpoints land a few thousand tokens off)
FORMS = ("log-linear", "power", "width+tokens")
LEVEL = 0.90
N_DRAWS, SEED = 4000, 0
# The paper law's break-even path: F_smelt = F_baseline, sparsity S, and a fixed tokens-per-FLOP ratio
# D / F. Central ratio and interval: the geometric middle and the ends of nano's >= 4M endpoints' span.
PAPER_SPARSITY = 0.937  # nano's and the ladder's compute-equivalent sparsity (0.936-0.938)
RMSE_BAND = math.hypot(paper.RMSE["baseline"], paper.RMSE["smelt"])


def matched_gaps(results: pd.DataFrame, min_tokens: float = MIN_TOKENS) -> pd.DataFrame:
    """Every matched (Baseline, SMELT) endpoint pair of a suite table at >= min_tokens: pair_id, scale,
    branch, tokens, flops (the Baseline's F), compute (F x D), baseline, smelt (losses) and gap."""
    base = results[results["arch"] == "baseline"].set_index(["pair_id", "branch"])
    smelt = results[results["arch"] == "smelt"].set_index(["pair_id", "branch"])
    rows = []
    for key in sorted(set(base.index) & set(smelt.index)):
        b, s = base.loc[key], smelt.loc[key]
        if b["tokens"] < min_tokens:
            continue
        rows.append({"pair_id": key[0], "scale": b["scale"], "branch": int(key[1]), "tokens": int(b["tokens"]),
                     "flops": float(b["flops_per_token"]), "compute": float(b["flops_per_token"] * b["tokens"]),
                     "baseline": float(b["val_loss"]), "smelt": float(s["val_loss"]),
                     "gap": float(s["val_loss"] - b["val_loss"])})
    return pd.DataFrame(rows)


def _design(form: str, flops, tokens) -> np.ndarray:
    flops, tokens = np.asarray(flops, float), np.asarray(tokens, float)
    one = np.ones_like(flops)
    if form == "width+tokens":
        return np.stack([one, np.log10(flops), np.log10(tokens)], axis=-1)
    return np.stack([one, np.log10(flops * tokens)], axis=-1)


def fit_form(form: str, table: pd.DataFrame) -> np.ndarray:
    """Least-squares coefficients of `form` on a gap table (columns flops, tokens, gap)."""
    target = np.log10(table["gap"]) if form == "power" else table["gap"]
    coef, *_ = np.linalg.lstsq(_design(form, table["flops"], table["tokens"]), np.asarray(target, float),
                               rcond=None)
    return coef


def predict_form(form: str, coef: np.ndarray, flops, tokens) -> np.ndarray:
    value = _design(form, flops, tokens) @ coef
    return 10.0 ** value if form == "power" else value


def _residuals(form: str, coef: np.ndarray, table: pd.DataFrame) -> np.ndarray:
    fitted = _design(form, table["flops"], table["tokens"]) @ coef
    target = np.log10(table["gap"]) if form == "power" else table["gap"]
    return np.asarray(target, float) - fitted


def break_even_10m(form: str, coef: np.ndarray, tokens: float = 10e6) -> float:
    """Compute C = F x D at which the form's gap is zero with D = `tokens` (inf when it never is)."""
    if form == "power":
        return math.inf
    if form == "log-linear":
        return 10.0 ** (-coef[0] / coef[1]) if coef[1] < 0 else math.inf
    if coef[1] >= 0:
        return math.inf
    log_f = -(coef[0] + coef[2] * math.log10(tokens)) / coef[1]
    return 10.0 ** log_f * tokens


def bootstrap(table: pd.DataFrame, points: pd.DataFrame, *, n_draws: int = N_DRAWS, seed: int = SEED,
              level: float = LEVEL) -> pd.DataFrame:
    """Per form and point (columns label, flops, tokens): the full-data prediction and the `level`
    prediction interval from resampling whole pairs (draws with fewer than two widths are redrawn), and
    the form's break-even compute at 10M tokens with its interval."""
    rng = np.random.default_rng(seed)
    pairs = sorted(table["pair_id"].unique())
    by_pair = {p: table[table["pair_id"] == p] for p in pairs}
    draws = {form: [] for form in FORMS}
    breaks = {form: [] for form in FORMS}
    while len(draws[FORMS[0]]) < n_draws:
        chosen = rng.choice(len(pairs), size=len(pairs), replace=True)
        sample = pd.concat([by_pair[pairs[i]] for i in chosen], ignore_index=True)
        if sample["flops"].nunique() < 2:
            continue
        for form in FORMS:
            coef = fit_form(form, sample)
            noise = rng.choice(_residuals(form, coef, sample), size=len(points))
            central = _design(form, points["flops"], points["tokens"]) @ coef + noise
            draws[form].append(10.0 ** central if form == "power" else central)
            breaks[form].append(break_even_10m(form, coef))
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    rows = []
    for form in FORMS:
        coef = fit_form(form, table)
        values = np.asarray(draws[form])
        best = predict_form(form, coef, points["flops"], points["tokens"])
        for j, point in enumerate(points.itertuples()):
            rows.append({"form": form, "point": point.label, "tokens": int(point.tokens),
                         "compute": float(point.flops * point.tokens), "predicted": float(best[j]),
                         "low": float(np.quantile(values[:, j], lo)), "high": float(np.quantile(values[:, j], hi))})
        crossing = np.asarray(breaks[form])
        finite = np.isfinite(crossing)
        rows.append({"form": form, "point": "break-even at 10M tokens", "tokens": int(10e6),
                     "compute": break_even_10m(form, coef), "predicted": math.nan,
                     "low": float(np.quantile(crossing, lo)) if finite.mean() > lo else math.inf,
                     "high": float(np.quantile(crossing, hi)) if finite.mean() >= hi else math.inf,
                     "share_crossing": float(finite.mean())})
    return pd.DataFrame(rows)


def paper_gap(flops_base, sparsity_base, flops_smelt, sparsity_smelt, tokens) -> np.ndarray:
    """The paper's fitted laws' L_smelt(F_s, S_s, D) - L_base(F_b, S_b, D) (as nano2's transfer table)."""
    return (paper.SMELT_LAW.predict(flops_smelt, sparsity_smelt, tokens)
            - paper.BASELINE_LAW.predict(flops_base, sparsity_base, tokens))


def paper_break_even(tokens_per_flop: float, sparsity: float = PAPER_SPARSITY, band: float = 0.0) -> tuple:
    """Computes C (ascending) where the paper law's gap along F_s = F_b, D = r F, C = F D first falls to
    `band` and, if it does, where it rises back above it: (first, last) of the region gap <= band."""
    computes = np.logspace(12, 27, 3001)
    flops = np.sqrt(computes / tokens_per_flop)
    gap = paper_gap(flops, sparsity, flops, sparsity, computes / flops)
    inside = np.nonzero(gap <= band)[0]
    if not len(inside):
        return math.inf, math.inf
    return float(computes[inside[0]]), float(computes[inside[-1]])


def tokens_per_flop_span(table: pd.DataFrame) -> tuple[float, float, float]:
    """(low, geometric middle, high) of D / F over a gap table."""
    ratio = table["tokens"] / table["flops"]
    low, high = float(ratio.min()), float(ratio.max())
    return low, math.sqrt(low * high), high


# ----------------------------------------------------------------------------- the registered tests

DELTA = 0.015  # nats: the noise floor (docs/results-ladder.md, as nano2)
LONG = (4e6, 7e6, 10e6)
LADDER_WIDTHS = (96, 128, 160)
T_975_DF2 = 4.303  # two-sided 95% t quantile with 2 degrees of freedom (3 seeds)
PENDING = "pending"


def _gap(results: pd.DataFrame, pair_id: str, at: float) -> float:
    from smelt_jax.scaling.nano2 import endpoint
    return endpoint(results, pair_id, "smelt", at) - endpoint(results, pair_id, "baseline", at)


def _count(values, test, needed: int = 2) -> bool:
    return int(sum(bool(test(v)) for v in values)) >= needed


def pair_drift(ladder: pd.DataFrame, nano: pd.DataFrame) -> pd.DataFrame:
    """T0: the d96 re-run against nano's d96 pair at 4, 7, 10M: both gaps, their difference, each member's."""
    from smelt_jax.scaling.nano2 import endpoint
    rows = []
    for at in LONG:
        row = {"tokens": at, "gap_ladder": _gap(ladder, "ladder-d96", at), "gap_nano": _gap(nano, "nano-d96-s95", at)}
        row["drift"] = row["gap_ladder"] - row["gap_nano"]
        for arch in ("baseline", "smelt"):
            row[f"{arch}_drift"] = endpoint(ladder, "ladder-d96", arch, at) - endpoint(nano, "nano-d96-s95", arch, at)
        rows.append(row)
    return pd.DataFrame(rows)


def drift_verdict(table: pd.DataFrame) -> tuple[str, float]:
    """("supported" / "not supported" / pending, the delta for comparisons with nano or the forms)."""
    drift = table["drift"].to_numpy(float)
    if np.isnan(drift).any():
        return PENDING, DELTA
    if _count(drift, lambda v: abs(v) > DELTA):
        return "supported", DELTA + abs(float(drift.mean()))
    return "not supported", DELTA


def standing(ladder: pd.DataFrame) -> pd.DataFrame:
    """T1: each ladder pair's gap at 4, 7, 10M and where it stands."""
    rows = []
    for width in LADDER_WIDTHS:
        gaps = [_gap(ladder, f"ladder-d{width}", at) for at in LONG]
        if np.isnan(gaps).any():
            verdict = PENDING
        elif _count(gaps, lambda g: g < -DELTA):
            verdict = "SMELT wins"
        elif _count(gaps, lambda g: g > DELTA):
            verdict = "SMELT trails"
        elif _count(gaps, lambda g: abs(g) <= DELTA):
            verdict = "tie"
        else:
            verdict = "not resolved"
        rows.append({"width": width, **{f"gap_{at / 1e6:g}M": g for at, g in zip(LONG, gaps)}, "verdict": verdict})
    return pd.DataFrame(rows)


def forms_check(predictions: pd.DataFrame, ladder: pd.DataFrame) -> pd.DataFrame:
    """T2: each form's registered interval at d128 and d160 (4M, 10M) against the measured gap."""
    rows = []
    for form in FORMS:
        for width in (128, 160):
            for at in (4e6, 10e6):
                label = f"d{width} {at / 1e6:g}M"
                registered = predictions[(predictions["form"] == form) & (predictions["point"] == label)].iloc[0]
                measured = _gap(ladder, f"ladder-d{width}", at)
                rows.append({"form": form, "point": label, "predicted": registered["predicted"],
                             "low": registered["low"], "high": registered["high"], "measured": measured,
                             "inside": bool(registered["low"] <= measured <= registered["high"])
                             if np.isfinite(measured) else None})
    return pd.DataFrame(rows)


def forms_verdicts(table: pd.DataFrame) -> dict[str, str]:
    out = {}
    for form in FORMS:
        rows = table[table["form"] == form]
        if rows["measured"].isna().any():
            out[form] = PENDING
            continue
        outside = int((~rows["inside"].astype(bool)).sum())
        mae = float((rows["measured"] - rows["predicted"]).abs().mean())
        out[form] = f"{'rejected' if outside >= 2 else 'consistent'} ({outside} of 4 outside; mean |error| {mae:.3f})"
    return out


def trend(ladder: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """T3: gaps of d96, d128, d160 at 4, 7, 10M, and whether d160's is below d96's by more than delta."""
    table = pd.DataFrame([{"tokens": at, **{f"d{w}": _gap(ladder, f"ladder-d{w}", at) for w in LADDER_WIDTHS}}
                          for at in LONG])
    if table[["d96", "d160"]].isna().any().any():
        return table, PENDING
    shrinks = _count(table["d160"] - table["d96"], lambda v: v < -DELTA)
    return table, "supported" if shrinks else "not supported"


def seeds(ladder: pd.DataFrame) -> pd.DataFrame:
    """T5 inputs: per seed at d96 and 4M, Baseline, SMELT and control losses, Loop and Reshape. Seed 0's
    Baseline and SMELT are the d96 re-run's 4M branch."""
    from smelt_jax.scaling.nano2 import endpoint
    rows = []
    for seed in (0, 1, 2):
        pair = f"ladder-d96-seed{seed}"
        base = endpoint(ladder, "ladder-d96" if seed == 0 else pair, "baseline", 4e6)
        smelt = endpoint(ladder, "ladder-d96" if seed == 0 else pair, "smelt", 4e6)
        control = endpoint(ladder, pair, "unrolled", 4e6)
        rows.append({"seed": seed, "baseline": base, "smelt": smelt, "control": control,
                     "loop": smelt - control, "reshape": control - base})
    return pd.DataFrame(rows)


def seed_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the mean of 3 seeds and its 95% t-interval."""
    values = np.asarray(values, float)
    mean = float(values.mean())
    half = T_975_DF2 * float(values.std(ddof=1)) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def seed_verdicts(table: pd.DataFrame) -> dict[str, str]:
    """T5: looping and reshaping across seeds, and which is the larger."""
    if table[["loop", "reshape"]].isna().any().any():
        return {"looping": PENDING, "reshaping": PENDING, "the larger term": PENDING}
    out = {}
    for name, column in (("looping", "loop"), ("reshaping", "reshape")):
        mean, low, high = seed_interval(table[column])
        if low > 0:
            word = "costs: supported" + (" (small: below delta)" if high < DELTA else "")
        elif high < 0:
            word = "helps: supported"
        elif low > -DELTA and high < DELTA:
            word = "negligible"
        else:
            word = "not resolved"
        out[name] = f"{word} (mean {mean:+.4f}, 95% t-interval [{low:+.4f}, {high:+.4f}], 3 seeds)"
    mean, low, high = seed_interval(table["reshape"] - table["loop"])
    word = "reshaping larger" if low > 0 else "looping larger" if high < 0 else "not resolved"
    out["the larger term"] = f"{word} (Reshape - Loop {mean:+.4f}, [{low:+.4f}, {high:+.4f}])"
    return out


def gqa4(ladder: pd.DataFrame, nano2_results: pd.DataFrame) -> pd.DataFrame:
    """T6: the gqa4 pairs' gap at 4M beside the multi-head ladder pair of the same width; the d96 gqa4
    pair at seed 1 beside nano2's seed 0."""
    rows = []
    for width in (128, 160):
        gap, multi = _gap(ladder, f"ladder-d{width}gqa-gqa4", 4e6), _gap(ladder, f"ladder-d{width}", 4e6)
        verdict = (PENDING if np.isnan([gap, multi]).any() else "closes" if gap < multi - DELTA
                   else "opens" if gap > multi + DELTA else "not resolved")
        rows.append({"pair": f"d{width} gqa4", "gap_4M": gap, "multi_head_gap_4M": multi, "verdict": verdict})
    gap = _gap(ladder, "ladder-d96gqa-gqa4-seed1", 4e6)
    rows.append({"pair": "d96 gqa4 seed 1", "gap_4M": gap,
                 "multi_head_gap_4M": _gap(nano2_results, "nano2-d96gqa-gqa4", 4e6),
                 "verdict": PENDING if np.isnan(gap) else "seed spread (nano2's seed 0 in the second column)"})
    return pd.DataFrame(rows)

"""File-level steps behind the CLI: fit a table into a directory, CE-gain reports, tables, and the paper's and
Chinchilla's fit folders. A suite folder's fits and `fits-all` are `scaling/suite_fits.py`.

A fit directory holds coefficients.json (the law's parameters under their own names, fit statistics,
bootstrap intervals), points.csv (the fitted rows) and, when bootstrapped, bootstrap.npz (raw draws [draws, p]).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from smelt_jax.design import paper
from smelt_jax.platform.errors import MissingInput, UsageError
from smelt_jax.platform.storage import naming
from smelt_jax.scaling import (
    figures,
    bootstrap,
    fit,
    gains,
    health,
    io,
    tables,
    written,
)
from smelt_jax.scaling.laws import LAWS, ChinchillaLaw, SmeltLaw


def write_json(path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):  # a full disk says which file (issue 53)
        path.write_text(json.dumps(written.rounded(data), indent=2, sort_keys=True) + "\n")
    return path


def fit_table(table: pd.DataFrame, law_name: str, *, method: str = "huber", n_bootstrap: int = 0,
              seed: int = 0) -> tuple[dict, dict | None]:
    """Fit a validated table. Returns (coefficients dict, bootstrap dict or None)."""
    law = LAWS[law_name]
    features, loss = law.features(table), table["loss"].to_numpy(float)
    if method == "huber":
        result = fit.fit_law(law, features, loss)
    elif method == "huber-likelihood":
        result = fit.fit_huber_likelihood(law, features, loss)
    else:
        raise UsageError(f"unknown method {method!r} (huber | huber-likelihood)")
    coefficients = {**result.to_dict(), "delta": fit.HUBER_DELTA}
    if law is SmeltLaw:
        coefficients["compute_range"] = list(gains.fitted_compute_range(table["F"], table["D"]))
    elif law is ChinchillaLaw:
        coefficients["compute_range"] = [float((6 * table["N"] * table["D"]).min()),
                                         float((6 * table["N"] * table["D"]).max())]
    boot = None
    if n_bootstrap:
        boot = bootstrap.cell_bootstrap(law, features, loss, table["cell"].astype(str).to_numpy(),
                                        np.asarray(result.raw), n_draws=n_bootstrap, seed=seed)
        coefficients["intervals"] = boot["intervals"]
        coefficients["bootstrap"] = {k: boot[k] for k in ("n_draws", "n_converged", "n_cells", "seed")}
    return written.settle_bounds(coefficients, law), boot


def read_input(path) -> pd.DataFrame:
    """An input table (io.read_table); an empty or unparsable file is one UsageError line."""
    try:
        return io.read_table(path)
    except pd.errors.EmptyDataError:
        raise UsageError(f"{path}: empty file (no header, no rows)") from None
    except pd.errors.ParserError as err:
        raise UsageError(f"{path}: not a CSV table ({str(err).splitlines()[0]})") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not a text CSV table (a binary file? {err.reason} at byte {err.start})") from None


def fit_to_dir(input_path, law_name: str, out_dir, *, arch: str | None = None, method: str = "huber",
               n_bootstrap: int = 0, seed: int = 0, recorded_input=None) -> dict:
    """Fit `input_path` into `out_dir`; coefficients.json records `recorded_input` (default the path)
    as its input."""
    table = read_input(input_path)
    if arch is not None:
        if "arch" not in table.columns:
            raise UsageError(f"{input_path}: --arch given but the table has no 'arch' column")
        table = table[table["arch"].astype(str) == arch]
        if table.empty:
            raise UsageError(f"{input_path}: no rows with arch == {arch!r}")
    table = io.validate(table, law_name, str(input_path))
    coefficients, boot = fit_table(table, law_name, method=method, n_bootstrap=n_bootstrap, seed=seed)
    coefficients.update({"input": str(recorded_input or input_path), "arch": arch})
    out_dir = Path(out_dir)
    write_json(out_dir / "coefficients.json", coefficients)
    sort_cols = [c for c in LAWS[law_name].columns if c in table.columns]
    with naming(out_dir / "points.csv"):
        table.sort_values(sort_cols, kind="stable").to_csv(out_dir / "points.csv", index=False)
    if boot is not None:
        with naming(out_dir / "bootstrap.npz"):
            np.savez(out_dir / "bootstrap.npz", raw=boot["raw"], converged=boot["converged"])
    return coefficients


def _draws(coefficients: dict):
    """Bootstrap laws stored next to a coefficients.json, or None."""
    path = Path(coefficients["_path"]).parent / "bootstrap.npz"
    if not path.exists():
        return None
    data = np.load(path)
    law = type(coefficients["_law"])
    return [law.from_raw(r) if ok else None for r, ok in zip(data["raw"], data["converged"])]


def _paired_draws(ref: dict, tgt: dict):
    """Bootstrap laws of both fits, draw by draw, keeping draws where both converged; (None, None)
    without paired draws (same count, from fits with the same seed and cells)."""
    ref_draws, tgt_draws = _draws(ref), _draws(tgt)
    if ref_draws is None or tgt_draws is None or len(ref_draws) != len(tgt_draws):
        return None, None
    pairs = [(r, t) for r, t in zip(ref_draws, tgt_draws) if r is not None and t is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def common_range(coefficient_dicts):
    """The compute range every fit covers (C_min, C_max), or None when none records one."""
    ranges = [d.get("compute_range") for d in coefficient_dicts if d.get("compute_range")]
    return (max(r[0] for r in ranges), min(r[1] for r in ranges)) if ranges else None


def gain_report(reference_path, target_path, computes, sparsities) -> list[dict]:
    """CE-gain rows of target over reference (both smelt-law coefficients), with intervals when both
    directories hold paired bootstrap draws (same count)."""
    ref, tgt = io.load_coefficients(reference_path), io.load_coefficients(target_path)
    for data in (ref, tgt):
        if not isinstance(data["_law"], SmeltLaw):
            raise UsageError(f"{data['_path']}: CE gains need smelt-law coefficients, got {data['law']}")  # noqa: TRY004
    ref_draws, tgt_draws = _paired_draws(ref, tgt)
    return gains.gain_rows(ref["_law"], tgt["_law"], computes, sparsities, compute_range=common_range((ref, tgt)),
                           reference_draws=ref_draws, target_draws=tgt_draws)


def write_fit_tables(fit_dir) -> list[Path]:
    """Coefficient table (md/csv/tex) and, for smelt-law fits, the loss-vs-compute figure."""
    fit_dir = Path(fit_dir)
    coefficients = io.load_coefficients(fit_dir)
    rows = tables.coefficient_rows(coefficients)
    columns = [c for c in ("parameter", "estimate", "se", "lo", "hi") if any(c in r for r in rows)]
    paths = tables.write_table(fit_dir, "coefficients", rows, columns)
    if isinstance(coefficients["_law"], SmeltLaw):
        points_path = fit_dir / "points.csv"
        if points_path.exists():   # a figure only where there are fitted points to show
            paths += figures.loss_vs_compute_figure(
                fit_dir, {coefficients.get("arch") or "fit": coefficients["_law"]}, pd.read_csv(points_path),
                compute_range=coefficients.get("compute_range"),
                problems=health.assess_fit(coefficients, losses=io.fit_losses(coefficients)))
    return paths


def write_pair_tables(pair_dir, reference="baseline", target="smelt", computes=paper.COMPUTES,
                      sparsities=paper.SPARSITIES) -> list[Path]:
    """CE-gain table and figures for a directory holding reference/ and target/ fit directories."""
    pair_dir = Path(pair_dir)
    rows = gain_report(pair_dir / reference, pair_dir / target, computes, sparsities)
    columns, headers = tables.gain_columns(rows)
    paths = tables.write_table(pair_dir, "ce_gain", rows, columns, headers)
    ref, tgt = io.load_coefficients(pair_dir / reference), io.load_coefficients(pair_dir / target)
    ref_draws, tgt_draws = _paired_draws(ref, tgt)
    points_path = pair_dir / "points.csv"  # a trained suite's sparse endpoints, shown with the frontiers
    points = pd.read_csv(points_path) if points_path.exists() else None
    # the figures span the data's compute range (both fits', or the points'), widened to the tabulated
    # computes; outside the range they draw extrapolation
    data_range = common_range((ref, tgt)) or (gains.fitted_compute_range(points["F"], points["D"])
                                                if points is not None else None)
    problems = [p for fit in (ref, tgt) for p in health.assess_fit(fit, losses=io.fit_losses(fit))]
    paths += figures.ce_gain_figure(pair_dir, ref["_law"], tgt["_law"], sparsities, compute=computes,
                                   reference_draws=ref_draws, target_draws=tgt_draws,
                                   compute_range=data_range, problems=problems)
    paths += figures.loss_vs_compute_figure(pair_dir, {reference: ref["_law"], target: tgt["_law"]},
                                           points=points, sparsities=sparsities, compute=computes,
                                           compute_range=data_range, problems=problems)
    return paths


def write_tables(path) -> list[Path]:
    """`smelt tables DIR`: a fit directory (coefficients.json) or a pair directory (pair.json)."""
    path = Path(path)
    if (path / "pair.json").exists():
        pair = json.loads((path / "pair.json").read_text())
        paths = []
        for name in (pair["reference"], pair["target"]):
            paths += write_fit_tables(path / name)
        return paths + write_pair_tables(path, pair["reference"], pair["target"], pair["compute"],
                                         pair["sparsity"])
    if (path / "coefficients.json").exists():
        return write_fit_tables(path)
    raise MissingInput(f"{path}: neither coefficients.json nor pair.json found")


# ---------------------------------------------------------------------------------------------------
# fits-all

def write_paper_fits(out_dir) -> list[Path]:
    """fits/paper/: the published coefficients as fit directories, and the CE-gain/TPP tables from them."""
    out_dir = Path(out_dir)
    for name, law in (("baseline", paper.BASELINE_LAW), ("smelt", paper.SMELT_LAW)):
        write_json(out_dir / name / "coefficients.json",
                   {"law": "smelt", **law.to_dict(), "rmse": paper.RMSE[name], "n_points": paper.N_POINTS,
                    "arch": name, "source": "SMELT paper, docs/paper.md §7 (published coefficients)",
                    "compute_range": list(paper.COMPUTE_RANGE),
                    "compute_range_note": "approximate: 6 x active params (docs/paper.md §4) x horizons (docs/paper.md §5)"})
    write_json(out_dir / "pair.json", {"reference": "baseline", "target": "smelt",
                                       "compute": list(paper.COMPUTES), "sparsity": list(paper.SPARSITIES)})
    paths = write_tables(out_dir)
    rows = []
    for row in gains.gain_rows(paper.BASELINE_LAW, paper.SMELT_LAW, paper.COMPUTES, paper.SPARSITIES):
        published, lo, hi = paper.CE_GAIN[(row["C"], row["S"])]
        tpp = paper.TPP_1E21.get(row["S"]) if row["C"] == 1e21 else None
        rows.append({"C": row["C"], "S": row["S"], "ours": f"{100 * row['ce_gain']:.2f}",
                     "paper": f"{published:.1f} [{lo}, {hi}]",
                     "diff_pp": f"{100 * row['ce_gain'] - published:+.2f}",
                     "tpp_ours": f"{tables.fmt(row['tpp_reference'], 'tpp_reference')} / "
                                 f"{tables.fmt(row['tpp_target'], 'tpp_target')}",
                     "tpp_paper": f"{tpp[0]} / {tpp[1]}" if tpp else "-"})
    return paths + tables.write_table(
        out_dir, "paper_comparison", rows, ["C", "S", "ours", "paper", "diff_pp", "tpp_ours", "tpp_paper"],
        ["C", "S", "CE ours (%)", "CE paper (%) [95% CI]", "diff (pp)", "TPP ours B/S", "TPP paper B/S"])


CHINCHILLA_DEFINITION = {
    "data": "smelt_jax/reference_data/chinchilla/svg_extracted_data.csv",
    "filter": "keep loss < sorted(loss)[-5] (240 of 245 points); D = C / (6 N)",
    "law": "chinchilla",
    "point_estimate": "Huber-density NLL (delta 1e-3, free scale), scipy BFGS from Hoffmann's unrounded values",
    "bootstrap": {"draws": 4000, "seed": 42, "resample": "points, np.random.seed(42) + np.random.choice",
                  "objective": "Huber sum (delta 1e-3)", "start": "Hoffmann's unrounded values",
                  "optimizer": "vectorised L-BFGS (smelt_jax.scaling.lbfgs)"},
    "epoch_published": {"E": 1.8169, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3659,
                        "se": {"A": 124.52, "B": 1293.28, "E": 0.0257, "alpha": 0.0154, "beta": 0.0206}},
}


def write_chinchilla_fits(out_dir, n_draws: int = 4000, csv_path=None) -> list[Path]:
    """fits/chinchilla/: Epoch AI's replication (point estimate, bootstrap SEs) and the Huber grid fit."""
    out_dir = Path(out_dir)
    table, kept, n_rows = io.chinchilla_table(csv_path)
    features, loss = ChinchillaLaw.features(table), table["loss"].to_numpy(float)
    epoch = fit.fit_huber_likelihood(ChinchillaLaw, features, loss)
    grid = fit.fit_law(ChinchillaLaw, features, loss)
    weights = bootstrap.epoch_point_weights(n_rows, kept, n_draws, seed=42)
    boot = bootstrap.refit(ChinchillaLaw, features, loss, weights, fit.HOFFMANN_RAW)
    ivals = bootstrap.intervals(bootstrap.parameter_draws(ChinchillaLaw, boot["raw"][boot["converged"]]))
    definition = {**CHINCHILLA_DEFINITION, "bootstrap": {**CHINCHILLA_DEFINITION["bootstrap"], "draws": n_draws}}
    write_json(out_dir / "fit.json", definition)
    coefficients = {**epoch.to_dict(), "intervals": ivals,
                    "bootstrap": {"n_draws": n_draws, "n_converged": int(boot["converged"].sum()), "seed": 42},
                    "huber_grid_fit": grid.to_dict(), "n_points": len(loss)}
    coefficients = written.settle_bounds(coefficients, ChinchillaLaw)
    write_json(out_dir / "coefficients.json", coefficients)
    published, ours = CHINCHILLA_DEFINITION["epoch_published"], written.rounded(coefficients)
    rows = []
    for name in ChinchillaLaw.param_names:  # our values as written in coefficients.json
        rows.append({"parameter": name, "ours": ours[name], "epoch": published[name],
                     "ours_se": ours["intervals"][name]["se"], "epoch_se": published["se"][name],
                     "huber_grid": ours["huber_grid_fit"][name]})
    return [out_dir / "fit.json", out_dir / "coefficients.json"] + tables.write_table(
        out_dir, "replication", rows, ["parameter", "ours", "epoch", "ours_se", "epoch_se", "huber_grid"],
        ["parameter", "ours", "Epoch", "ours SE", "Epoch SE", "Huber-sum grid fit"])


def _one_figure(value: float) -> float:
    exponent = math.floor(math.log10(value))
    return float(round(value / 10 ** exponent) * 10.0 ** exponent)


def gain_grid(points: pd.DataFrame) -> tuple[list[float], list[float]]:
    """Computes and sparsities at which to report CE gains: three computes inside the fitted C = F x D
    range (20%, 50% and 80% of its log span, one significant figure) and one extrapolated a decade
    beyond its top (the table marks it), at the table's sparsity levels (mean S per label, to 0.01)."""
    compute = points["F"] * points["D"]
    log_low, log_high = math.log10(float(compute.min())), math.log10(float(compute.max()))
    inside = [_one_figure(10 ** (log_low + share * (log_high - log_low))) for share in (0.2, 0.5, 0.8)]
    computes = sorted({*inside, _one_figure(10 ** (log_high + 1))})
    return computes, figures.point_sparsities(points)

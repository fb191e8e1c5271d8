"""File-level steps behind the CLI: fit a table into a directory, CE-gain reports, tables, and `fits-all`.

A fit directory holds coefficients.json (the law's parameters under their own names, fit statistics,
bootstrap intervals), points.csv (the fitted rows) and, when bootstrapped, bootstrap.npz (raw draws [draws, p]).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from smelt_jax.design import paper
from smelt_jax.platform.errors import MissingInput, UsageError
from smelt_jax.platform.storage import naming
from smelt_jax.scaling import (
    bootstrap,
    endpoints,
    fit,
    gains,
    health,
    io,
    ladder_report,
    nano2_report,
    preregistered,
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


def _common_range(coefficient_dicts):
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
    return gains.gain_rows(ref["_law"], tgt["_law"], computes, sparsities, compute_range=_common_range((ref, tgt)),
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
            paths += tables.loss_vs_compute_figure(
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
    data_range = _common_range((ref, tgt)) or (gains.fitted_compute_range(points["F"], points["D"])
                                                if points is not None else None)
    problems = [p for fit in (ref, tgt) for p in health.assess_fit(fit, losses=io.fit_losses(fit))]
    paths += tables.ce_gain_figure(pair_dir, ref["_law"], tgt["_law"], sparsities, compute=computes,
                                   reference_draws=ref_draws, target_draws=tgt_draws,
                                   compute_range=data_range, problems=problems)
    paths += tables.loss_vs_compute_figure(pair_dir, {reference: ref["_law"], target: tgt["_law"]},
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
    return computes, tables.point_sparsities(points)


# A suite folder's fit protocol (`fits/<suite>/fit.json`; these defaults where it has none). "analysis":
# "smelt-law" (the paper's L(F, S, D) per architecture) or "preregistered-fd" (docs/results-nano.md:
# L(F, D) per architecture, its pass/fail test, with "noise_pairs" {repeat pair_id: pair_id it repeats}
# kept out of the fits and "expected_points" the endpoints per architecture the test was written for).
DEFAULT_PROTOCOL = {"analysis": "smelt-law", "bootstrap_draws": 200, "seed": 0, "noise_pairs": {},
                    "expected_points": None, "reference_suites": []}
# "nano2": docs/results-nano2.md's comparisons (scaling/nano2.py), reading the "reference_suites"' results.csv
# beside the folder; "ladder": docs/results-ladder.md's (scaling/ladder.py), likewise.
ANALYSES = ("smelt-law", "preregistered-fd", "nano2", "ladder")


def suite_protocol(out_dir) -> dict:
    path = Path(out_dir) / "fit.json"
    given = json.loads(path.read_text()) if path.exists() else {}
    unknown = sorted(set(given) - set(DEFAULT_PROTOCOL))
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {unknown}; known: {sorted(DEFAULT_PROTOCOL)}")
    protocol = {**DEFAULT_PROTOCOL, **given}
    if protocol["analysis"] not in ANALYSES:
        raise UsageError(f"{path}: analysis {protocol['analysis']!r} is not one of {list(ANALYSES)}")
    if protocol["analysis"] == "preregistered-fd" and not isinstance(protocol["expected_points"], int):
        raise UsageError(f"{path}: the preregistered-fd analysis needs expected_points (endpoints per "
                         "architecture the test was written for)")
    return protocol


# What each results-store column used by the fit must hold: (check, what it says when it fails).
_ENDPOINT_VALUES = {
    "flops_per_token": (lambda v: v > 0, "> 0"), "tokens": (lambda v: v > 0, "> 0"),
    "sparsity": (lambda v: 0 <= v < 1, "in [0, 1)"), "val_loss": (lambda v: v > 0, "> 0"),
}


def check_endpoint_rows(results: pd.DataFrame, where: str) -> None:
    """UsageError naming the run and branch of every endpoint row (up to 5) whose fitted columns are
    not finite numbers in range: the row to fix or retrain, not a row number of points.csv."""
    bad = []
    values = {column: pd.to_numeric(results[column], errors="coerce").to_numpy(float)
              for column in _ENDPOINT_VALUES}
    for i in range(len(results)):
        for column, (ok, rule) in _ENDPOINT_VALUES.items():
            value = values[column][i]
            if not (math.isfinite(value) and ok(value)):
                row = results.iloc[i]
                bad.append(f"run {row['run_id']} branch {row['branch']}: {column}={row[column]!r} "
                           f"(must be a finite number {rule})")
                break
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise UsageError(f"{where}: {len(bad)} endpoint row(s) cannot be fitted: " + "; ".join(bad[:5]) + more
                         + "; fix their endpoint.json or retrain them, then `smelt results collect` and "
                         "`smelt results export`")


def read_suite_results(out_dir, include_custom: bool = False) -> pd.DataFrame:
    """`out_dir/results.csv` checked: the store's columns, and every endpoint row fittable. Rows whose
    `origin` (an `--include-custom` export's column) is not "grid" are left out unless `include_custom`
    (`off_grid_rows` counts them)."""
    path = Path(out_dir) / "results.csv"
    if not path.exists():
        raise MissingInput(f"{out_dir}: no results.csv (write it with `smelt results export --suite SUITE`)")
    results = endpoints.check_table(read_input(path), str(path))
    if not include_custom and "origin" in results.columns:
        results = results[results["origin"].astype(str) == "grid"].reset_index(drop=True)
    check_endpoint_rows(results, str(path))
    return results


def off_grid_rows(out_dir) -> int:
    """Rows of `out_dir/results.csv` that are not the suite's own grid runs (its `origin` column)."""
    path = Path(out_dir) / "results.csv"
    results = read_input(path) if path.exists() else pd.DataFrame()
    return int((results["origin"].astype(str) != "grid").sum()) if "origin" in results.columns else 0


def fit_suite_table(out_dir, include_custom: bool = False) -> list[Path]:
    """A trained suite's endpoints (`out_dir/results.csv`, the results store's rows) -> the law's input
    (`points.csv`: sparse endpoints), the smelt law fitted per architecture into baseline/ and smelt/
    with the folder's bootstrap protocol (`fit.json`), the pair's CE-gain tables and figures over the
    fitted compute range (`gain_grid`), the endpoint tables (`write_endpoint_tables`) and the tables of
    the folder's other inputs (`suite_extras`).

    All or nothing: the folder is copied to a staging sibling, written there, and swapped in (two
    renames) only when every step succeeded; on any error the folder is left as it was."""
    out_dir = Path(out_dir)
    protocol = suite_protocol(out_dir)
    results = read_suite_results(out_dir, include_custom)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.fitting-", dir=out_dir.parent))
    try:
        os.chmod(staging, 0o777 & ~_umask())
        shutil.copytree(out_dir, staging, dirs_exist_ok=True, symlinks=True)
        paths = _fit_suite_into(staging, out_dir, results, protocol)
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, trash / out_dir.name)
        os.replace(staging, out_dir)
        shutil.rmtree(trash, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out_dir / path.relative_to(staging) for path in paths]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fit_suite_into(folder: Path, out_dir: Path, results: pd.DataFrame, protocol: dict) -> list[Path]:
    """`fit_suite_table`'s steps, written into `folder` (recording `out_dir` as the fits' input)."""
    if protocol["analysis"] == "preregistered-fd":
        return _preregistered_into(folder, results, protocol)
    if protocol["analysis"] in ("nano2", "ladder"):
        references = {suite: read_suite_results(out_dir.parent / suite) for suite in protocol["reference_suites"]}
        report = nano2_report if protocol["analysis"] == "nano2" else ladder_report
        return report.write(folder, results, references)
    points = endpoints.fit_points(results)
    points.to_csv(folder / "points.csv", index=False, float_format="%.8g")
    for arch in ("baseline", "smelt"):
        fit_to_dir(folder / "points.csv", "smelt", folder / arch, arch=arch,
                   n_bootstrap=protocol["bootstrap_draws"], seed=protocol["seed"],
                   recorded_input=out_dir / "points.csv")
    computes, sparsities = gain_grid(points)
    write_json(folder / "pair.json", {"reference": "baseline", "target": "smelt",
                                      "compute": computes, "sparsity": sparsities})
    return ([folder / "points.csv"] + write_tables(folder) + write_endpoint_tables(folder, results)
            + suite_extras(folder))


def _preregistered_into(folder: Path, results: pd.DataFrame, protocol: dict) -> list[Path]:
    """docs/results-nano.md's analysis written into `folder`: points.csv (the fitted endpoints with each
    fit's prediction and residual), ARCH/coefficients.json, the verdict table, the law-free comparison
    and, only when both fits count, the CE gains at three computes inside the data; the matched-pair
    differences with their sign test, the seed noise of the repeated pairs, and the figure."""
    fitted_rows, repeats = preregistered.split_noise_runs(results, protocol["noise_pairs"])
    fits, verdicts, all_points = {}, {}, []
    for arch in ("baseline", "smelt"):
        if not (fitted_rows["arch"].astype(str) == arch).any():
            continue
        points = preregistered.fd_points(fitted_rows, arch)
        fitted = preregistered.fit_fd(points, n_draws=protocol["bootstrap_draws"], seed=protocol["seed"])
        fits[arch], verdicts[arch] = fitted, preregistered.verdict(fitted)
        points.insert(0, "arch", arch)
        predicted = fitted["law"].predict(points["N"], points["D"])
        points["predicted"] = predicted.round(written.PREDICTION_DECIMALS)
        points["residual"] = (points["loss"] - predicted).round(written.PREDICTION_DECIMALS)
        all_points.append(points)
        (folder / arch).mkdir(exist_ok=True)
        write_json(folder / arch / "coefficients.json",
                   {"law": "fd", "arch": arch, **fitted["coefficients"], "rmse": fitted["rmse"],
                    "n_points": fitted["n_points"], "intervals": fitted["intervals"],
                    "n_converged": fitted["n_converged"], "n_draws": fitted["n_draws"],
                    "converged": fitted["converged"], "verdict": verdicts[arch]})
    points = pd.concat(all_points, ignore_index=True)
    points.to_csv(folder / "points.csv", index=False, float_format="%.8g")
    rows = preregistered.verdict_rows(fits, verdicts, protocol["expected_points"])
    paths = [folder / "points.csv", *(folder / arch / "coefficients.json" for arch in fits)]
    paths += tables.write_frame(folder, "verdict", rows)
    computes = preregistered.inside_computes(points)
    paths += tables.write_frame(folder, "law_free", preregistered.law_free(fitted_rows, computes))
    if len(fits) == 2 and rows["counts"].all():
        paths += tables.write_frame(folder, "ce_gain", preregistered.ce_gains(fits["baseline"], fits["smelt"], computes))
    wins = endpoints.pair_wins(fitted_rows)
    counts = endpoints.win_counts(wins)
    paths += tables.write_frame(folder, "wins", wins) + tables.write_frame(folder, "win_counts", counts)
    if not repeats.empty:
        paths += tables.write_frame(folder, "seed_noise",
                                    preregistered.seed_noise(fitted_rows, repeats, protocol["noise_pairs"]))
    problems = [f"{row.arch} does not count: {reason}" for row in rows.itertuples() if not row.counts
                for reason in row.failed.split("; ")]
    paths += tables.fd_loss_vs_compute_figure(folder, {a: f["law"] for a, f in fits.items()}, points, problems)
    readme = folder / "README.md"
    overall = counts[counts["sparsity_label"] == "all"].iloc[0]
    readme.write_text(_preregistered_readme(rows, overall, len(results), protocol))
    return paths + [readme]


def _preregistered_readme(rows: pd.DataFrame, overall: pd.Series, n_rows: int, protocol: dict) -> str:
    """fits/<suite>/README.md of the pre-registered analysis: whether the test passed, and why not."""
    expected = 2 * protocol["expected_points"]
    both = len(rows) == 2 and bool(rows["counts"].all())
    if both:
        outcome = "**The pre-registered test passed**: both fits count; CE gains in `ce_gain.md`."
    elif rows["n_points"].sum() < expected:
        outcome = (f"**The pre-registered test has not been run yet**: {int(rows['n_points'].sum())} of its "
                   f"{expected} endpoints are in. The fits below are of the endpoints so far and do not count.")
    else:
        outcome = "**The pre-registered test failed**: at least one fit does not count, so no CE gain is reported."
    lines = ["# Pre-registered L(F, D) analysis (generated by `make fits`; do not edit)", "",
             "The protocol is docs/results-nano.md (written before the runs); the inputs are `results.csv` "
             f"({n_rows} endpoint rows) and `fit.json`.", "", outcome, ""]
    for row in rows.itertuples():
        state = "counts" if row.counts else f"does not count: {row.failed}"
        lines.append(f"- {row.arch}: {row.n_points} endpoints, E {row.E:.3g} [{row.E_lo:.3g}, {row.E_hi:.3g}], "
                     f"a {row.a:.3g} [{row.a_lo:.3g}, {row.a_hi:.3g}], c {row.c:.3g} [{row.c_lo:.3g}, "
                     f"{row.c_hi:.3g}], RMSE {row.rmse:.4f} nats; {state}.")
    lines += ["", f"Matched pairs: SMELT lower in {int(overall['wins'])} of {int(overall['endpoints'])} "
              f"(two-sided sign test p = {overall['sign_p']:.3g}); mean SMELT - Baseline "
              f"{overall['mean_delta']:+.4f} nats (`wins.md`). Law-free comparison: `law_free.md`; figure: "
              "`loss_vs_compute.png`.", ""]
    return "\n".join(lines)


def suite_extras(out_dir) -> list[Path]:
    """Tables from a suite folder's other committed inputs, where present: `lengths.csv` (validation
    loss per document-length bucket of matched endpoints: per-bucket gains and the long/short ratio),
    `ablations.csv` (the ablation points beside the paper's, §6) and `mechanistic/smelt/*.csv` (the §9
    measures of its largest SMELT model beside the paper's ranges)."""
    out_dir, paths = Path(out_dir), []
    if (out_dir / "lengths.csv").exists():
        by_bucket = endpoints.length_gains(pd.read_csv(out_dir / "lengths.csv"))
        paths += tables.write_frame(out_dir, "length_gain", by_bucket)
        ratios = endpoints.length_ratios(by_bucket)
        paths += tables.write_frame(out_dir, "length_ratio", ratios)
    if (out_dir / "ablations.csv").exists():
        table = endpoints.ablation_table(pd.read_csv(out_dir / "ablations.csv"), paper.ABLATION_LOSS)
        paths += tables.write_frame(out_dir, "ablation", table)
    looped = out_dir / "mechanistic" / "smelt"  # `smelt analyze --out` of the suite's largest SMELT model
    if (looped / "routing_overlap.csv").exists():
        from smelt_jax.analysis.mechanistic import summary_beside_paper

        found = {path.stem: pd.read_csv(path) for path in sorted(looped.glob("*.csv"))}
        summary = summary_beside_paper(found, paper.MECHANISTIC)
        paths += tables.write_frame(out_dir, "mechanistic_summary", summary)
    return paths


def write_endpoint_tables(out_dir, results: pd.DataFrame) -> list[Path]:
    """Tables that read the endpoints beside the fitted laws: matched-pair wins (per endpoint and
    counted), the law-free empirical CE gains, each fit's residuals, and, where the table has per-source
    losses, per-source CE gains from the fixed-exponent refit (paper §8)."""
    out_dir = Path(out_dir)
    wins = endpoints.pair_wins(results)
    paths = tables.write_frame(out_dir, "wins", wins)
    counts = endpoints.win_counts(wins)
    paths += tables.write_frame(out_dir, "win_counts", counts)
    empirical = endpoints.empirical_gains(results)
    paths += tables.write_frame(out_dir, "empirical_gain", empirical)
    fits = {arch: io.load_coefficients(out_dir / arch) for arch in ("baseline", "smelt")}
    laws = {arch: data["_law"] for arch, data in fits.items()}
    for arch, law in laws.items():
        points = pd.read_csv(out_dir / arch / "points.csv")
        points["predicted"] = law.predict(points["F"], points["S"], points["D"])
        points["residual"] = points["loss"] - points["predicted"]
        paths += tables.write_frame(out_dir / arch, "residuals", points)
    if endpoints.source_names(results):
        by_source = endpoints.source_wins(results)
        paths += tables.write_frame(out_dir, "source_wins", by_source)
        pair = json.loads((out_dir / "pair.json").read_text())
        with np.errstate(all="ignore"):
            by_source = endpoints.source_gains(endpoints.source_laws(results, laws), pair["compute"],
                                               pair["sparsity"], compute_range=_common_range(fits.values()))
        paths += tables.write_frame(out_dir, "source_gain", by_source)
    return paths


def fit_folders(root="fits") -> list[str]:
    """The folders `fits-all` writes, in order: the paper's, the Chinchilla replication, then every trained
    suite folder holding a results.csv (a new suite is picked up by adding fits/<suite>/results.csv)."""
    suites = [table.parent.name for table in sorted(Path(root).glob("*/results.csv"))
              if not table.parent.name.startswith(".")]  # a staging folder left by a killed fit-suite
    return ["paper", "chinchilla", *suites]


def fits_all(root="fits", chinchilla_draws: int = 4000, only=None) -> list[Path]:
    """Every fit under `root` (`fit_folders`; only those named in `only` when given): the paper's, the
    Chinchilla replication, and each trained suite's `<suite>/results.csv` (`make demo` writes one
    under demo/)."""
    root = Path(root)
    folders = fit_folders(root)
    unknown = sorted(set(only or ()) - set(folders))
    if unknown:
        raise UsageError(f"{root}: no fit folder(s) {unknown}; found {folders}")
    paths = []
    for name in folders:
        if only and name not in only:
            continue
        if name == "paper":
            paths += write_paper_fits(root / name)
        elif name == "chinchilla":
            paths += write_chinchilla_fits(root / name, chinchilla_draws)
        else:
            paths += fit_suite_table(root / name)
    return paths

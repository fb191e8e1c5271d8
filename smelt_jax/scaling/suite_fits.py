"""A suite folder's fits (`smelt fit-suite fits/SUITE`) and `fits-all`: the folder's protocol (`fit.json`),
its results table read and checked, the analysis the protocol names (the paper's law per architecture,
nano's pre-registered test, nano2's and the ladder's comparisons) written into the folder atomically, and
every folder of fits/ regenerated in order. Split from pipeline.py (issue 52): one fit is one concept, a
folder of a suite's fits another."""

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
from smelt_jax.scaling import endpoints, figures, io, ladder_report, nano2_report, pipeline, preregistered, tables, written
from smelt_jax.scaling.pipeline import fit_to_dir, gain_grid, read_input, write_json, write_tables

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
    paths += figures.fd_loss_vs_compute_figure(folder, {a: f["law"] for a, f in fits.items()}, points, problems)
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
                                               pair["sparsity"], compute_range=pipeline.common_range(fits.values()))
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
            paths += pipeline.write_paper_fits(root / name)
        elif name == "chinchilla":
            paths += pipeline.write_chinchilla_fits(root / name, chinchilla_draws)
        else:
            paths += fit_suite_table(root / name)
    return paths

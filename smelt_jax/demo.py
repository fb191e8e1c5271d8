"""The end-to-end CPU run (`make demo`): train a suite locally, fit the scaling law per architecture,
and write CE-gain tables and figures to `demo/<suite>/` (DEMO_ROOT, not under version control).

    corpus -> local sweep (stable runs, decay branches, results store) -> demo/<suite>/results.csv
        -> smelt-law fit per arch (baseline/, smelt/) -> pair tables and figures

The committed `fits/<suite>/` is the reference made on the maintainers' machine and is not overwritten:
training runs in float32 with the CPU's own vector kernels and thread count, so a demo on another
machine trains to endpoints that differ in their last digits, and everything fitted from them differs
accordingly. The fit itself is machine-independent (smelt_jax/platform/fit_isa.py): `make fits` refits the
committed results.csv to the byte.

Every step resumes: the corpus build verifies and keeps an existing corpus, the sweep skips finished
jobs, and the fits are pure functions of `results.csv`, so a second `make demo` only refits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from smelt_jax.platform.fit_isa import fit_command, fit_environment
from smelt_jax.scaling.endpoints import export_table, fit_points
from smelt_jax.train.metrics_log import latest_per_step, read_metrics

@dataclasses.dataclass
class DemoReport:
    """What the demo found, beyond its tables: checks that failed (warnings) and plain facts (notes)."""

    warnings: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    paths: list[Path] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        lines = []
        if self.warnings:
            lines += ["## Warnings", ""] + [f"- {w}" for w in self.warnings] + [""]
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)


# An endpoint must lie this far (nats) below the training loss at its fork to pass.
ENDPOINT_TOLERANCE = 0.0

DEMO_ROOT = Path("demo")  # where `make demo` writes (ignored by git)
REFERENCE_ROOT = Path("fits")  # the committed reference fits


def _fork_loss(metrics: list[dict], fork_step: int, window: int = 3) -> float | None:
    """Mean training cross-entropy of the last `window` logged steps at or before `fork_step`."""
    logged = [m for m in latest_per_step(metrics) if m["step"] <= fork_step and "ce" in m]
    if not logged:
        return None
    return float(np.mean([m["ce"] for m in logged[-window:]]))


def endpoint_checks(results: pd.DataFrame, root: Path | None = None) -> list[str]:
    """Warnings for endpoints that did not improve with training.

    - an endpoint's validation loss should lie below the stable run's training loss at its fork step
      (the mean of the last few logged steps there);
    - of two branches of one run, the longer should end lower.
    """
    from smelt_jax.design.suites import find_run
    from smelt_jax.run_files.rundir import run_dir

    problems = []
    for run_id, rows in results.groupby("run_id", sort=True):
        rows = rows.sort_values("tokens", kind="stable")
        run = find_run(str(run_id))
        metrics_path = run_dir(run.suite, run.id, root).metrics(None)
        metrics = read_metrics(metrics_path, warn=False) if metrics_path.exists() else []
        for _, row in rows.iterrows():
            fork = run.schedule.fork_steps[int(row["branch"])]
            before = _fork_loss(metrics, fork)
            if before is not None and not row["val_loss"] < before - ENDPOINT_TOLERANCE:
                problems.append(f"{run_id} branch {int(row['branch'])}: endpoint loss {row['val_loss']:.4f} "
                                f"is not below the loss at its fork (step {fork}: {before:.4f})")
        for (_, short), (_, long) in zip(rows.iloc[:-1].iterrows(), rows.iloc[1:].iterrows()):
            if not long["val_loss"] < short["val_loss"]:
                problems.append(f"{run_id}: branch {int(long['branch'])} ({int(long['tokens']):,} tokens) ends "
                                f"at {long['val_loss']:.4f}, not below branch {int(short['branch'])} "
                                f"({int(short['tokens']):,} tokens, {short['val_loss']:.4f})")
    return problems


def fit_and_report(out_dir: Path, include_custom: bool = False) -> DemoReport:
    """Fit `out_dir/results.csv` per architecture in this process and write the tables
    (scaling.suite_fits.fit_suite_table, the folder's bootstrap protocol); every degenerate, unidentified or
    failed fit is reported in the returned report, never raised. Off-grid rows (config-file, --override)
    are left out, and counted in the report, unless `include_custom`."""
    from smelt_jax.scaling.suite_fits import fit_suite_table, off_grid_rows

    report = DemoReport()
    left_out = 0 if include_custom else off_grid_rows(out_dir)
    if left_out:
        report.warnings.append(f"{left_out} off-grid rows of results.csv (config-file or --override runs) "
                               "left out of the fit; --include-custom takes them")
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # degenerate laws overflow: reported below
        try:
            report.paths = fit_suite_table(out_dir, include_custom)
        except ValueError as err:  # a table the law cannot be fitted to (too few or invalid points)
            report.warnings.append(f"no fit: {err}")
            return report
    report.warnings += fit_warnings(out_dir)
    return report


def fit_warnings(out_dir: Path) -> list[str]:
    """The health checks (scaling.health) of a fitted suite folder's two fits and their CE gains."""
    from smelt_jax.scaling import health, io
    from smelt_jax.scaling.pipeline import gain_report

    found = []
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for arch in ("baseline", "smelt"):
            found += health.assess_fit(io.load_coefficients(out_dir / arch))
        pair = json.loads((out_dir / "pair.json").read_text())
        rows = gain_report(out_dir / "baseline", out_dir / "smelt", pair["compute"], pair["sparsity"])
        found += health.assess_gains(rows)
    return found


def fit_in_pinned_process(out_dir: Path) -> DemoReport:
    """`fit_and_report` run as `smelt fit-suite` in a fresh process whose CPU kernels are pinned
    (smelt_jax/platform/fit_isa.py): this process has loaded JAX for training, too late to pin it."""
    done = subprocess.run(fit_command("fit-suite", str(out_dir)), env=fit_environment(),
                          capture_output=True, text=True, check=False)
    report = DemoReport()
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        report.warnings.append(f"no fit: {why.removeprefix('smelt: error: ').removeprefix('no fit: ')}")
        return report
    report.paths = [Path(line) for line in done.stdout.splitlines() if line and Path(line).is_file()]
    report.warnings += fit_warnings(out_dir)
    return report


def run_demo(suite: str = "smoke", out_dir: Path | None = None, *, parallel: int = 2,
             progress: bool = True, accept_digest: bool = False) -> DemoReport:
    from smelt_jax.data.corpus import build_corpus
    from smelt_jax.run_files.results import read_results
    from smelt_jax.run_files.rundir import results_dir
    from smelt_jax.sweep.local import SweepError, run_suite_locally

    out_dir = Path(out_dir or DEMO_ROOT / suite)
    started = time.time()
    print("[demo] 1/3 corpus (fetched and built once, then verified) ...", file=sys.stderr, flush=True)
    build_corpus(progress=progress, accept_digest=accept_digest)
    print(f"[demo] 2/3 training suite {suite!r} locally ({parallel} at a time; resumes) ...",
          file=sys.stderr, flush=True)
    report = DemoReport()
    try:
        run_suite_locally(suite, parallel=parallel, progress=progress)
    except SweepError as err:  # fit what finished; say what did not
        report.warnings.append(f"training: {err}")
    results = read_results(results_dir(suite))
    report.warnings += endpoint_checks(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    reference = REFERENCE_ROOT / suite
    if (reference / "fit.json").exists() and not (out_dir / "fit.json").exists():  # the suite's protocol
        shutil.copyfile(reference / "fit.json", out_dir / "fit.json")
    export_table(results).to_csv(out_dir / "results.csv", index=False, float_format="%.8g")
    points = fit_points(results)
    print(f"[demo] 3/3 fitting {len(points)} endpoints per-architecture and writing tables ...",
          file=sys.stderr, flush=True)
    if points.empty:
        report.warnings.append(f"suite {suite!r} has no sparse endpoints to fit")
    else:
        fitted = fit_in_pinned_process(out_dir)
        report.warnings += fitted.warnings
        report.paths = fitted.paths
    report.notes.append(identifiability_note(points) if not points.empty else "no endpoints")
    (out_dir / "README.md").write_text(
        f"# {out_dir}\n\nWritten by `make demo` (smelt_jax.demo) on this machine from the `{suite}` suite's "
        f"endpoints (`results.csv`). The committed reference is {reference}/ (`make fits` refits it from "
        "its results.csv to the byte); training numbers differ across CPUs in their last digits, so the "
        "numbers here differ from it accordingly.\n\n" + report.text())
    print(f"[demo] done in {time.time() - started:.0f} s. Tables and figures in {out_dir}/:")
    for path in sorted(set(report.paths)):
        print(f"  {path}")
    ce = out_dir / "ce_gain.md"
    if ce.exists():
        print("\n" + ce.read_text())
    print(report.text())
    return report


def identifiability_note(points: pd.DataFrame) -> str:
    """Says plainly whether the fitted numbers can mean anything."""
    from smelt_jax.scaling.health import POINTS_PER_PARAMETER, SMELT_LAW_PARAMETERS

    counts = points.groupby("arch").size().to_dict()
    enough = all(n >= POINTS_PER_PARAMETER * SMELT_LAW_PARAMETERS for n in counts.values())
    counts_text = ", ".join(f"{arch} {n}" for arch, n in sorted(counts.items()))
    if enough:
        return f"Endpoints per architecture: {counts_text} for the law's 6 parameters."
    return (f"Caution: endpoints per architecture: {counts_text}, for a law with 6 parameters (the "
            "paper fits 72 each). The law is not identified by so few, so short runs: the "
            "coefficients and CE gains here check that the pipeline runs end to end; they are not "
            "a measurement of SMELT against the Baseline.")

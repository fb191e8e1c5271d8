"""`smelt fit`, `smelt gain`, `smelt tables`, `smelt fits-all`: scaling-law fits and compute-equivalent gains.

Thin wrappers over smelt_jax.scaling.pipeline and smelt_jax.scaling.suite_fits; JAX is imported only when a command runs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from smelt_jax.cli import CliError, filesystem_errors, one_line_warnings


def _finite(values: list[float], name: str) -> list[float]:
    if not all(math.isfinite(v) for v in values):
        raise CliError(f"--{name}: values must be finite, got {' '.join(map(str, values))}")
    return values


def _check_out_dir(out: str) -> None:
    path = Path(out)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise CliError(f"--out {out}: {folder} exists and is not a folder")
            break


@filesystem_errors
def _fit(args) -> int:
    from smelt_jax.scaling import pipeline

    if args.bootstrap < 0:
        raise CliError("--bootstrap must be >= 0")
    _check_out_dir(args.out)
    with one_line_warnings():
        coefficients = pipeline.fit_to_dir(args.input, args.law, args.out, arch=args.arch,
                                           method=args.method, n_bootstrap=args.bootstrap, seed=args.seed)
    names = [k for k in ("E", "A", "B", "K", "a", "b", "c", "alpha", "beta", "phi") if k in coefficients]
    print(" ".join(f"{k}={coefficients[k]:.6g}" for k in names)
          + f"  rmse={coefficients['rmse']:.5f}  n={coefficients['n_points']}  -> {args.out}/coefficients.json")
    if args.law == "smelt":  # a fit the data cannot identify says so (its figures are titled degenerate)
        from smelt_jax.scaling import health, io

        for problem in health.assess_fit(coefficients, losses=io.fit_losses(args.out)):
            print(f"warning: {problem}", file=sys.stderr)
    return 0


def _gain(args) -> int:
    from smelt_jax.scaling import pipeline, tables, written

    sparsities = _finite(args.sparsity, "sparsity")
    if any(not 0 <= s < 1 for s in sparsities):
        raise CliError("--sparsity values must lie in [0, 1)")
    computes = _finite(args.compute, "compute")
    if any(c <= 0 for c in computes):
        raise CliError(f"--compute values must be positive FLOP counts, got {' '.join(map(str, computes))}")
    rows = pipeline.gain_report(args.reference, args.target, computes, sparsities)
    if args.json:
        print(json.dumps(written.rounded(rows), indent=2, sort_keys=True))
    else:
        columns, headers = tables.gain_columns(rows)
        print(tables.to_markdown(rows, columns, headers), end="")
    return 0


@filesystem_errors
def _tables(args) -> int:
    from smelt_jax.scaling import pipeline

    for path in pipeline.write_tables(args.fit_dir):
        print(path)
    return 0


@filesystem_errors
def _fit_suite(args) -> int:
    from smelt_jax.demo import fit_and_report

    if not (Path(args.fit_dir) / "results.csv").exists():
        raise CliError(f"{args.fit_dir}: no results.csv (write it with `smelt results export --suite SUITE`)")
    report = fit_and_report(Path(args.fit_dir), include_custom=args.include_custom)
    if not report.paths:  # nothing was fitted (the folder is as it was): one line, exit 2
        raise CliError("; ".join(report.warnings) or f"{args.fit_dir}: no fit")
    for path in sorted(set(report.paths)):
        print(path)
    print(report.text(), end="")
    return 0


@filesystem_errors
def _fits_all(args) -> int:
    from smelt_jax.scaling import suite_fits

    for path in suite_fits.fits_all(args.fits_dir, chinchilla_draws=args.chinchilla_draws, only=args.only):
        print(path)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("fit", help="fit a scaling law to a table of runs",
                              description="Huber (delta 1e-3) fit on log-loss, vectorised L-BFGS from a grid "
                                          "of starts; writes OUT/coefficients.json (+ points.csv, bootstrap.npz).")
    p.add_argument("--law", required=True, choices=["smelt", "chinchilla", "looped"],
                   help="smelt: L(F,S,D) (columns arch,F,S,D,loss,cell); chinchilla: L(N,D) (N,D,loss); "
                        "looped: Schwethelm et al. (N_once,N_rec,r,D,loss)")
    p.add_argument("--input", required=True, help="input table, .csv or .parquet")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--bootstrap", type=int, default=0, metavar="N",
                   help="cell-bootstrap draws (resample whole cells; 0 = none)")
    p.add_argument("--arch", default=None, help="fit only rows whose arch column equals NAME")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (same seed = paired draws across archs)")
    p.add_argument("--method", default="huber", choices=["huber", "huber-likelihood"],
                   help="huber: summed Huber, grid + L-BFGS (paper); huber-likelihood: Epoch AI's Huber-"
                        "density NLL with free scale, BFGS from Hoffmann's values (Chinchilla law only)")
    p.set_defaults(handler=_fit)

    p = subparsers.add_parser("gain", help="compute-equivalent gain of a target law over a reference",
                              description="CE(C) = 1 - C/C_ref where the reference frontier reaches the "
                                          "target's frontier loss at C_ref; also TPP = D*/(F*/6).")
    p.add_argument("--reference", required=True, help="reference fit directory or coefficients JSON")
    p.add_argument("--target", required=True, help="target fit directory or coefficients JSON")
    p.add_argument("--compute", type=float, nargs="+", default=[1e20, 1e21, 1e22], metavar="C",
                   help="target computes in FLOPs (default 1e20 1e21 1e22)")
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.85, 0.95, 0.97], metavar="S",
                   help="sparsities S (default 0.85 0.95 0.97)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a markdown table")
    p.set_defaults(handler=_gain)

    p = subparsers.add_parser("tables", help="markdown/CSV/LaTeX tables and PNG/PDF figures of a fit",
                              description="FITDIR with coefficients.json (one fit) or pair.json (CE gains "
                                          "between two fit subdirectories). The figures span the fitted "
                                          "data's compute range (coefficients.json compute_range, else "
                                          "points.csv), solid inside it and dashed beyond, at the points' "
                                          "sparsities (pair.json's for a pair), and name a degenerate fit.")
    p.add_argument("fit_dir", metavar="FITDIR", help="a fit folder (coefficients.json) or a pair folder (pair.json)")
    p.set_defaults(handler=_tables)

    p = subparsers.add_parser("fit-suite", help="fit a suite folder's endpoints and write all its tables",
                              description="DIR/results.csv (`smelt results export`): the smelt law per "
                                          "architecture on the sparse endpoints (bootstrap protocol: "
                                          "DIR/fit.json), CE gains, wins, empirical and per-source gains, "
                                          "residuals, and tables of DIR/lengths.csv and DIR/ablations.csv.")
    p.add_argument("fit_dir", metavar="DIR", help="a suite folder holding results.csv (e.g. fits/smelt16)")
    p.add_argument("--include-custom", action="store_true",
                   help="also fit the rows of config-file and --override runs (an `--include-custom` export's "
                        "origin column); by default only the suite's own grid runs")
    p.set_defaults(handler=_fit_suite)

    p = subparsers.add_parser("fits-all", help="regenerate everything under fits/ deterministically",
                              description="fits/paper (published coefficients -> CE gains, TPP), "
                                          "fits/chinchilla (Epoch AI replication with bootstrap SEs) and "
                                          "every fits/SUITE holding a results.csv (as fit-suite). Fits "
                                          "run with the CPU's kernels capped at AVX2 (smelt_jax/platform/fit_isa.py), "
                                          "so every x86 machine writes the same bytes.")
    p.add_argument("--fits-dir", default="fits", help="output folder (default fits/)")
    p.add_argument("--chinchilla-draws", type=int, default=4000, help="bootstrap draws for the Chinchilla SEs")
    p.add_argument("--only", nargs="+", metavar="FOLDER",
                   help="regenerate only these folders of FITS_DIR (paper, chinchilla, or a suite folder)")
    p.set_defaults(handler=_fits_all)

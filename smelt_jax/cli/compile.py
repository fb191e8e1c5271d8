"""`smelt compile RUN_ID --topology v5p-128 [--layout data=..,fsdp=..,expert=..] [--remat P] [--json]
[--layer-loop scan|unrolled] [--collectives auto|async] [--hlo-out FILE] [--breakdown]`:
compile a run's train step for a TPU slice on this CPU and report memory, FLOPs,
collectives, HBM traffic, the roofline step and its MFUs (optionally writing the compiled HLO, gzipped,
and the HBM walk by category with its largest instructions);
`smelt compile-report --suite S`: choose a layout for every configuration of a suite."""

from __future__ import annotations

import dataclasses
import json

from smelt_jax.platform.xla_options import COLLECTIVE_FORMS


def cmd_compile(args) -> int:
    import experiments
    from smelt_jax.compile import aot
    from smelt_jax.compile.ideal_step import for_run
    from smelt_jax.compile.report import compile_run, format_report
    from smelt_jax.parallel.layout import parse_layout

    available, reason = aot.libtpu_status()
    if not available:
        raise aot.LibTpuUnavailable(reason)
    run = experiments.find_run(args.id)
    if args.exchange:
        run = dataclasses.replace(run, model=run.model.replace(expert_exchange=args.exchange))
    layout = parse_layout(args.layout, run.parallelism) if args.layout else run.parallelism
    if args.exchange:  # an explicit --exchange wins over the one recorded with the layout
        layout = dataclasses.replace(layout, exchange=args.exchange)
    if args.layer_loop:  # likewise --layer-loop (scan or unrolled layer stacks: compile/loop_form.py)
        layout = dataclasses.replace(layout, layer_loop=args.layer_loop)
    if args.collectives:  # and --collectives (the compiler options: platform/xla_options.py)
        layout = dataclasses.replace(layout, collectives=args.collectives)
    report = compile_run(run, args.topology, layout, remat=args.remat, hlo_path=args.hlo_out)
    ideal = for_run(run, args.topology, report.layout)  # the physical limit of this configuration and mesh
    if args.json:
        print(json.dumps({**report.as_dict(), "ideal": {**ideal.summary(), "by_category": ideal.by_category}},
                         indent=1))
    else:
        print(format_report(report, args.breakdown, ideal))
    return 0 if report.peak_fits_hbm else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="AOT-compile a run's train step for a TPU slice (memory, FLOPs, HBM, roofline MFU)",
        description="Exit 0 when the program's peak fits in the chip's HBM, 1 when it does not.")
    p.add_argument("id", help="run id (smelt experiments list)")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v5p-128 (cores) or v5e-256")
    p.add_argument("--layout", help="mesh sizes, e.g. data=-1,fsdp=16,expert=4 (-1 fills the rest)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"),
                   help="rematerialisation policy (default: the layout's)")
    p.add_argument("--exchange", choices=("auto", "padded", "ragged", "ring"),
                   help="expert-parallel token exchange (default: the layout's, else the run's; 'auto': padded "
                        "on TPU; 'ring': all-gather + reduce-scatter, model/ring_exchange.py)")
    p.add_argument("--layer-loop", choices=("auto", "scan", "unrolled"),
                   help="how the layer stacks run (default: the layout's, else 'auto': a scan on TPU; 'unrolled': "
                        "a Python loop over the layers, no saved-activation stacks; compile/loop_form.py)")
    p.add_argument("--collectives", choices=COLLECTIVE_FORMS,
                   help="the compiler options (default: the layout's, else 'auto': XLA's defaults; 'async': the "
                        "ring's collectives overlapped with compute, platform/xla_options.py)")
    p.add_argument("--hlo-out", metavar="FILE",
                   help="write the compiled per-device HLO text here, gzip-compressed (e.g. step.hlo.gz)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print the walked HBM bytes by category beside the ideal step's (compile/ideal_step.py) "
                        "and the 25 largest instructions")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.set_defaults(handler=cmd_compile)
    register_report(subparsers)


def cmd_compile_report(args) -> int:
    """Choose and record a layout for every configuration of a suite; resumable through the cache."""
    import sys
    from pathlib import Path

    import experiments
    from experiments import placement
    from smelt_jax.design import paper
    from smelt_jax.compile import layout_search as ls

    from smelt_jax.compile.checkpoint_cadence import cadence_file
    from smelt_jax.compile.results_ledger import results_file

    json_out = placement.layouts_file(args.suite) if args.json_out is None else args.json_out
    cadence_out = cadence_file(placement.layouts_file(args.suite)) if args.cadence_out is None else args.cadence_out
    results_out = results_file(placement.layouts_file(args.suite)) if args.results_out is None else args.results_out
    report = ls.compile_suite(
        experiments.load_suite(args.suite), placement.search_policy(args.suite), suite=args.suite,
        only=args.only or (), time_budget=args.time_budget, cached_only=args.cached_only,
        cache_dir=Path(args.cache_dir) if args.cache_dir else ls.CACHE_DIR,
        markdown_out=Path(args.out) if args.out else None, json_out=Path(json_out) if json_out else None,
        costs_out=Path(args.costs_out) if args.costs_out else None,
        cadence_out=Path(cadence_out) if cadence_out else None,
        results_out=Path(results_out) if results_out else None, flop_savings=paper.CE_GAIN,
        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.summary())
    return 0


def register_report(subparsers) -> None:
    p = subparsers.add_parser(
        "compile-report", help="choose a TPU layout for every suite configuration by AOT compiles",
        description="For each configuration, compile candidate layouts for its scale's slice and keep, of "
                    "those that fit HBM with headroom, the one with the lowest roofline step (each exchange at "
                    "its first remat that fits, then the winner's further remats while the step falls; then the "
                    "layer stacks unrolled instead of scanned at the winning exchange, the faster kept; then the kept "
                    "program with the 'async' collectives options, the faster kept). "
                    "Results are cached per compile under data_cache/compile_report/ and recorded in the "
                    "suite's ledger (experiments/compile_results.jsonl for smelt16), so an interrupted report "
                    "resumes where it stopped, on this machine or a clone.")
    p.add_argument("--suite", default="smelt16", help="smelt16 (default) or ablations200m")
    p.add_argument("--out", help="markdown file whose generated table section is (re)written")
    p.add_argument("--costs-out", help="markdown file whose generated pair-cost section (chip-hours of each "
                                       "Baseline/SMELT pair at the roofline steps) is (re)written")
    p.add_argument("--json-out", default=None,
                   help="layouts file (default: the suite's, experiments/layouts.json for smelt16, "
                        "experiments/layouts_SUITE.json otherwise); '' to skip")
    p.add_argument("--cadence-out", default=None,
                   help="checkpoint cadence file (steps between saves from the suite's interval in minutes and "
                        "each configuration's roofline step; default beside the layouts file, "
                        "experiments/checkpoint_cadence.json for smelt16); '' to skip")
    p.add_argument("--results-out", default=None,
                   help="ledger of every compile the search made (read to resume on another machine, then "
                        "rewritten; default beside the layouts file, experiments/compile_results.jsonl for "
                        "smelt16); '' to skip")
    p.add_argument("--only", nargs="+", metavar="SCALE_OR_KEY",
                   help="compile only these scales (100m) or keys (1.6b/s97/smelt); others use the cache")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="start no new configuration after this long; the rest use the cache")
    p.add_argument("--cached-only", action="store_true",
                   help="compile nothing: rebuild the table and layouts file from the cache")
    p.add_argument("--cache-dir", help="default data_cache/compile_report")
    p.set_defaults(handler=cmd_compile_report)

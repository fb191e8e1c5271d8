"""`smelt compile RUN_ID --topology v5p-128 [--layout data=..,fsdp=..,expert=..] [--remat P] [--json]`:
compile a run's train step for a TPU slice on this CPU and report memory, FLOPs, collectives, MFU."""

from __future__ import annotations

import json


def cmd_compile(args) -> int:
    import experiments
    from smelt_jax import aot
    from smelt_jax.parallel.compile_report import compile_run, format_report
    from smelt_jax.parallel.layout import parse_layout

    available, reason = aot.libtpu_status()
    if not available:
        raise ValueError(reason)
    run = experiments.find_run(args.id)
    layout = parse_layout(args.layout, run.parallelism) if args.layout else run.parallelism
    report = compile_run(run, args.topology, layout, remat=args.remat)
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report))
    return 0 if report.fits else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="AOT-compile a run's train step for a TPU slice (memory, FLOPs, MFU)",
        description="Exit 0 when the program fits in the chip's HBM, 1 when it does not.")
    p.add_argument("id", help="run id (smelt experiments list)")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v5p-128 (cores) or v5e-256")
    p.add_argument("--layout", help="mesh sizes, e.g. data=-1,fsdp=16,expert=4 (-1 fills the rest)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_compile)

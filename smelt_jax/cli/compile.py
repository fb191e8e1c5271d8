"""`smelt compile RUN_ID --topology v5p-128 [--layout data=..,fsdp=..,expert=..] [--remat P] [--json]`:
compile a run's train step for a TPU slice on this CPU and report memory, FLOPs, collectives, MFU."""

from __future__ import annotations

import dataclasses
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
    if args.exchange:
        run = dataclasses.replace(run, model=run.model.replace(expert_exchange=args.exchange))
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
    p.add_argument("--exchange", choices=("padded", "ragged"),
                   help="expert-parallel token exchange (default: the run's, 'padded')")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_compile)
    register_report(subparsers)


REPORT_COMMAND = "smelt compile-report --suite smelt16 --out docs/parallelism.md"


def cmd_compile_report(args) -> int:
    """Choose and record a layout for every configuration of a suite; resumable through the cache."""
    import sys
    import time
    from pathlib import Path

    import experiments
    from smelt_jax import aot
    from smelt_jax.parallel import layout_search as ls
    from smelt_jax.parallel.compile_report import compile_run, trace_program_flops

    available, reason = aot.libtpu_status()
    runs = ls.ordered(experiments.load_suite(args.suite))
    wanted = set(args.only or ())
    unknown = wanted - {r.scale for r in runs} - {ls.run_key(r) for r in runs}
    if unknown:
        raise ValueError(f"--only {sorted(unknown)}: not a scale or key of suite {args.suite}")
    cache_dir = Path(args.cache_dir) if args.cache_dir else ls.CACHE_DIR
    start = time.perf_counter()
    log = lambda line: print(line, file=sys.stderr, flush=True)
    results = {}
    for i, run in enumerate(runs, 1):
        key = ls.run_key(run)
        skip = None
        if not available:
            skip = f"libtpu unavailable: {reason}"
        elif args.cached_only:
            skip = "not yet: no cached compile; `make compile-report` compiles it"
        elif wanted and run.scale not in wanted and key not in wanted:
            skip = "not yet: outside --only in the last report run; `make compile-report` resumes"
        elif args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            skip = (f"not yet: the last report run stopped at its {args.time_budget:.0f} s budget; "
                    "`make compile-report` resumes")
        log(f"[{i}/{len(runs)}] {key} on {ls.SCALE_SLICES[run.scale]} "
            f"({time.perf_counter() - start:.0f} s elapsed)" + (f": cached results only ({skip})" if skip else ""))
        result = ls.search_layout(run, compile_run, cache_dir=cache_dir, skip_reason=skip, log=log)
        if available:  # program FLOPs and collectives for reports cached before they were recorded
            result = ls.complete_analysis(run, result, trace_program_flops, cache_dir)
        log(f"  -> {result.status}")
        results[key] = result
    in_order = [results[ls.run_key(r)] for r in experiments.load_suite(args.suite)]
    if args.out:
        out = Path(args.out)
        doc = out.read_text() if out.exists() else "# Parallelism\n"
        out.write_text(ls.replace_generated(doc, ls.render_table(in_order, REPORT_COMMAND)))
        log(f"wrote {out}")
    if args.json_out:
        Path(args.json_out).write_text(ls.layouts_document(in_order, args.suite))
        log(f"wrote {args.json_out}")
    fitted = sum(r.status == "fits" for r in in_order)
    print(f"{fitted} of {len(in_order)} configurations fit; {time.perf_counter() - start:.0f} s")
    return 0


def register_report(subparsers) -> None:
    from smelt_jax.parallel.layout import LAYOUTS_FILE

    p = subparsers.add_parser(
        "compile-report", help="choose a TPU layout for every suite configuration by AOT compiles",
        description="For each configuration, compile candidate layouts for its scale's slice and keep the "
                    "first that fits HBM. Results are cached per compile under data_cache/compile_report/, "
                    "so an interrupted report resumes where it stopped.")
    p.add_argument("--suite", default="smelt16")
    p.add_argument("--out", help="markdown file whose generated table section is (re)written")
    p.add_argument("--json-out", default=str(LAYOUTS_FILE),
                   help="layouts file (default experiments/layouts.json); '' to skip")
    p.add_argument("--only", nargs="+", metavar="SCALE_OR_KEY",
                   help="compile only these scales (100m) or keys (1.6b/s97/smelt); others use the cache")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="start no new configuration after this long; the rest use the cache")
    p.add_argument("--cached-only", action="store_true",
                   help="compile nothing: rebuild the table and layouts file from the cache")
    p.add_argument("--cache-dir", help="default data_cache/compile_report")
    p.set_defaults(handler=cmd_compile_report)

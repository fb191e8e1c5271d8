"""`smelt demo`: the end-to-end CPU run (train the smoke suite, fit, tabulate)."""

from __future__ import annotations


def cmd_demo(args) -> int:
    from smelt_jax.demo import run_demo
    run_demo(args.suite, args.out, parallel=args.parallel, n_bootstrap=args.bootstrap,
             progress=not args.no_progress)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="train a suite on this CPU end to end, fit it and write tables (make demo)",
        description="Builds the embedded corpus, trains every run and decay branch of SUITE with the "
                    "local backend (resuming where a previous call stopped), fits the SMELT law per "
                    "architecture and writes CE-gain tables and figures to fits/SUITE/.")
    p.add_argument("--suite", default="smoke", help="default: smoke (about 10 minutes on 2 cores)")
    p.add_argument("--out", help="default: fits/SUITE")
    p.add_argument("--parallel", type=int, default=2, help="training jobs at a time (default 2)")
    p.add_argument("--bootstrap", type=int, default=200, help="cell-bootstrap draws per fit")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=cmd_demo)

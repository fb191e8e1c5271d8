"""`smelt demo`: the end-to-end CPU run (train the smoke suite, fit, tabulate)."""

from __future__ import annotations

DEMO_MINUTES = "about 10 minutes on 2 cores"


def cmd_demo(args) -> int:
    from smelt_jax.demo import run_demo
    run_demo(args.suite, args.out, parallel=args.parallel, progress=not args.quiet,
             accept_digest=args.accept_digest)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help=f"train a suite on this CPU end to end, fit it and write tables (make demo; {DEMO_MINUTES})",
        description="Builds the embedded corpus (fetching its three pinned archives once), trains every "
                    "run and decay branch of SUITE with the local backend (resuming where a previous "
                    "call stopped), fits the SMELT law per architecture and writes CE-gain tables and "
                    "figures to demo/SUITE/ (cell-bootstrap draws: fits/SUITE/fit.json, default 200), not over "
                    "the committed reference fits/SUITE/ (training numbers differ across CPUs). "
                    "Degenerate fits and endpoints that did not improve are "
                    f"reported, not raised. The default suite takes {DEMO_MINUTES}.")
    p.add_argument("--suite", default="smoke", help=f"suite to train (default: smoke, {DEMO_MINUTES})")
    p.add_argument("--out", help="output folder (default: demo/SUITE)")
    p.add_argument("--parallel", type=int, default=2, help="training jobs at a time (default 2)")
    p.add_argument("--accept-digest", action="store_true",
                   help="keep a corpus whose digest differs from the committed one (see docs/data.md)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars")
    p.set_defaults(handler=cmd_demo)

"""`smelt analyze RUN_ID [--branch K] [--tokens N] [--out DIR]`: the §9 mechanistic tables as CSV files."""

from __future__ import annotations

from pathlib import Path

from smelt_jax.cli import filesystem_errors


@filesystem_errors
def cmd_analyze(args) -> int:
    from smelt_jax.analysis.evaluate import load_model, run_corpus
    from smelt_jax.analysis.run_analysis import analysis_tables, check_writable, write_tables
    root = Path(args.runs_dir) if args.runs_dir else None
    if args.out:  # an output folder that cannot be written is refused before anything runs
        check_writable(args.out)
    loaded = load_model(args.target, args.branch, root=root)
    phase = "stable" if loaded.branch is None else f"branch{loaded.branch}"
    out = args.out if args.out else loaded.run_root / phase / "analysis"  # a local folder or gs://...
    check_writable(out)
    corpus = run_corpus(loaded, args.data_dir)
    tables = analysis_tables(loaded.model, corpus, n_tokens=args.tokens,
                             seq_len=args.seq_len, batch_size=args.batch_size,
                             attention_rows=args.attention_rows, dyck=not args.no_dyck,
                             dyck_shots=args.dyck_shots, dyck_examples=args.dyck_examples)
    for path in write_tables(tables, out):
        print(path)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze", help="mechanistic analyses (routing overlap, writes, attention, sinks, Dyck head)",
        description="Runs the model with captured internals on held-out validation tokens and writes one "
                    "CSV per table (default: <run>/<phase>/analysis/).")
    p.add_argument("target", metavar="RUN_ID", help="run id, run folder or checkpoint folder")
    p.add_argument("--branch", type=int, help="decay branch K (default: the stable run)")
    p.add_argument("--tokens", type=int, default=8192, help="held-out tokens for the token-level tables")
    p.add_argument("--seq-len", type=int, default=256, help="row length (at most the model's seq_len)")
    p.add_argument("--attention-rows", type=int, default=8, help="rows whose attention maps are kept")
    p.add_argument("--batch-size", type=int, default=4, help="rows per forward pass (default 4)")
    p.add_argument("--dyck-shots", type=int, default=4, help="Dyck examples in each prompt (default 4)")
    p.add_argument("--dyck-examples", type=int, default=16, help="Dyck queries scored (default 16)")
    p.add_argument("--no-dyck", action="store_true", help="skip the Dyck-head ablations")
    p.add_argument("--data-dir", help="token store or corpus folder (default: the store the run trained on)")
    p.add_argument("--runs-dir", help="runs root (default $SMELT_RUNS_DIR or runs/)")
    p.add_argument("--out", help="output folder, local or gs://BUCKET/PATH (default <run>/<phase>/analysis)")
    p.set_defaults(handler=cmd_analyze)

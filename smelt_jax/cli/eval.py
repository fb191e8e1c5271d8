"""`smelt eval RUN_ID_OR_CHECKPOINT [--branch K] [--step N] [--tasks FILE ...] [--dyck-shots 0 1 4 32] [--json]`.

Cheap by default (the validation loss; Dyck only with --dyck-shots, texts up to the run's training
context); what it will run, and an estimate of its time and memory, go to stderr before it starts."""

from __future__ import annotations

import json
from pathlib import Path

from smelt_jax.cli import CliError, filesystem_errors


def parse_shots(values: list[str]) -> tuple[int, ...]:
    """['0', '1', '4', '32'] -> (0, 1, 4, 32); ['none'] -> () (skip Dyck)."""
    if [v.strip().lower() for v in values] == ["none"]:
        return ()
    try:
        shots = tuple(int(v) for v in values)
    except ValueError as err:
        raise CliError(f"--dyck-shots must be integers (or none), got {' '.join(values)}") from err
    from smelt_jax.analysis.dyck import MAX_SHOTS
    if any(not 0 <= k <= MAX_SHOTS for k in shots):
        raise CliError(f"--dyck-shots must lie in [0, {MAX_SHOTS}], got {' '.join(values)}")
    return shots


def _print_tables(label: str, report: dict) -> None:
    validation = report["validation"]
    print(f"# {label}")
    if validation is not None:
        print(f"validation loss {validation['overall']:.4f} nats/token over {validation['n_tokens']} tokens")
        print(validation["by_source"].to_string(index=False))
        print(validation["by_length"].to_string(index=False))
    if report["dyck"] is not None:
        print("Dyck (exact match, continuation cross-entropy):")
        print(report["dyck"].to_string(index=False))
    if report["tasks"] is not None:
        print(report["tasks"].to_string(index=False))
        print(f"DCLM Core (mean centered accuracy): {report['dclm_core']:.4f}")


@filesystem_errors
def cmd_eval(args) -> int:
    import sys

    from smelt_jax.analysis.eval_estimate import estimate_eval
    from smelt_jax.analysis.evaluate import evaluate_model, load_model, report_to_json, run_corpus
    shots = parse_shots(args.dyck_shots)
    root = Path(args.runs_dir) if args.runs_dir else None
    loaded = load_model(args.target, args.branch, root=root, step=args.step)
    print(f"evaluating {loaded.label} ({loaded.run_root})", file=sys.stderr, flush=True)
    corpus = None if args.no_validation else run_corpus(loaded, args.data_dir)
    seq_len = int(loaded.run["schedule"]["seq_len"])
    estimate = estimate_eval(loaded.cfg, corpus, seq_len=seq_len, eval_tokens=args.eval_tokens,
                             dyck_shots=shots, dyck_examples=args.dyck_examples, max_len=args.max_len,
                             batch_size=args.batch_size)
    print(estimate.line() + (" (task files not counted)" if args.tasks else ""), file=sys.stderr,
          flush=True)
    report = evaluate_model(loaded.model, corpus, seq_len=seq_len, eval_tokens=args.eval_tokens,
                            task_paths=args.tasks or (), dyck_shots=shots, dyck_examples=args.dyck_examples,
                            max_len=args.max_len, batch_size=args.batch_size)
    if args.json:
        payload = {"run_id": loaded.run.get("id"), "branch": loaded.branch, "step": loaded.step,
                   **report_to_json(report)}
        print(json.dumps(payload, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
    else:
        _print_tables(loaded.label, report)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="validation loss (per source, per document length), Dyck k-shot, task files",
        description="Evaluates a trained checkpoint: the stable run's newest checkpoint, or decay branch "
                    "K's (--branch). TARGET is a run id, a run folder, or a checkpoint folder.")
    p.add_argument("target", metavar="RUN_ID_OR_CHECKPOINT", help="run id (or unique prefix), run folder or checkpoint folder")
    p.add_argument("--branch", type=int, help="decay branch K (default: the stable run)")
    p.add_argument("--step", type=int, metavar="N",
                   help="the checkpoint step to evaluate (default: the newest; a damaged newest one is "
                        "refused unless a step is named)")
    p.add_argument("--tasks", nargs="+", metavar="FILE",
                   help="task files (.jsonl, LM or multiple choice) or registries (.yaml/.json)")
    p.add_argument("--dyck-shots", nargs="+", default=["none"], metavar="K",
                   help="run k-shot Dyck at these shot counts (the paper's: 0 1 4 32; default none)")
    p.add_argument("--dyck-examples", type=int, default=64, help="Dyck queries per shot count")
    p.add_argument("--eval-tokens", type=int, default=16_384, help="validation tokens per source")
    p.add_argument("--no-validation", action="store_true", help="skip the validation loss")
    p.add_argument("--data-dir", help="token store or corpus folder (default: the store the run trained on)")
    p.add_argument("--runs-dir", help="runs root (default $SMELT_RUNS_DIR or runs/)")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest scored text in tokens, longer ones left-truncated (default: the run's "
                        "training context, seq_len; memory grows with its square)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.set_defaults(handler=cmd_eval)

"""`smelt train RUN_ID|--config FILE [--branch K] [--override key=value ...]`."""

from __future__ import annotations

import dataclasses
import json
import sys

from smelt_jax.cli import CliError, filesystem_errors, one_line_warnings
from smelt_jax.design.config import REMAT_POLICIES
from smelt_jax.platform.errors import UsageError
from smelt_jax.platform.exit_codes import NONFINITE, PREEMPTED


def _default(name: str):
    """A TrainOptions field's default: the CLI's defaults are the dataclass's (no second copy)."""
    from smelt_jax.train.trainer import TrainOptions
    return {f.name: f.default for f in dataclasses.fields(TrainOptions)}[name]


def parse_profile(text: str | None) -> tuple[int, int] | int | None:
    """`--profile STEPS` (the STEPS steps after the first one this process runs) or `START:STOP`
    (steps START..STOP-1, absolute); UsageError (one line, exit 2) otherwise."""
    if text is None:
        return None
    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            return int(start), int(stop)
        return int(text)
    except ValueError:
        raise UsageError(f"--profile {text!r}: expected STEPS or START:STOP (integers)") from None


@filesystem_errors
def cmd_train(args) -> int:
    # Every option is checked before start-up (UsageError / ConfigError: one line, exit 2).
    from smelt_jax.train.trainer import TrainOptions
    profile = parse_profile(args.profile)
    options = TrainOptions(log_every=args.log_every, checkpoint_every=args.checkpoint_every,
                           eval_every=args.eval_every, stop_after=args.stop_after,
                           progress=not args.quiet, profile=profile, tensorboard=not args.no_tensorboard,
                           wandb=args.wandb or "")
    from smelt_jax.platform import storage
    from smelt_jax.run_files.rundir import runs_root
    from smelt_jax.platform.storage import as_path
    root = as_path(args.runs_dir) if args.runs_dir else runs_root()  # an unsupported scheme: one line
    storage.require_folder(root, "runs root")
    from smelt_jax.run_files.run_lookup import run_to_train
    run = run_to_train(args.id, args.config, args.override or [], root)
    if args.branch is not None and not 0 <= args.branch < len(run.schedule.fork_steps):
        raise UsageError(f"--branch {args.branch}: {run.id} has branches 0..{len(run.schedule.fork_steps) - 1}")
    from smelt_jax.parallel.layout import parse_layout
    parallelism = parse_layout(args.layout, run.parallelism) if args.layout else run.parallelism
    if args.remat:
        parallelism = dataclasses.replace(parallelism, remat=args.remat)

    from smelt_jax.parallel import distributed

    # Before anything touches a device: join the multi-host job (a no-op on one machine).
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from smelt_jax.train.checkpoint import CheckpointSaveError
    from smelt_jax.train.compile_cache import enable_compilation_cache
    from smelt_jax.train.lock import LockHeld, LockLost
    from smelt_jax.train.trainer import NonFiniteLoss, Preempted, train

    enable_compilation_cache()  # global JAX configuration: the entry point's, not the trainer's
    from smelt_jax.train.checkpoint import quiet_failed_save_noise
    quiet_failed_save_noise()  # from the start, as before: a failed save's noise comes before its report
    from smelt_jax.train.report import finish_lines
    runs_dir_flag = f"--runs-dir {args.runs_dir}" if args.runs_dir else ""
    try:
        with one_line_warnings():
            summary = train(run, args.branch, root=root, options=options, parallelism=parallelism,
                            data_dir=args.data_dir)
    except Preempted as err:
        print(f"smelt: {err}", file=sys.stderr)
        for line in finish_lines(run, args.branch, root, stopped=True, runs_dir_flag=runs_dir_flag):
            print(line, file=sys.stderr)
        return PREEMPTED
    except NonFiniteLoss as err:
        print(f"smelt: error: {err}", file=sys.stderr)
        return NONFINITE
    except (LockHeld, LockLost, CheckpointSaveError, NotImplementedError) as err:
        raise CliError(str(err)) from None
    for line in finish_lines(run, args.branch, root, runs_dir_flag=runs_dir_flag):
        print(line, file=sys.stderr)  # stdout keeps the one JSON line
    print(json.dumps({k: v for k, v in summary.items() if k != "endpoint"}))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a run's stable phase, or one decay branch (--branch K)",
        description=f"Resumes from the newest good checkpoint. Exit codes: 0 done, {PREEMPTED} stopped "
                    "after saving (SIGTERM/SIGINT or --stop-after; restart to resume), "
                    f"{NONFINITE} non-finite loss.")
    p.add_argument("id", nargs="?", help="run id or unique prefix: a suite's (smelt experiments list) or "
                                         "one saved under the runs root (a config file's, an override's)")
    p.add_argument("--config", metavar="FILE",
                   help="train the run this YAML or JSON file describes (RunSpec fields: model, schedule, "
                        "...; docs/training.md); its spec is kept as RUNS/SUITE/ID/run.json")
    p.add_argument("--branch", type=int, help="decay branch index (forks at schedule.fork_steps[K])")
    p.add_argument("--override", nargs="+", action="extend", metavar="KEY=VALUE",
                   help="change model or schedule fields (the run id changes with them)")
    p.add_argument("--runs-dir", help="runs root: a local path or gs://... (default $SMELT_RUNS_DIR or ./runs)")
    p.add_argument("--data-dir", help="token store (smelt data prepare; local or gs://) or corpus folder "
                                       "(default: the store the run's run.json records, else the "
                                       "embedded corpus); another store than the recorded one is refused")
    p.add_argument("--log-every", type=int, default=_default("log_every"),
                   help=f"log metrics every N steps (default {_default('log_every')})")
    p.add_argument("--checkpoint-every", type=int, default=_default("checkpoint_every"),
                   help=f"save a checkpoint every N steps (default {_default('checkpoint_every')}; "
                        "fork steps are always saved)")
    p.add_argument("--eval-every", type=int, default=_default("eval_every"),
                   help="evaluate every N steps (default 0: never during training; a decay branch is "
                        "always evaluated at its end)")
    p.add_argument("--stop-after", type=int, help=f"save and exit {PREEMPTED} after this many steps")
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines (the final summary is still printed)")
    p.add_argument("--profile", metavar="STEPS|START:STOP",
                   help="write a jax.profiler trace into <phase>/profile/: of the STEPS steps after "
                        "the first one this process runs (it compiles), or of steps START..STOP-1")
    p.add_argument("--no-tensorboard", action="store_true",
                   help="no TensorBoard event files in <phase>/tensorboard/")
    p.add_argument("--wandb", metavar="PROJECT",
                   help="also log to this Weights & Biases project (pip install 'smelt_jax[wandb]'; "
                        "WANDB_MODE=offline keeps it in local files)")
    p.add_argument("--layout", help="mesh sizes, e.g. data=-1,fsdp=8,expert=4 (default: the run's)")
    p.add_argument("--remat", choices=tuple(REMAT_POLICIES),
                   help="rematerialisation policy (default: the run's layout)")
    p.add_argument("--coordinator", help="host:port of process 0 (multi-host without auto-detection)")
    p.add_argument("--num-processes", type=int, help="processes in a multi-host job (with --coordinator)")
    p.add_argument("--process-id", type=int, help="this process's index (with --coordinator)")
    p.set_defaults(handler=cmd_train)

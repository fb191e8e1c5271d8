"""`smelt train RUN_ID [--branch K] [--override key=value ...]`."""

from __future__ import annotations

import dataclasses
import json
import sys

from smelt_jax.config import ConfigError
from smelt_jax.descriptors import RunSpec


def apply_overrides(run: RunSpec, overrides: list[str]) -> RunSpec:
    """`key=value` pairs on the model (`d_model=128` or `model.d_model=128`) or the schedule
    (`schedule.peak_lr=1e-3`; bare schedule keys work when the model has no such field). Values
    are JSON (numbers, lists, null) or plain strings. The run's id changes with its content."""
    model, schedule = run.model.to_dict(), run.schedule.to_dict()
    model_fields = {f.name for f in dataclasses.fields(run.model)}  # to_dict leaves some defaults out
    schedule_fields = {f.name for f in dataclasses.fields(run.schedule)}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        section, _, name = key.rpartition(".")
        if section not in ("", "model", "schedule"):
            raise ConfigError(f"override {key!r}: section must be model or schedule")
        if section in ("", "model") and name in model_fields:
            model[name] = value
        elif section in ("", "schedule") and name in schedule_fields:
            schedule[name] = value
        else:
            raise ConfigError(f"override {key!r}: no such model or schedule field")
    return dataclasses.replace(run, model=type(run.model).from_dict(model),
                               schedule=type(run.schedule).from_dict(schedule))


def cmd_train(args) -> int:
    from smelt_jax.parallel import distributed

    # Before anything touches a device: join the multi-host job (a no-op on one machine).
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import experiments
    from smelt_jax.parallel.layout import parse_layout
    from smelt_jax.train.trainer import (
        NONFINITE_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        NonFiniteLoss,
        Preempted,
        TrainOptions,
        train,
    )
    run = apply_overrides(experiments.find_run(args.id), args.override or [])
    parallelism = parse_layout(args.layout, run.parallelism) if args.layout else run.parallelism
    if args.remat:
        parallelism = dataclasses.replace(parallelism, remat=args.remat)
    if args.branch is not None and not 0 <= args.branch < len(run.schedule.fork_steps):
        raise ValueError(f"--branch {args.branch}: {run.id} has branches 0..{len(run.schedule.fork_steps) - 1}")
    options = TrainOptions(log_every=args.log_every, checkpoint_every=args.checkpoint_every,
                           eval_every=args.eval_every, stop_after=args.stop_after,
                           progress=not args.no_progress)
    try:
        summary = train(run, args.branch, options=options, parallelism=parallelism)
    except Preempted as err:
        print(f"smelt: {err}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except NonFiniteLoss as err:
        print(f"smelt: error: {err}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    print(json.dumps({k: v for k, v in summary.items() if k != "endpoint"}))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a run's stable phase, or one decay branch (--branch K)",
        description="Resumes from the newest good checkpoint. Exit codes: 0 done, 42 stopped after "
                    "saving (SIGTERM/SIGINT or --stop-after; restart to resume), 3 non-finite loss.")
    p.add_argument("id", help="run id (smelt experiments list)")
    p.add_argument("--branch", type=int, help="decay branch index (forks at schedule.fork_steps[K])")
    p.add_argument("--override", action="append", metavar="KEY=VALUE",
                   help="change a model or schedule field (the run id changes with it)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=0, help="0: at the end of the phase only")
    p.add_argument("--stop-after", type=int, help="save and exit 42 after this many steps")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--layout", help="mesh sizes, e.g. data=-1,fsdp=8,expert=4 (default: the run's)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"))
    p.add_argument("--coordinator", help="host:port of process 0 (multi-host without auto-detection)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.set_defaults(handler=cmd_train)

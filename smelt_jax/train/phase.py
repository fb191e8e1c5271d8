"""One phase being trained (`Phase`): the run, where it lives, its options (`TrainOptions`), the stop signal
and, built once on first use, the mesh, the plan, the jitted steps and the evaluation; the trainer's
exits (`Preempted`, `NonFiniteLoss`, `ForkCheckpointDamaged`) and its log writers. Split from trainer.py
(issue 52): what a phase is, apart from the order `train` runs it in."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import jax
import numpy as np

from smelt_jax.design import budget as budget_lib
from smelt_jax.run_files import run_data
from smelt_jax.parallel import sharding
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.errors import SmeltError, UsageError
from smelt_jax.run_files.rundir import RunDir, run_dir
from smelt_jax.train import lr as lr_lib
from smelt_jax.train.loop import StopSignal
from smelt_jax.train.step import optimizer
from smelt_jax.train.wandb_log import wandb_writer




class Preempted(Exception):
    """Stopped on request after saving a checkpoint; restart to resume."""


class NonFiniteLoss(SmeltError, RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class ForkCheckpointDamaged(SmeltError, ValueError):
    """A branch's fork checkpoint is damaged: the stable run must retrain it (one line, exit 2)."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    log_every: int = 10
    eval_every: int = 0  # 0: no periodic evaluation (a branch is still evaluated at its end)
    eval_tokens: int = 16_384  # per source
    eval_batch_size: int = 8
    checkpoint_every: int = 100
    max_to_keep: int = 2
    stop_after: int | None = None  # save and raise Preempted after this many steps (tests, chunking)
    progress: bool = True
    peak_flops: float | None = None  # None: by device kind; on CPU a measured matmul rate
    # jax.profiler trace into <phase>/profile/: (start, stop) traces the steps start..stop-1 (the
    # updates from step `start` to step `stop`); an int N traces the N steps after the first step this
    # process runs (that one compiles). None: no trace.
    profile: tuple[int, int] | int | None = None
    tensorboard: bool = True  # event files in <phase>/tensorboard/ (smelt_jax.train.tensorboard)
    wandb: str = ""  # W&B project the phase also logs to (smelt_jax.train.wandb_log); "": none
    # Train on the first N devices of a single process (a debugging or test run that is not about
    # sharding); None: every device of every process.
    devices: int | None = None

    def __post_init__(self) -> None:
        """Bad options fail here, before any start-up work (UsageError: one line, exit 2)."""
        minimum = {"log_every": 1, "checkpoint_every": 1, "eval_every": 0, "eval_tokens": 1,
                   "eval_batch_size": 1, "max_to_keep": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.stop_after is not None and (isinstance(self.stop_after, bool)
                                            or not isinstance(self.stop_after, int)
                                            or self.stop_after < 1):
            raise UsageError(f"--stop-after must be an integer >= 1, got {self.stop_after!r}")
        if self.peak_flops is not None and not (isinstance(self.peak_flops, (int, float))
                                                and 0 < self.peak_flops < float("inf")):
            raise UsageError(f"peak_flops must be a positive finite number, got {self.peak_flops!r}")
        if self.devices is not None and (isinstance(self.devices, bool) or not isinstance(self.devices, int)
                                         or self.devices < 1):
            raise UsageError(f"devices must be None or an integer >= 1, got {self.devices!r}")
        if self.profile is not None and not _valid_profile(self.profile):
            raise UsageError("--profile must be STEPS (an integer >= 1) or START:STOP (integers, "
                             f"0 <= START < STOP), got {self.profile!r}")


def _valid_profile(profile) -> bool:
    if isinstance(profile, (tuple, list)):
        return (len(profile) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                          for v in profile) and 0 <= profile[0] < profile[1])
    return isinstance(profile, int) and not isinstance(profile, bool) and profile >= 1


def evaluate(eval_step, params, corpus, seq_len: int, options: TrainOptions,
             place=lambda batch: batch, host: dict | None = None,
             check: Callable[[], None] | None = None) -> dict[str, float]:
    """Validation loss per source and overall (token-weighted), nats per token.

    `host` ({'host_index', 'host_count'}) picks this process's rows of each validation batch and
    `place` turns them into the step's input (a global array on the trainer's mesh). `check()` runs
    before each batch (the trainer's stop signal: it raises to stop)."""
    from smelt_jax.data.pipeline import validation_sets
    totals = {}
    for source, batches in validation_sets(corpus, batch_size=options.eval_batch_size,
                                           seq_len=seq_len, max_tokens=options.eval_tokens,
                                           **(host or {})).items():
        loss_sum, count = 0.0, 0.0
        for batch in batches:
            if check is not None:
                check()
            s, c = eval_step(params, place(batch))
            loss_sum, count = loss_sum + float(s), count + float(c)
        totals[source] = (loss_sum, count)
    out = {source: s / max(c, 1.0) for source, (s, c) in totals.items()}
    out["overall"] = (sum(s for s, _ in totals.values())
                      / max(sum(c for _, c in totals.values()), 1.0))
    return out


def replicated_scalar(mesh, value) -> jax.Array:
    """A float32 scalar on every device of `mesh` (valid input in multi-process programs too)."""
    host = np.asarray(value, np.float32)
    return jax.make_array_from_callback((), sharding.replicated(mesh), lambda _index: host)


class Logs:
    """metrics.jsonl and, when given, the TensorBoard event file: every record goes to both."""

    def __init__(self, *writers) -> None:
        self.writers = [w for w in writers if w is not None]

    def write(self, record: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(record)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Borrowed:
    """A writer lent to one Logs: records go through, close() leaves it open for its owner."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def write(self, record: dict[str, Any]) -> None:
        self.writer.write(record)

    def close(self) -> None:
        pass


def phase_name(branch: int | None) -> str:
    return "stable" if branch is None else f"branch {branch}"


class Phase:
    """One phase being trained: the run, where it lives, the options, the stop signal, and (built once,
    on first use) the mesh, the plan, the jitted steps, the data pipeline and the MFU denominator."""

    def __init__(self, run: RunSpec, branch: int | None, root: Path | None, corpus,
                 options: TrainOptions, parallelism: Parallelism | None, stop: StopSignal,
                 data: dict | None = None) -> None:
        self.run, self.branch, self.root, self.corpus, self.options = run, branch, root, corpus, options
        self.data = data or {}  # the data's record (smelt_jax.run_files.run_data): run.json, checkpoint metadata
        self.parallelism = parallelism if parallelism is not None else run.parallelism
        self.stop, self.lock = stop, None
        self.rd: RunDir = run_dir(run.suite, run.id, root)
        self.first, self.end = lr_lib.phase_steps(run.schedule, branch)
        self.keep = set(run.schedule.fork_steps) | {self.end} if branch is None else {self.end}
        self.is_writer = jax.process_index() == 0
        self.name = f"{run.id} {phase_name(branch)}"
        self._wandb = None  # the phase's one W&B run in this process (wandb_log), opened on first use

    def wandb_log(self) -> Borrowed | None:
        """The W&B run of this trainer process (None without --wandb): one run for the repair, the
        training loop and the final evaluation, so W&B offline writes one offline-run-* folder per
        process. The callers' logs borrow it (closing them leaves it open); _run_phase closes it."""
        if not self.options.wandb:
            return None
        if self._wandb is None:
            self._wandb = wandb_writer(self.options.wandb, self.run, self.branch, self.rd.phase(self.branch))
        return Borrowed(self._wandb)

    def close_wandb(self) -> None:
        writer, self._wandb = self._wandb, None
        if writer is not None:
            writer.close()

    def check_data(self, step: int, metadata: dict) -> None:
        """DataChanged when the checkpoint restored at `step` was saved training on other data."""
        run_data.check_checkpoint_data(self.run.id, step, metadata, self.data)

    def check_stop(self, where: str) -> None:
        """Preempted when a signal came (nothing to save: no step advanced since the last save)."""
        if self.stop.raised:
            raise Preempted(f"{self.name}: stopped by signal {self.stop.signal} {where}; restart to "
                            "resume")

    @functools.cached_property
    def mesh(self):
        n = self.options.devices
        if n is None:
            return sharding.make_mesh(self.parallelism)
        if jax.process_count() > 1 or n > jax.local_device_count():
            raise UsageError(f"devices={n} needs one process with at least {n} devices "
                             f"({jax.process_count()} processes, {jax.local_device_count()} local devices)")
        return sharding.make_mesh(self.parallelism, jax.local_devices()[:n])

    @functools.cached_property
    def tx(self):
        return optimizer(self.run.schedule)

    @functools.cached_property
    def plan(self):
        from smelt_jax.train import state as ts
        return ts.plan_training(self.parallelism.with_exchange(self.run.model), self.tx, self.mesh,
                                remat=self.parallelism.remat, layer_loop=self.parallelism.layer_loop)

    @functools.cached_property
    def steps(self) -> dict[str, Any]:
        """The jitted train and eval steps, the eval rows of this process, the pipeline, FLOPs."""
        from smelt_jax.data.pipeline import TrainPipeline
        from smelt_jax.train import state as ts
        from smelt_jax.train.mfu import peak_flops_per_device
        schedule, options, plan = self.run.schedule, self.options, self.plan
        peak, peak_source = options.peak_flops, "given"
        if peak is None:
            peak, peak_source = peak_flops_per_device()
        return {"train": ts.jit_train_step(plan, self.tx, schedule.batch_size, schedule.seq_len,
                                           collectives=self.parallelism.collectives),
                "eval": ts.jit_eval_step(plan, options.eval_batch_size, schedule.seq_len),
                # Which rows of a global batch this process feeds depends on the mesh.
                "eval_host": ts.host_split(plan, options.eval_batch_size, schedule.seq_len),
                "pipeline": TrainPipeline.from_schedule(
                    self.corpus, schedule, **ts.host_split(plan, schedule.batch_size, schedule.seq_len)),
                "flops_per_token": budget_lib.train_flops_per_token(self.run.model),
                "peak": peak * jax.device_count(), "peak_source": peak_source}

    def evaluate(self, params) -> dict[str, float]:
        from smelt_jax.train import state as ts
        batch_size = self.options.eval_batch_size
        return evaluate(self.steps["eval"], params, self.corpus, self.run.schedule.seq_len,
                        self.options, lambda batch: ts.global_batch(self.plan, batch, batch_size),
                        self.steps["eval_host"],
                        check=lambda: self.check_stop("during the final evaluation"))



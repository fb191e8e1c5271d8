"""The training of one phase of one run: the stable run, or one decay branch.

`train(run, branch)` is restore -> repair -> loop -> finish:
- restore: the phase's newest good checkpoint as one `TrainState` (a branch starts from the stable
  run's checkpoint at its fork step); damaged steps are moved aside first (`checkpoint_format`);
- repair (stable phase only): a fork checkpoint that was damaged and moved aside while its branch has
  no endpoint yet is trained again, from the newest good step below it, saving only that step;
- loop: `StepLoop` to the phase's last step, with hooks (NaN guard, profiler, metrics record,
  periodic evaluation, checkpoints and the stop rule: `smelt_jax.train.hooks`);
- finish: a branch is evaluated and writes its endpoint row.
Everything it needs to resume is the TrainState: the batch is a pure function of the data position and
so is the learning rate of the step, so an interrupted and resumed run ends with bit-identical
parameters.

Exits (as exceptions the CLI maps to exit codes, `smelt_jax.platform.exit_codes`): `Preempted` (SIGTERM/SIGINT at
any point of `train`, or `stop_after`: saved when a step advanced since the last save, the lock
released, exit 42, restart me), `NonFiniteLoss` (exit 3: nothing saved past the last good checkpoint).
The trainer sets no global JAX configuration (the compilation cache is the caller's:
`smelt_jax.train.compile_cache`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import jax
import numpy as np

from smelt_jax.design import budget as budget_lib
from smelt_jax.run_files import run_data
from smelt_jax.parallel import sharding
from smelt_jax.platform import storage
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.errors import SmeltError, UsageError
from smelt_jax.run_files.rundir import RunDir, run_dir
from smelt_jax.train import hooks
from smelt_jax.train import lr as lr_lib
from smelt_jax.train.checkpoint import Checkpointer, CheckpointError
from smelt_jax.train.endpoint import write_endpoint, write_spec
from smelt_jax.train.loop import StepLoop, StopSignal
from smelt_jax.train.state import TrainState
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


def _load_corpus():
    from smelt_jax.data.corpus import open_dataset
    return open_dataset(None, progress=sys.stderr.isatty())


def _open_store(path: str | None):
    """The token store at `path`; None: the embedded default corpus (`_load_corpus`)."""
    if path is None:
        return _load_corpus()
    from smelt_jax.data.corpus import open_dataset
    return open_dataset(path)


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


def _replicated_scalar(mesh, value) -> jax.Array:
    """A float32 scalar on every device of `mesh` (valid input in multi-process programs too)."""
    host = np.asarray(value, np.float32)
    return jax.make_array_from_callback((), sharding.replicated(mesh), lambda _index: host)


class _Logs:
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


class _Borrowed:
    """A writer lent to one _Logs: records go through, close() leaves it open for its owner."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def write(self, record: dict[str, Any]) -> None:
        self.writer.write(record)

    def close(self) -> None:
        pass


def _phase_name(branch: int | None) -> str:
    return "stable" if branch is None else f"branch {branch}"


class _Phase:
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
        self.name = f"{run.id} {_phase_name(branch)}"
        self._wandb = None  # the phase's one W&B run in this process (wandb_log), opened on first use

    def wandb_log(self) -> _Borrowed | None:
        """The W&B run of this trainer process (None without --wandb): one run for the repair, the
        training loop and the final evaluation, so W&B offline writes one offline-run-* folder per
        process. The callers' logs borrow it (closing them leaves it open); _run_phase closes it."""
        if not self.options.wandb:
            return None
        if self._wandb is None:
            self._wandb = wandb_writer(self.options.wandb, self.run, self.branch, self.rd.phase(self.branch))
        return _Borrowed(self._wandb)

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
                                remat=self.parallelism.remat)

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
        return {"train": ts.jit_train_step(plan, self.tx, schedule.batch_size, schedule.seq_len),
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


def device_bytes() -> int | None:
    """What one device holds: its memory limit (GPU, TPU), else the host's memory shared by the local CPU
    devices; None when unknown."""
    import os
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // jax.local_device_count()
    except (ValueError, OSError, AttributeError):
        return None


def train(run: RunSpec, branch: int | None = None, *, root: Path | None = None, corpus=None,
          options: TrainOptions = TrainOptions(), parallelism: Parallelism | None = None,
          data_dir: str | None = None) -> dict[str, Any]:
    """Train one phase to its end (or until stopped). Returns a summary dict.

    The mesh comes from `parallelism` (default: the run's own `run.parallelism`) over every device of
    every process; one device is a 1x1x1x1 mesh. Parameters and optimizer state are created (or
    restored) directly with their shardings; each process feeds its own rows of the global batch.

    The data: `corpus`, else the token store at `data_dir`, else the store the run's run.json records,
    else the embedded corpus; a store other than the recorded one raises `run_data.DataChanged`, and
    data of a tokenizer the run does not expect (`RunSpec.check_data`) DataMismatch, both before
    anything is written. run.json and every checkpoint record the data (`smelt_jax.run_files.run_data`). Process 0 then takes the
    phase's lock (`smelt_jax.train.lock`): a second trainer of the same phase raises `LockHeld` naming
    the holder, before any other work. SIGTERM / SIGINT from here to the end raise `Preempted`.
    """
    from smelt_jax.train import lock as lock_lib
    from smelt_jax.train.preflight import check_before_writing  # a bad branch or mesh: nothing written
    from smelt_jax.run_files.memory_estimate import check_fits
    layout = parallelism if parallelism is not None else run.parallelism
    check_before_writing(run, branch, layout, options.devices or jax.device_count())
    with StopSignal() as stop:
        corpus, data = run_data.data_for_run(run.id, run_dir(run.suite, run.id, root).spec_file, corpus=corpus,
                                             data_dir=data_dir, open_store=_open_store)
        run.check_data(corpus.tokenizer, f"the data at {getattr(corpus, 'root', '(in memory)')}")
        # then the memory (DoesNotFit: one line): wrong data is the more specific refusal
        check_fits(run, options.devices or jax.device_count(), device_bytes(), layout.remat)
        phase = _Phase(run, branch, root, corpus, options, parallelism, stop, data)
        if not phase.is_writer:
            return _run_phase(phase)
        lock = lock_lib.phase_lock(phase.rd.phase(branch), description=phase.name)
        with lock_lib.holding(lock):
            phase.lock = lock
            if getattr(lock, "took_over", None):
                info = lock.took_over
                print(f"smelt: took over the stale lock of pid {info.get('pid')} on {info.get('host')} "
                      f"for {phase.name}", file=sys.stderr)
            return _run_phase(phase)


def _run_phase(phase: _Phase) -> dict[str, Any]:
    """restore -> repair (each missing fork checkpoint, oldest first) -> loop -> finish; then the
    phase's W&B run (phase.wandb_log), if one was opened, is closed."""
    try:
        phase.check_stop("before restoring")
        if phase.is_writer:
            write_spec(phase.run, phase.rd, phase.data)
        while True:
            ckpt, hole, good = _open_checkpoints(phase)
            if hole is None:
                break
            _repair(phase, ckpt, hole, good)
        summary = _train_to_end(phase, ckpt)
    except BaseException:
        _close_quietly(phase.close_wandb)
        raise
    phase.close_wandb()
    phase.check_stop(f"after the phase finished (step {summary['step']}; nothing left to do)")
    return summary


def _stable_holes(rd: RunDir, schedule, good: list[int]) -> list[int]:
    """Fork steps below the newest good stable step whose checkpoint is missing (damaged and moved
    aside) while their branch has no endpoint yet: the stable run must train them again."""
    if not good:
        return []
    return [f for k, f in enumerate(schedule.fork_steps)
            if f < good[-1] and f not in good and not storage.exists(rd.endpoint(k))]


def _open_checkpoints(phase: _Phase) -> tuple[Checkpointer, int | None, list[int]]:
    """(checkpointer, the fork step to repair or None, the good steps). Temporary folders of saves
    that never committed are removed and damaged steps (the cheap check) moved aside first."""
    ckpt_dir = phase.rd.checkpoints(phase.branch)
    probe = Checkpointer(ckpt_dir, max_to_keep=phase.options.max_to_keep, keep_forever=phase.keep,
                         clean_temporary=True)
    try:
        for name in probe.removed_temporary:
            print(f"smelt: removed {ckpt_dir / name}, the temporary folder of a save that never "
                  "committed", file=sys.stderr)
        if phase.is_writer:
            probe.quarantine_damaged(probe.all_steps())
        good = probe.all_steps()
    except BaseException:
        probe.close()
        raise
    holes = _stable_holes(phase.rd, phase.run.schedule, good) if phase.branch is None else []
    if not holes:
        return probe, None, good
    # Repair: train from the newest good step below the hole to the hole, saving only there, with no
    # rotation (saving an older step must not delete a newer one); then train on as usual.
    probe.close()
    print(f"smelt: {phase.run.id} stable: the fork checkpoint at step {min(holes)} is missing or was "
          "damaged; retraining it", file=sys.stderr)
    return (Checkpointer(ckpt_dir, max_to_keep=10 ** 9, keep_forever=phase.keep), min(holes), good)


def _repair(phase: _Phase, ckpt: Checkpointer, hole: int, good: list[int]) -> None:
    """Train the stable run again from the newest good step below `hole` to `hole`, saving only it."""
    try:
        state = TrainState.target(phase.plan, phase.first)
        below = [s for s in good if s < hole]
        if below:
            state = ckpt.restore_state(state, step=below[-1], check=phase.check_data)
        phase.check_stop("after restoring")
        if state.is_abstract:
            state = TrainState.initial(phase.plan, phase.tx, phase.run.schedule.seed, state.step)
        _loop(phase, ckpt, state, stop_at=hole, only=hole)
    finally:
        ckpt.close()


def _restore(phase: _Phase, ckpt: Checkpointer) -> TrainState:
    """The phase's newest good checkpoint (damaged ones moved aside), else a branch's fork step, else
    the abstract state at the phase's first step."""
    state, restored = TrainState.target(phase.plan, phase.first), False
    try:
        if ckpt.latest_step() is not None:
            try:
                state = ckpt.restore_state(state, quarantine=phase.is_writer, check=phase.check_data)
                restored = True
            except CheckpointError:
                if ckpt.latest_step() is not None:
                    raise
                # every step was damaged and moved aside: the phase starts again
        if phase.branch is not None and not restored:
            state = _restore_fork(phase, state)
    except BaseException:
        ckpt.close()
        raise
    return state


def _restore_fork(phase: _Phase, target: TrainState) -> TrainState:
    """The stable checkpoint a branch forks from, opened read-only; one-line errors when it is missing
    or damaged (the stable trainer, not this one, moves a damaged stable step aside)."""
    from smelt_jax.run_files.checkpoint_format import checkpoint_damage

    run, branch, first, folder = phase.run, phase.branch, phase.first, phase.rd.checkpoints(None)
    with Checkpointer(folder, read_only=True) as stable:
        if first not in stable.all_steps():
            raise UsageError(
                f"branch {branch} of {run.id} forks at step {first}, but the stable run has no "
                f"committed checkpoint there (have {stable.all_steps()}); train the stable run first")
        try:
            damage = checkpoint_damage(folder, first)
            if damage:
                raise CheckpointError(damage)
            return stable.restore_state(target, step=first, check=phase.check_data)
        except CheckpointError as err:
            raise ForkCheckpointDamaged(
                f"branch {branch} of {run.id} forks at step {first}, but the stable checkpoint there "
                f"is damaged ({' '.join(str(err).split())[:200]}); run `smelt train {run.id}` to move "
                "it aside and retrain it") from None


def _train_to_end(phase: _Phase, ckpt: Checkpointer) -> dict[str, Any]:
    """Restore, train to the phase's end, and finish (a branch's endpoint)."""
    run, branch, end = phase.run, phase.branch, phase.end
    state = _restore(phase, ckpt)
    if state.step >= end and (branch is None or storage.exists(phase.rd.endpoint(branch))):
        ckpt.close()
        return {"run_id": run.id, "branch": branch, "step": state.step, "status": "done"}
    try:
        phase.check_stop("after restoring")
    except Preempted:
        ckpt.close()
        raise
    if state.is_abstract:
        state = TrainState.initial(phase.plan, phase.tx, run.schedule.seed, state.step)
    state = _loop(phase, ckpt, state, stop_at=end)
    summary = {"run_id": run.id, "branch": branch, "step": end, "status": "done"}
    try:
        if branch is not None:  # endpoints are the decay branches; the stable phase is not evaluated
            summary.update(_finish_branch(phase, state))
    finally:
        ckpt.close()
    return summary


def _finish_branch(phase: _Phase, state: TrainState) -> dict[str, Any]:
    """Evaluate the branch's final state, log it and write its endpoint (results row, endpoint.json)."""
    with jax.set_mesh(phase.mesh):
        losses = phase.evaluate(state.params)
    out: dict[str, Any] = {"val_loss": losses["overall"], "losses": losses}
    if phase.is_writer:
        from smelt_jax.train.metrics_log import MetricsWriter
        with _Logs(MetricsWriter(phase.rd.metrics(phase.branch)),
                   _event_writer(phase.rd, phase.branch, phase.options, run=phase.run),
                   phase.wandb_log()) as log:
            log.write({"step": phase.end, "eval": losses})
        out["endpoint"] = write_endpoint(phase.run, phase.branch, losses, root=phase.root, rd=phase.rd)
    return out


def _loop(phase: _Phase, ckpt: Checkpointer, state: TrainState, *, stop_at: int,
          only: int | None = None) -> TrainState:
    """Train from `state` to `stop_at` with the trainer's hooks; returns the final state. `only`: a
    repair, which saves that step alone."""
    from smelt_jax.train.metrics_log import MetricsWriter, NullWriter

    options, progress = phase.options, None
    if options.progress and phase.is_writer:
        label = "stable" if phase.branch is None else f"branch{phase.branch}"
        progress = hooks.progress_bar(phase.end - phase.first, state.step - phase.first,
                                      f"{phase.run.id} {label}")
    # Only process 0 writes metrics; the others log into the void.
    log_context = (_Logs(MetricsWriter(phase.rd.metrics(phase.branch)),
                         _event_writer(phase.rd, phase.branch, options, state.step, run=phase.run),
                         phase.wandb_log())
                   if phase.is_writer else NullWriter())
    profiler = _profiler(phase, state.step)
    try:
        with log_context as log, jax.set_mesh(phase.mesh):
            loop = _build_loop(phase, ckpt, state.step, stop_at, only, log, progress, profiler)
            state = loop.run(state, stop_at)
        ckpt.wait()
        if profiler is not None:
            profiler.finish()
    except BaseException:
        _close_quietly(profiler.finish if profiler is not None else None, ckpt.close)
        if progress is not None:
            progress.close()
        raise
    if progress is not None:
        progress.close()
    return state


def _close_quietly(*closers) -> None:
    """Run each closer, dropping its error: the error in flight says more."""
    for close in closers:
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001
                pass


def _profiler(phase: _Phase, step: int) -> hooks.Profiler | None:
    profile = phase.options.profile
    if profile is None:
        return None
    begin, finish = profile if not isinstance(profile, int) else (step + 1, step + 1 + profile)
    return hooks.Profiler(phase.rd.profile(phase.branch), begin, finish)


def _build_loop(phase: _Phase, ckpt: Checkpointer, start: int, stop_at: int, only: int | None,
                log, progress, profiler) -> StepLoop:
    """The step function over the phase's pipeline, and the hooks in their order: NaN guard,
    profiler, throughput window, metrics record, periodic evaluation, checkpoints and the stop rule."""
    from smelt_jax.train import state as ts
    run, options, steps, mesh = phase.run, phase.options, phase.steps, phase.mesh
    schedule = run.schedule
    iterator = steps["pipeline"].iterator(start, stop_at - start)

    def step_fn(state: TrainState) -> tuple[TrainState, dict]:
        batch = ts.global_batch(phase.plan, next(iterator), schedule.batch_size)
        lr = _replicated_scalar(mesh, lr_lib.learning_rate(schedule, state.step, phase.branch))
        params, opt_state, metrics = steps["train"](state.params, state.opt_state, batch, lr)
        return state.advanced(params, opt_state), metrics

    def nonfinite(last_good: int, at_step: int, metrics) -> NonFiniteLoss:
        ckpt.wait()
        return NonFiniteLoss(f"{phase.name}: non-finite loss between steps {last_good} and {at_step} "
                             f"(last metrics: {metrics}); the checkpoint at step {ckpt.latest_step()} "
                             "is kept")

    loop = StepLoop(step_fn, before=[b for b in (profiler.before if profiler else None,
                                                 _lock_watch(phase), _save_watch(ckpt)) if b])
    guard = hooks.NanGuard(_replicated_scalar(mesh, 0.0) > 0, start, nonfinite)
    record = hooks.MetricsRecord(log, guard, tokens_per_step=schedule.tokens_per_step,
                                 flops_per_token=steps["flops_per_token"], peak=steps["peak"],
                                 peak_source=steps["peak_source"], progress=progress)
    loop.add_hook(guard)
    if profiler is not None:
        loop.add_hook(profiler)
    loop.add_hook(record.count)
    loop.add_hook(record, every=options.log_every, at={phase.end})
    if options.eval_every:
        loop.add_hook(hooks.PeriodicEval(log, phase.evaluate, phase.end), every=options.eval_every)
    loop.add_hook(hooks.Checkpoints(
        ckpt, guard, record, keep=phase.keep, every=options.checkpoint_every, end=phase.end,
        should_stop=_stop_rule(phase, start), stop=_preempted(phase, stop_at, only), only=only,
        metadata={"run_id": run.id, "branch": phase.branch,
                  "data_digest": phase.data.get("store_digest"),
                  "tokenizer_sha256": phase.data.get("tokenizer_sha256")}))
    return loop


def _stop_rule(phase: _Phase, start: int) -> Callable[[int], bool]:
    stop_after = phase.options.stop_after
    return lambda done: phase.stop.raised or (stop_after is not None and done - start >= stop_after)


def _preempted(phase: _Phase, stop_at: int, only: int | None) -> Callable[[int], Preempted]:
    if only is not None:
        return lambda done: Preempted(f"{phase.name}: stopped at step {done} after saving, while "
                                      f"retraining the fork checkpoint at step {stop_at}; restart to "
                                      "resume")
    return lambda done: Preempted(f"{phase.name}: stopped at step {done} after saving; restart to "
                                  "resume")


def _lock_watch(phase: _Phase) -> Callable[[int], None] | None:
    """Before each step: stop without saving when another trainer took this phase's lock over."""
    if phase.lock is None:
        return None

    def watch(step: int) -> None:
        if phase.lock.lost:
            from smelt_jax.train.lock import LockLost
            raise LockLost(f"{phase.name}: another trainer took this phase's lock over (this process "
                           f"looked dead); stopped at step {step} without saving")
    return watch


def _save_watch(ckpt: Checkpointer) -> Callable[[int], None]:
    """Before each step: stop at once when a background save has failed."""
    return lambda _step: ckpt.raise_if_save_failed()


def _event_writer(rd: RunDir, branch: int | None, options: TrainOptions,
                  resume_step: int | None = None, run: RunSpec | None = None):
    """The phase's TensorBoard event writer (None when turned off). `resume_step`: the step training
    restarts from (its next logged step is resume_step + 1, from which older files are hidden)."""
    if not options.tensorboard:
        return None
    from smelt_jax.train.tensorboard import EventWriter, run_hparams
    return EventWriter(rd.tensorboard(branch),
                       start_step=None if resume_step is None else resume_step + 1,
                       hparams=None if run is None else run_hparams(run, branch))

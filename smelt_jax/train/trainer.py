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

import sys
from pathlib import Path
from typing import Any

import jax

from smelt_jax.run_files import run_data
from smelt_jax.platform import storage
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.train.checkpoint import Checkpointer
from smelt_jax.train.endpoint import write_endpoint, write_spec
from smelt_jax.train.loop import StopSignal
from smelt_jax.train.state import TrainState
from smelt_jax.train.phase import (  # noqa: F401 - the trainer's exits and options, importable from here
    ForkCheckpointDamaged,
    Logs,
    NonFiniteLoss,
    Phase,
    Preempted,
    TrainOptions,
    evaluate,
)
from smelt_jax.train.phase_loop import event_writer, close_quietly, loop
from smelt_jax.train.phase_restore import open_checkpoints, repair, restore




def _load_corpus():
    from smelt_jax.data.corpus import open_dataset
    return open_dataset(None, progress=sys.stderr.isatty())


def _open_store(path: str | None):
    """The token store at `path`; None: the embedded default corpus (`_load_corpus`)."""
    if path is None:
        return _load_corpus()
    from smelt_jax.data.corpus import open_dataset
    return open_dataset(path)


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
        phase = Phase(run, branch, root, corpus, options, parallelism, stop, data)
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


def _run_phase(phase: Phase) -> dict[str, Any]:
    """restore -> repair (each missing fork checkpoint, oldest first) -> loop -> finish; then the
    phase's W&B run (phase.wandb_log), if one was opened, is closed."""
    try:
        phase.check_stop("before restoring")
        if phase.is_writer:
            write_spec(phase.run, phase.rd, phase.data)
        while True:
            ckpt, hole, good = open_checkpoints(phase)
            if hole is None:
                break
            repair(phase, ckpt, hole, good)
        summary = _train_to_end(phase, ckpt)
    except BaseException:
        close_quietly(phase.close_wandb)
        raise
    phase.close_wandb()
    phase.check_stop(f"after the phase finished (step {summary['step']}; nothing left to do)")
    return summary


def _train_to_end(phase: Phase, ckpt: Checkpointer) -> dict[str, Any]:
    """Restore, train to the phase's end, and finish (a branch's endpoint)."""
    run, branch, end = phase.run, phase.branch, phase.end
    state = restore(phase, ckpt)
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
    state = loop(phase, ckpt, state, stop_at=end)
    summary = {"run_id": run.id, "branch": branch, "step": end, "status": "done"}
    try:
        if branch is not None:  # endpoints are the decay branches; the stable phase is not evaluated
            summary.update(_finish_branch(phase, state))
    finally:
        ckpt.close()
    return summary


def _finish_branch(phase: Phase, state: TrainState) -> dict[str, Any]:
    """Evaluate the branch's final state, log it and write its endpoint (results row, endpoint.json)."""
    with jax.set_mesh(phase.mesh):
        losses = phase.evaluate(state.params)
    out: dict[str, Any] = {"val_loss": losses["overall"], "losses": losses}
    if phase.is_writer:
        from smelt_jax.train.metrics_log import MetricsWriter
        with Logs(MetricsWriter(phase.rd.metrics(phase.branch)),
                   event_writer(phase.rd, phase.branch, phase.options, run=phase.run),
                   phase.wandb_log()) as log:
            log.write({"step": phase.end, "eval": losses})
        out["endpoint"] = write_endpoint(phase.run, phase.branch, losses, root=phase.root, rd=phase.rd)
    return out



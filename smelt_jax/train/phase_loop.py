"""The step loop of a phase (`smelt_jax.train.trainer`): `StepLoop` to the phase's last step with its hooks
(NaN guard, profiler, metrics record, periodic evaluation, checkpoints and the stop rule), the lock and
save watches, and the phase's event writers. Split from trainer.py (issue 52)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files.rundir import RunDir
from smelt_jax.train import hooks
from smelt_jax.train import lr as lr_lib
from smelt_jax.train.checkpoint import Checkpointer
from smelt_jax.train.loop import StepLoop
from smelt_jax.train.state import TrainState
from smelt_jax.train.phase import Logs, NonFiniteLoss, Phase, Preempted, TrainOptions, replicated_scalar




def loop(phase: Phase, ckpt: Checkpointer, state: TrainState, *, stop_at: int,
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
    log_context = (Logs(MetricsWriter(phase.rd.metrics(phase.branch)),
                         event_writer(phase.rd, phase.branch, options, state.step, run=phase.run),
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
        close_quietly(profiler.finish if profiler is not None else None, ckpt.close)
        if progress is not None:
            progress.close()
        raise
    if progress is not None:
        progress.close()
    return state


def close_quietly(*closers) -> None:
    """Run each closer, dropping its error: the error in flight says more."""
    for close in closers:
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001
                pass


def _profiler(phase: Phase, step: int) -> hooks.Profiler | None:
    profile = phase.options.profile
    if profile is None:
        return None
    begin, finish = profile if not isinstance(profile, int) else (step + 1, step + 1 + profile)
    return hooks.Profiler(phase.rd.profile(phase.branch), begin, finish)


def _build_loop(phase: Phase, ckpt: Checkpointer, start: int, stop_at: int, only: int | None,
                log, progress, profiler) -> StepLoop:
    """The step function over the phase's pipeline, and the hooks in their order: NaN guard,
    profiler, throughput window, metrics record, periodic evaluation, checkpoints and the stop rule."""
    from smelt_jax.train import state as ts
    run, options, steps, mesh = phase.run, phase.options, phase.steps, phase.mesh
    schedule = run.schedule
    iterator = steps["pipeline"].iterator(start, stop_at - start)

    def step_fn(state: TrainState) -> tuple[TrainState, dict]:
        batch = ts.global_batch(phase.plan, next(iterator), schedule.batch_size)
        lr = replicated_scalar(mesh, lr_lib.learning_rate(schedule, state.step, phase.branch))
        params, opt_state, metrics = steps["train"](state.params, state.opt_state, batch, lr)
        return state.advanced(params, opt_state), metrics

    def nonfinite(last_good: int, at_step: int, metrics) -> NonFiniteLoss:
        ckpt.wait()
        return NonFiniteLoss(f"{phase.name}: non-finite loss between steps {last_good} and {at_step} "
                             f"(last metrics: {metrics}); the checkpoint at step {ckpt.latest_step()} "
                             "is kept")

    loop = StepLoop(step_fn, before=[b for b in (profiler.before if profiler else None,
                                                 _lock_watch(phase), _save_watch(ckpt)) if b])
    guard = hooks.NanGuard(replicated_scalar(mesh, 0.0) > 0, start, nonfinite)
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


def _stop_rule(phase: Phase, start: int) -> Callable[[int], bool]:
    stop_after = phase.options.stop_after
    return lambda done: phase.stop.raised or (stop_after is not None and done - start >= stop_after)


def _preempted(phase: Phase, stop_at: int, only: int | None) -> Callable[[int], Preempted]:
    if only is not None:
        return lambda done: Preempted(f"{phase.name}: stopped at step {done} after saving, while "
                                      f"retraining the fork checkpoint at step {stop_at}; restart to "
                                      "resume")
    return lambda done: Preempted(f"{phase.name}: stopped at step {done} after saving; restart to "
                                  "resume")


def _lock_watch(phase: Phase) -> Callable[[int], None] | None:
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


def event_writer(rd: RunDir, branch: int | None, options: TrainOptions,
                  resume_step: int | None = None, run: RunSpec | None = None):
    """The phase's TensorBoard event writer (None when turned off). `resume_step`: the step training
    restarts from (its next logged step is resume_step + 1, from which older files are hidden)."""
    if not options.tensorboard:
        return None
    from smelt_jax.train.tensorboard import EventWriter, run_hparams
    return EventWriter(rd.tensorboard(branch),
                       start_step=None if resume_step is None else resume_step + 1,
                       hparams=None if run is None else run_hparams(run, branch))

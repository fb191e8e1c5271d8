"""The trainer's hooks on the step loop (`smelt_jax.train.loop.StepLoop.add_hook`): the NaN guard, the
metrics record (metrics.jsonl and TensorBoard), the progress bar, periodic evaluation, the profiler,
and checkpoints with the stop rule. Each is a small object whose `__call__(info)` runs after a step;
the trainer registers them in that order (`phase_loop.loop`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from smelt_jax.platform import storage
from smelt_jax.train.loop import StepInfo


class NanGuard:
    """Accumulates, on the device, whether any loss so far was non-finite (no host sync per step);
    `check` syncs and raises `error(last_good, at_step, metrics)` when one was."""

    def __init__(self, initial_bad: jax.Array, step: int, error: Callable[[int, int, Any], Exception]
                 ) -> None:
        self.bad, self.last_good_step, self.error = initial_bad, step, error

    def __call__(self, info: StepInfo) -> None:
        self.bad = self.bad | ~jnp.isfinite(info.metrics["loss"])

    def check(self, at_step: int, metrics: dict | None) -> None:
        if bool(self.bad):
            raise self.error(self.last_good_step, at_step, metrics)


class MetricsRecord:
    """Every `log_every` steps (and at the phase's end): the step's metrics as one record (loss,
    tokens, FLOPs, throughput, MFU) written to `log`, after the NaN guard has passed them."""

    def __init__(self, log, guard: NanGuard, *, tokens_per_step: int, flops_per_token: float,
                 peak: float, peak_source: str, progress=None) -> None:
        self.log, self.guard, self.progress = log, guard, progress
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.peak_source = peak, peak_source
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self.last: dict | None = None  # the last record written

    def count(self, _info: StepInfo) -> None:
        """Every step: its tokens go into the throughput window (and the progress bar moves)."""
        self.window_tokens += self.tokens_per_step
        if self.progress is not None:
            self.progress.update(1)

    def __call__(self, info: StepInfo) -> None:
        done = info.step
        values = {k: float(v) for k, v in jax.device_get(info.metrics).items()}
        self.guard.check(done, values)
        tokens_per_s = self.window_tokens / max(time.perf_counter() - self.window_start, 1e-9)
        # `tokens`: cumulative training tokens (the schedule's, as in budgets and endpoints);
        # `step_tokens`: the loss-bearing tokens of this step's batch.
        step_tokens = values.pop("tokens", None)
        flops_per_token = self.flops_per_token
        self.last = {"step": done, **values, "tokens": done * self.tokens_per_step,
                     "step_tokens": step_tokens,
                     "cumulative_flops": done * self.tokens_per_step * flops_per_token,
                     "tokens_per_s": tokens_per_s, "flops_per_s": tokens_per_s * flops_per_token,
                     "mfu": tokens_per_s * flops_per_token / self.peak, "peak_flops": self.peak,
                     "peak_flops_source": self.peak_source, "time": time.time()}
        self.log.write(self.last)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tokens_per_s:.0f}")
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self.guard.last_good_step = done


class PeriodicEval:
    """Every `eval_every` steps except the phase's last (whose evaluation is the endpoint's): the
    validation losses as an `{"step", "eval"}` record."""

    def __init__(self, log, evaluate: Callable[[Any], dict], end: int) -> None:
        self.log, self.evaluate, self.end = log, evaluate, end

    def __call__(self, info: StepInfo) -> None:
        if info.step != self.end:
            self.log.write({"step": info.step, "eval": self.evaluate(info.state.params)})


class Checkpoints:
    """After every step: save when the step is kept (a fork step or the end), is a multiple of
    `checkpoint_every`, or the run must stop (a signal, `stop_after`); then raise `stop(step)` when it
    must stop before the end. A repair (`only` set, its checkpointer rotating nothing) saves that one
    step, or the step it stops at."""

    def __init__(self, ckpt, guard: NanGuard, record: MetricsRecord, *, keep: set[int],
                 every: int, end: int, should_stop: Callable[[int], bool],
                 stop: Callable[[int], Exception], metadata: dict, only: int | None = None) -> None:
        self.ckpt, self.guard, self.record = ckpt, guard, record
        self.keep, self.every, self.end, self.only = keep, every, end, only
        self.should_stop, self.stop, self.metadata = should_stop, stop, metadata

    def save(self, info: StepInfo) -> None:
        self.guard.check(info.step, self.record.last)
        self.ckpt.save_state(info.state, self.metadata)

    def __call__(self, info: StepInfo) -> None:
        done, interrupted = info.step, self.should_stop(info.step)
        if self.only is not None:
            if done == self.only:
                self.save(info)
            elif interrupted:
                self.save(info)
                self.ckpt.close()
                raise self.stop(done)
            return
        if done in self.keep or done % self.every == 0 or done == self.end or interrupted:
            self.save(info)
        if interrupted and done != self.end:
            self.ckpt.close()
            raise self.stop(done)


class Profiler:
    """A `jax.profiler` trace of the steps [start, stop) into `folder` (`<phase>/profile/`). On gs://
    the trace is written to a local temporary folder and its files are uploaded when it stops."""

    def __init__(self, folder, start: int, stop: int) -> None:
        self.folder, self.start, self.stop = str(folder), start, stop
        self.active, self.local = False, None
        self.files: list[str] = []

    def before(self, step: int) -> None:
        if not self.active and self.start <= step < self.stop and not self.files:
            if storage.is_gcs(self.folder):
                import tempfile
                self.local = tempfile.mkdtemp(prefix="smelt-profile-")
            else:
                os.makedirs(self.folder, exist_ok=True)
            jax.profiler.start_trace(self.local or self.folder)
            self.active = True

    def __call__(self, info: StepInfo) -> None:
        self.after(info.step, (info.state.params, info.metrics))

    def after(self, done: int, outputs) -> None:
        """After the step that made `done` steps: stop the trace once `outputs` are computed."""
        if self.active and done >= self.stop:
            jax.block_until_ready(outputs)
            self.finish()

    def finish(self) -> None:
        if not self.active:
            return
        self.active = False
        jax.profiler.stop_trace()
        if self.local is None:
            self.files = storage.list_files(self.folder)
            return
        import shutil
        try:
            for path in sorted(Path(self.local).rglob("*")):
                if path.is_file():
                    target = storage.join(self.folder, path.relative_to(self.local).as_posix())
                    storage.write_bytes(target, path.read_bytes())
                    self.files.append(target)
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


def progress_bar(total: int, initial: int, description: str):
    """Progress on stderr: a tqdm bar on a terminal, one plain line per log interval otherwise."""
    from smelt_jax.platform import progress
    return progress.progress_bar(total, initial=initial, unit="step", desc=description)

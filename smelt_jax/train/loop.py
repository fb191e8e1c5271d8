"""The step loop with hooks (Levanter's `add_hook(fn, every=N)` shape), and the stop signal.

    loop = StepLoop(step_fn, before=[...])
    loop.add_hook(log, every=10, at={end})   # fn(info) after every 10th step, and after step `end`
    state = loop.run(state, stop_at)

`step_fn(state) -> (state, metrics)` advances the `TrainState` by one step; each hook receives a
`StepInfo` (the state after the step and that step's metrics) in the order the hooks were added, after
every step whose number (`info.step`, steps done) is a multiple of its `every` or is in its `at`.
A hook stops the loop by raising (the trainer's `Preempted`, `NonFiniteLoss`). `before` callables
run before each step with the step about to run.

`StopSignal`: SIGTERM and SIGINT set a flag for the whole of `train` (restore, compile, the loop, the
final evaluation); the trainer checks it at each step boundary and between phases of its work, saves
when a step has advanced since the last save, and stops with `Preempted` (exit 42).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Collection, Iterable
from typing import Any, Self

from smelt_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook sees after one step: the state after it (its `step` = steps done) and the metrics
    the step returned (device arrays)."""

    state: TrainState
    metrics: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state.step


@dataclasses.dataclass(frozen=True)
class _Hook:
    fn: Callable[[StepInfo], None]
    every: int
    at: frozenset[int]

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step in self.at


class StepLoop:
    """Runs `step_fn` from a state's step to `stop_at`, calling the hooks after each step."""

    def __init__(self, step_fn: Callable[[TrainState], tuple[TrainState, dict]],
                 before: Iterable[Callable[[int], None]] = ()) -> None:
        self.step_fn = step_fn
        self.before = list(before)
        self.hooks: list[_Hook] = []

    def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1,
                 at: Collection[int] = ()) -> None:
        """Call `fn(info)` after each step whose number is a multiple of `every` or is in `at`."""
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.hooks.append(_Hook(fn, int(every), frozenset(int(s) for s in at)))

    def run(self, state: TrainState, stop_at: int) -> TrainState:
        while state.step < stop_at:
            for fn in self.before:
                fn(state.step)
            state, metrics = self.step_fn(state)
            info = StepInfo(state, metrics)
            for hook in self.hooks:
                if hook.due(info.step):
                    hook.fn(info)
        return state


class StopSignal:
    """SIGTERM / SIGINT set `signal` (the number received) while the block runs; the previous
    handlers come back on exit. Outside the main thread signals are left alone."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def raised(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> Self:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, _frame) -> None:
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

"""The warmup-stable-decay learning rate as a pure function of (schedule, branch, step)."""

from __future__ import annotations

import math

from smelt_jax.design.config import Schedule
from smelt_jax.platform.errors import UsageError


def phase_steps(schedule: Schedule, branch: int | None) -> tuple[int, int]:
    """[first, end) global steps of the stable run (branch None) or of decay branch `branch`."""
    if branch is None:
        return 0, schedule.stable_steps
    if not 0 <= branch < len(schedule.fork_steps):
        raise UsageError(f"branch {branch} outside 0..{len(schedule.fork_steps) - 1}")
    return schedule.fork_steps[branch], schedule.branch_end_step(branch)


def learning_rate(schedule: Schedule, step: int, branch: int | None = None) -> float:
    """LR for the update taken at global `step` (0-based).

    Linear warmup to `peak_lr` over `warmup_steps`, then constant. On branch k, from its fork step a
    cosine from `peak_lr` to `peak_lr * final_lr_fraction` over the branch's decay steps
    (`Schedule.branch_decay_steps`; the last update lands on the final value).
    """
    first, end = phase_steps(schedule, branch)
    if not first <= step < end:
        raise ValueError(f"step {step} outside the phase's steps [{first}, {end})")
    if step < schedule.warmup_steps:
        return schedule.peak_lr * (step + 1) / schedule.warmup_steps
    if branch is None:
        return schedule.peak_lr
    progress = (step - first + 1) / (end - first)
    low = schedule.peak_lr * schedule.final_lr_fraction
    return low + 0.5 * (schedule.peak_lr - low) * (1.0 + math.cos(math.pi * progress))

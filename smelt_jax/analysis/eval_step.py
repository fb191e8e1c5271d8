"""Which checkpoint step `smelt eval` evaluates (issue 53): the newest, when it is whole; a damaged newest
checkpoint is refused in one line naming it and the older whole steps, never silently replaced by an
older one (`--step N` names the step to use). Damage is judged by `run_files.checkpoint_format`."""

from __future__ import annotations

from pathlib import Path

from smelt_jax.platform.errors import MissingInput, SmeltError


class CheckpointDamaged(SmeltError, ValueError):
    """The newest checkpoint of the phase to evaluate is damaged and no step was named."""


def newest_whole_step(folder: Path) -> int:
    """The newest committed step of the checkpoint `folder` when it looks whole (`checkpoint_format`'s
    cheap check: recorded files present at their sizes); CheckpointDamaged naming it and the older whole
    steps otherwise. Its checksums are then checked by the restore of that one step, which refuses it
    (CheckpointError, one line) rather than falling back to an older step."""
    from smelt_jax.run_files import checkpoint_format as fmt

    steps = fmt.committed_steps(folder)
    if not steps:
        raise MissingInput(f"no committed checkpoint in {folder} (train that phase first: `smelt train`)")
    damage = fmt.read_retrying(lambda: fmt.checkpoint_damage(folder, steps[-1]),
                               f"the checkpoint at step {steps[-1]} in {folder}")
    if damage:
        older = [s for s in fmt.good_steps(folder) if s < steps[-1]]
        hint = (f"evaluate an older one with --step N (whole: {', '.join(map(str, older[-5:]))})" if older
                else "no older whole checkpoint to evaluate")
        raise CheckpointDamaged(f"the newest checkpoint, step {steps[-1]} in {folder}, is damaged "
                                f"({damage}); nothing evaluated: {hint}")
    return steps[-1]

"""Restore and repair of a phase (`smelt_jax.train.trainer`): the newest good checkpoint as one TrainState
(a branch starts from its fork step), damaged steps moved aside, and a missing fork checkpoint trained
again from the newest good step below it. Split from trainer.py (issue 52)."""

from __future__ import annotations

import sys


from smelt_jax.platform import storage
from smelt_jax.platform.errors import UsageError
from smelt_jax.run_files.rundir import RunDir
from smelt_jax.train.checkpoint import Checkpointer, CheckpointError
from smelt_jax.train.state import TrainState
from smelt_jax.train.phase import ForkCheckpointDamaged, Phase
from smelt_jax.train.phase_loop import loop




def _stable_holes(rd: RunDir, schedule, good: list[int]) -> list[int]:
    """Fork steps below the newest good stable step whose checkpoint is missing (damaged and moved
    aside) while their branch has no endpoint yet: the stable run must train them again."""
    if not good:
        return []
    return [f for k, f in enumerate(schedule.fork_steps)
            if f < good[-1] and f not in good and not storage.exists(rd.endpoint(k))]


def open_checkpoints(phase: Phase) -> tuple[Checkpointer, int | None, list[int]]:
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


def repair(phase: Phase, ckpt: Checkpointer, hole: int, good: list[int]) -> None:
    """Train the stable run again from the newest good step below `hole` to `hole`, saving only it."""
    try:
        state = TrainState.target(phase.plan, phase.first)
        below = [s for s in good if s < hole]
        if below:
            state = ckpt.restore_state(state, step=below[-1], check=phase.check_data)
        phase.check_stop("after restoring")
        if state.is_abstract:
            state = TrainState.initial(phase.plan, phase.tx, phase.run.schedule.seed, state.step)
        loop(phase, ckpt, state, stop_at=hole, only=hole)
    finally:
        ckpt.close()


def restore(phase: Phase, ckpt: Checkpointer) -> TrainState:
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
            state = restore_fork(phase, state)
    except BaseException:
        ckpt.close()
        raise
    return state


def restore_fork(phase: Phase, target: TrainState) -> TrainState:
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



"""Checkpoints for the trainer: orbax CheckpointManager with async saves, kept fork points, and a fallback.

A checkpoint at step s holds two items: `state`, a pytree of jax arrays (parameters and optimizer
state), and `metadata`, a small JSON dict (the step, the data position, the run). The trainer saves and
restores one `TrainState` whole (`save_state` / `restore_state`); the on-disk format is
`smelt_jax.run_files.checkpoint_format`'s, which also judges a step (committed, whole, damaged). Saves are
asynchronous: `save` returns once the arrays are copied off the devices, and the files are written in
the background (`wait` blocks until they are committed).

Retention: the newest `max_to_keep` checkpoints are rotated; steps in `keep_forever` (the decay
branches' fork steps) are never deleted. Code that only reads checkpoints (a branch reading its fork
step, evaluation) opens them with `read_only=True`: orbax then creates, rotates and cleans nothing.

Integrity: orbax commits a checkpoint by renaming its temporary folder, so an interrupted save never
shows up as a step. Every committed step also gets a checksum file (sha256 and size of each file),
checked before restoring. A step that fails its checks or its decode is damaged: `restore` warns,
names the step and the error, and falls back to the next older step; with `quarantine=True` (the
trainer, which holds the phase's lock) the damaged step is moved aside (`<step>.damaged`, never
deleted), so the run resumes from the last good step and can save that step again. A read that fails
for lack of access (permissions, credentials) or a storage error that outlasts the retries
(`checkpoint_format.read_retrying`) is not damage: `CheckpointAccessError`, one line, nothing moved.

On Cloud Storage (a gs:// directory) orbax writes a step in place and commits it with
`<step>/commit_success.txt`; no checksum file is written (Cloud Storage checks each object's CRC32C),
so damage shows as a failed restore, and moving a step aside copies its objects then deletes them.

Failed saves: a save runs in the background; `raise_if_save_failed()` (called by the trainer after every
step) turns a failed one into a `CheckpointSaveError` naming the step, the cause and the newest good
step (through orbax's public `is_saving_in_progress` and `wait_until_finished`). The temporary folder a failed or killed save leaves
(`<step>.orbax-checkpoint-tmp*`) is removed by the next `Checkpointer(..., clean_temporary=True)` on
that folder. After a failed save orbax's background writers keep logging (tracebacks, orphaned asyncio
futures, callbacks into closed event loops); `quiet_failed_save_noise` drops those messages once the
failure is reported.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from smelt_jax.run_files import checkpoint_format as fmt
from smelt_jax.platform import storage
from smelt_jax.run_files.checkpoint_format import CheckpointAccessError
from smelt_jax.platform.errors import SmeltError

if TYPE_CHECKING:
    from smelt_jax.train.state import TrainState

__all__ = ["CheckpointAccessError", "CheckpointCorruptionWarning", "CheckpointError",
           "CheckpointSaveError", "Checkpointer", "abstract_like", "quiet_failed_save_noise"]


class CheckpointError(SmeltError, RuntimeError):
    """No usable checkpoint (all candidates missing or damaged)."""


class CheckpointSaveError(RuntimeError):
    """A (background) save failed: training must stop; earlier committed steps are still good."""


class CheckpointCorruptionWarning(UserWarning):
    """A checkpoint failed its checksums or its restore and was skipped (and maybe moved aside)."""


class _NoOrbaxTracebacks(logging.Filter):
    """Orbax logs every failure of a background save as errors with tracebacks (dozens, one per
    thread); the Checkpointer reports a failed save itself, once (CheckpointSaveError), and a failed
    restore as a warning, so orbax's error records are dropped and its other records lose tracebacks.
    Its notices that a manager is read-only are dropped too (readers open them so on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in (record.pathname or ""):
            return True
        if record.levelno >= logging.ERROR:
            return False
        if str(record.msg).startswith(_READ_ONLY_NOTICES):
            return False  # a reader opened read-only on purpose (Checkpointer(read_only=True))
        record.exc_info, record.exc_text = None, None
        return True


_READ_ONLY_NOTICES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")
_FILTER = _NoOrbaxTracebacks()


class _NoOrphanFutureErrors(logging.Filter):
    """asyncio's "Future/Task exception was never retrieved": orbax's background writers after a
    failed save, which the Checkpointer reports itself (one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)


_QUIETED = False


def quiet_failed_save_noise() -> None:
    """After a failed save, tensorstore callbacks still post to orbax's closed event loops (Python
    prints each as "Exception ignored ... Event loop is closed" with a traceback) and asyncio logs,
    when they are garbage collected, the futures nobody awaits any more ("... exception was never
    retrieved"), up to the process's exit. The failure is reported once (CheckpointSaveError), so these
    two kinds of messages are dropped for the rest of the process (nothing else is). Idempotent."""
    global _QUIETED
    if _QUIETED:
        return
    _QUIETED = True
    logging.getLogger("asyncio").addFilter(_NoOrphanFutureErrors())
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        err = unraisable.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStruct leaves with shardings: the restore target for `tree`.

    `shardings` is a pytree of `jax.sharding.Sharding` matching `tree`, or one sharding for every leaf,
    or None to keep each array's own sharding.
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    """Save and restore (state pytree, metadata dict) by step under `directory`.

    Use one per run (and close it): `save(step, state, metadata)`, `restore(target)`.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
                 keep_forever: Iterable[int] = (), async_save: bool = True,
                 clean_temporary: bool = False, read_only: bool = False) -> None:
        """`clean_temporary`: remove the temporary folders of saves that never committed (only the
        phase's single writer, holding its lock, may do this). `read_only`: a reader (a branch's fork
        step, evaluation): orbax creates, rotates and cleans nothing, and `save` is refused."""
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        # gs://: orbax gets the URL itself (never made absolute: it would become ./gs:/...) and
        # reaches the bucket through etils.epath (gcsfs); steps are not sealed with checksums there.
        self.remote = storage.is_gcs(directory)
        self.directory = storage.as_path(directory) if self.remote else Path(directory).absolute()
        self.keep_forever = frozenset(int(s) for s in keep_forever)
        self.read_only = read_only
        self.removed_temporary: list[str] = []
        if clean_temporary and not read_only and jax.process_index() == 0:
            for temp in fmt.temporary_checkpoints(self.directory):
                shutil.rmtree(temp, ignore_errors=True) if temp.is_dir() else temp.unlink()
                self.removed_temporary.append(temp.name)
        logging.getLogger("absl").addFilter(_FILTER)
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        else:
            policy = checkpoint_managers.AnyPreservationPolicy([
                checkpoint_managers.LatestN(n=max_to_keep),
                checkpoint_managers.CustomSteps(sorted(self.keep_forever)),
            ])
            options = ocp.CheckpointManagerOptions(
                preservation_policy=policy, enable_async_checkpointing=async_save, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "metadata"))
        self._unsealed: list[int] = []
        self._in_flight: int | None = None  # the step of the newest save started
        self._failed: CheckpointSaveError | None = None

    # Saving -----------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, metadata: dict | None = None) -> None:
        """Start saving `state` (pytree of arrays) and `metadata` (JSON dict) as `step`; returns early.

        Raises CheckpointSaveError if this save, or an earlier one still in flight, failed."""
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read-only: cannot save step {step}")
        metadata = dict(metadata or {})
        metadata.setdefault("step", int(step))
        json.dumps(metadata)  # fail here, not in the background thread, on non-JSON metadata
        self._seal_finished()
        try:
            saved = self._manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)), force=True)
        except Exception as err:  # noqa: BLE001 — a save that cannot start is a failed save
            raise self._save_error(int(step), err) from err
        if not saved:
            raise CheckpointError(f"orbax declined to save step {step} (already saved?)")
        self._in_flight = int(step)
        self._unsealed.append(int(step))

    def save_state(self, state: TrainState, metadata: dict | None = None) -> None:
        """Start saving a whole `TrainState` at its step: its arrays as `state`, its step and data
        position (and `metadata`, e.g. the run) as `metadata`."""
        self.save(state.step, state.arrays(), {**state.positions(), **(metadata or {})})

    def _save_error(self, step: int, err: BaseException) -> CheckpointSaveError:
        quiet_failed_save_noise()
        if self._failed is None:
            good = self._resumable_step(step)
            then = (f"the run resumes from step {good} ({storage.join(str(self.directory), str(good))})"
                    if good is not None else
                    "no checkpoint of this phase is saved, so the run starts the phase again")
            self._failed = CheckpointSaveError(
                f"saving the checkpoint at step {step} in {self.directory} failed: "
                f"{_cause(err)}; training stopped; {then} once the cause is fixed")
        return self._failed

    def _resumable_step(self, failed: int) -> int | None:
        """The step the next run restores after a failed save of `failed`: the newest committed step
        that passes the cheap check (a step the failure damaged, e.g. a half-written checksum file on a
        full disk, is moved aside then), or None."""
        try:
            steps = self._committed_steps()
        except OSError:
            return None  # cannot be listed now: nothing is promised
        for step in reversed(steps):
            try:
                if step != failed and fmt.checkpoint_damage(self.directory, step) is None:
                    return step
            except (OSError, CheckpointAccessError):
                continue  # cannot be checked now: not promised
        return None

    def _committed_steps(self) -> list[int]:
        return fmt.committed_steps(self.directory)

    def raise_if_save_failed(self) -> None:
        """Raise CheckpointSaveError if a background save has failed; never blocks."""
        if self._failed is not None:
            raise self._failed
        if self._in_flight is None:
            return
        if self._manager.is_saving_in_progress():
            return  # still writing: nothing to report yet
        try:  # the save is over (public API): this returns at once, or raises the save's error
            self._manager.check_for_errors()
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 — any error of a background save is a failed save
            raise self._save_error(self._in_flight, err) from err

    def wait(self) -> None:
        """Block until every started save is committed (and checksummed)."""
        self._wait_for_saves()
        self._seal_finished()

    def _wait_for_saves(self) -> None:
        if self._failed is not None:
            raise self._failed
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001
            raise self._save_error(self._in_flight if self._in_flight is not None else -1, err) from err

    def _seal_finished(self) -> None:
        """Write the checksum file of each committed step that has none yet."""
        if not self._unsealed:
            return
        self._wait_for_saves()  # the previous async save must be done before sealing
        if self.remote:  # gs://: Cloud Storage checks each object's CRC32C itself
            self._unsealed.clear()
            return
        if jax.process_index() == 0:  # one writer per (shared) checkpoint folder
            for step in self._unsealed:
                try:
                    fmt.seal(self.directory / str(step))
                except OSError as err:
                    raise self._save_error(step, err) from err
        self._unsealed.clear()

    def close(self) -> None:
        """Wait for the saves in flight, then release orbax's threads (also after a failed save)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if self._failed is None:
                self.wait()
        finally:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 — a failed save is already reported
                if self._failed is None:
                    raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Reading -----------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> None:
        """Raise CheckpointError if a file of `step` is missing or differs from its recorded sha256
        (CheckpointAccessError if a file cannot be read for lack of access)."""
        damage = fmt.read_retrying(lambda: fmt.digest_damage(self.directory, step),
                                   f"the checkpoint at step {step} in {self.directory}")
        if damage:
            raise CheckpointError(f"step {step}: {damage}")

    def quarantine(self, step: int, reason: str) -> Path:
        """Move the damaged `step` aside (`<step>.damaged`, never deleted) and report it."""
        target = fmt.move_aside(self.directory, step)
        self._manager.reload()
        warnings.warn(f"checkpoint at step {step} in {self.directory} is damaged ({reason}); moved "
                      f"aside to {target.name}", CheckpointCorruptionWarning, stacklevel=3)
        return target

    def _read(self, step: int, abstract: Any) -> dict:
        """The restored items of `step`, after its checksums (integrity errors raise)."""
        def read():
            damage = fmt.digest_damage(self.directory, step)
            if damage:
                raise CheckpointError(f"step {step}: {damage}")
            return self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()))
        return fmt.read_retrying(read, f"the checkpoint at step {step} in {self.directory}")

    def restore(self, target: Any, step: int | None = None, *,
                quarantine: bool = False) -> tuple[int, Any, dict]:
        """(step, state, metadata) from `step`, or from the newest step that restores cleanly.

        `target` is a pytree like the saved state whose leaves are arrays or `jax.ShapeDtypeStruct`s
        with a `sharding` (see `abstract_like`): the state comes back with those shardings, whatever
        the mesh it was saved from. With `step=None`, a damaged checkpoint is skipped with a
        CheckpointCorruptionWarning and the next older one is tried; with `quarantine=True` it is
        also moved aside (`quarantine`), so that the step can be saved again. An access failure
        (`CheckpointAccessError`) stops at once and moves nothing.
        """
        if not self.read_only:
            self.wait()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint at step {step} in {self.directory} (have {steps})")
            candidates = [step]
        else:
            candidates = sorted(steps, reverse=True)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract = abstract_like(target) if _has_concrete_leaves(target) else target
        errors = []
        for candidate in candidates:
            try:
                restored = self._read(candidate, abstract)
                return candidate, restored["state"], dict(restored["metadata"])
            except CheckpointAccessError:
                raise
            except Exception as err:  # noqa: BLE001 — any other failure to read means "damaged"
                errors.append(f"step {candidate}: {type(err).__name__}: {_short(err)}")
                if step is not None:
                    break
                if quarantine and jax.process_index() == 0:
                    self.quarantine(candidate, f"{type(err).__name__}: {_short(err, 200)}")
                else:
                    warnings.warn(f"checkpoint at step {candidate} in {self.directory} is unusable "
                                  f"({type(err).__name__}: {_short(err, 200)}); trying an older one",
                                  CheckpointCorruptionWarning, stacklevel=2)
        raise CheckpointError("no usable checkpoint: " + " | ".join(errors))

    def restore_state(self, target: TrainState, step: int | None = None, *, quarantine: bool = False,
                      check: Callable[[int, dict], None] | None = None) -> TrainState:
        """A whole `TrainState` restored into `target`'s shapes and shardings (see `restore`): its
        arrays from the `state` item, its step from the step restored and its data position from the
        metadata (`data_step`; checkpoints without one restore with data_step = step). `check(step,
        metadata)` runs on the restored step's metadata before the state is returned (it raises to
        refuse it: the trainer checks the data digest there)."""
        restored_step, arrays, metadata = self.restore(target.arrays(), step, quarantine=quarantine)
        if check is not None:
            check(restored_step, metadata)
        return target.with_arrays(arrays, step=restored_step,
                                  data_step=int(metadata.get("data_step", restored_step)))

    def quarantine_damaged(self, steps: Iterable[int]) -> list[int]:
        """The cheap check (sizes, missing files) on `steps`; moves the damaged ones aside."""
        moved = []
        for step in steps:
            if step in self.all_steps():
                reason = fmt.checkpoint_damage(self.directory, step)
                if reason:
                    self.quarantine(step, reason)
                    moved.append(step)
        return moved


def _short(err: BaseException, limit: int = 300) -> str:
    return " ".join(str(err).split())[:limit]


def _cause(err: BaseException) -> str:
    """The reason a save failed, short: the OS error when there is one (also inside tensorstore's
    messages, which end in `[os_error_code='28']`), else the end of the message."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror} [errno {seen.errno}]" + (f" ({seen.filename})" if seen.filename else "")
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(err).split())
    found = storage.tensorstore_os_error(err)
    if found is not None:
        return f"{found.strerror} [errno {found.errno}] ({found.filename or type(err).__name__})"
    return f"{type(err).__name__}: " + (text if len(text) <= 300 else "..." + text[-300:])


def _has_concrete_leaves(tree: Any) -> bool:
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))

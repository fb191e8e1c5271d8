"""Checkpoints for the trainer: orbax CheckpointManager with async saves, kept fork points, and a fallback.

A checkpoint at step s holds two items: `state`, any pytree of jax arrays (parameters, optimizer state,
step counters), and `metadata`, a small JSON dict (for example the step and the data position). Saves
are asynchronous: `save` returns once the arrays are copied off the devices, and the files are written
in the background (`wait` blocks until they are committed).

Retention: the newest `max_to_keep` checkpoints are rotated; steps in `keep_forever` (the decay
branches' fork steps) are never deleted.

Integrity: orbax commits a checkpoint by renaming its temporary folder, so an interrupted save never
shows up as a step. A committed checkpoint that was damaged later (a truncated or deleted file) fails to
restore; `restore` then warns, names the step and the error, and falls back to the next older step.
To catch damage that would still decode (a truncated chunk tail), every committed step also gets a
`smelt_checksums.json` with the sha256 and size of each of its files, checked before restoring
(`rundir.checkpoint_damage` is the cheap check, sizes only, that the sweep uses for readiness).
With `quarantine=True` (the trainer, which holds the phase's lock) a damaged step is moved aside, never
deleted: renamed `<step>.damaged` and reported, so the run resumes from the last good step and can save
that step again.

On Cloud Storage (a gs:// directory) orbax writes a step in place and commits it with
`<step>/commit_success.txt`; no checksum file is written (Cloud Storage checks each object's CRC32C),
so damage shows as a failed restore, and moving a step aside copies its objects then deletes them.

Failed saves: a save runs in the background; `raise_if_save_failed()` (called by the trainer after every
step) turns a failed one into a `CheckpointSaveError` naming the step, the cause and the newest good
step. The temporary folder a failed or killed save leaves (`<step>.orbax-checkpoint-tmp*`) is removed
by the next `Checkpointer(..., clean_temporary=True)` on that folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from smelt_jax.errors import SmeltError
from smelt_jax.rundir import (
    CHECKSUM_FILE,
    DAMAGED_SUFFIX,
    as_path,
    checkpoint_damage,
    damaged_checkpoints,
    is_remote,
    recorded_files,
    temporary_checkpoints,
)


def _move_objects(source: str, target: str) -> None:
    """gs://: move every object under `source/` to `target/` (copy, then delete: no rename on Cloud
    Storage). The commit file goes first, so a move cut short leaves an uncommitted step behind."""
    from smelt_jax.data import gcs
    files = gcs.list_files(source)
    files.sort(key=lambda url: not url.endswith("/commit_success.txt"))
    for url in files:
        gcs.write_bytes(target + url[len(source):], gcs.read_bytes(url))
    for url in files:
        gcs.delete(url)


class CheckpointError(SmeltError, RuntimeError):
    """No usable checkpoint (all candidates missing or damaged)."""


class CheckpointSaveError(RuntimeError):
    """A (background) save failed: training must stop; earlier committed steps are still good."""


class CheckpointCorruptionWarning(UserWarning):
    """A checkpoint failed its checksums or its restore and was skipped (and maybe moved aside)."""


def _file_digests(step_dir: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(p for p in step_dir.rglob("*")
                       if p.is_file() and not p.name.startswith(CHECKSUM_FILE)):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
        out[path.relative_to(step_dir).as_posix()] = {"sha256": digest.hexdigest(),
                                                      "size": path.stat().st_size}
    return out


class _NoOrbaxTracebacks(logging.Filter):
    """Orbax logs every failure of a background save as errors with tracebacks (dozens, one per
    thread); the Checkpointer reports a failed save itself, once (CheckpointSaveError), and a failed
    restore as a warning, so orbax's error records are dropped and its other records lose tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in (record.pathname or ""):
            return True
        if record.levelno >= logging.ERROR:
            return False
        record.exc_info, record.exc_text = None, None
        return True


_FILTER = _NoOrbaxTracebacks()


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
                 clean_temporary: bool = False) -> None:
        """`clean_temporary`: remove the temporary folders of saves that never committed (only the
        phase's single writer, holding its lock, may do this)."""
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        # gs://: orbax gets the URL itself (never made absolute: it would become ./gs:/...) and
        # reaches the bucket through etils.epath (gcsfs); steps are not sealed with checksums there.
        self.remote = is_remote(directory)
        self.directory = as_path(directory) if self.remote else Path(directory).absolute()
        self.keep_forever = frozenset(int(s) for s in keep_forever)
        self.removed_temporary: list[str] = []
        if clean_temporary and jax.process_index() == 0:
            for temp in temporary_checkpoints(self.directory):
                shutil.rmtree(temp, ignore_errors=True) if temp.is_dir() else temp.unlink()
                self.removed_temporary.append(temp.name)
        logging.getLogger("absl").addFilter(_FILTER)
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

    def _save_error(self, step: int, err: BaseException) -> CheckpointSaveError:
        if self._failed is None:
            good = [s for s in self._committed_steps() if s != step]
            kept = (f"the newest good checkpoint is step {good[-1]}" if good
                    else "no checkpoint of this phase is committed yet")
            self._failed = CheckpointSaveError(
                f"saving the checkpoint at step {step} in {self.directory} failed: "
                f"{_cause(err)}; training stopped; {kept}, and the run resumes from it once the "
                "cause is fixed")
        return self._failed

    def _committed_steps(self) -> list[int]:
        from smelt_jax.rundir import committed_steps
        return committed_steps(self.directory)

    def raise_if_save_failed(self) -> None:
        """Raise CheckpointSaveError if a background save has failed; never blocks."""
        if self._failed is not None:
            raise self._failed
        if self._in_flight is None:
            return
        holder = getattr(self._manager, "_finalize_thread", None)
        thread = holder.get() if holder is not None and hasattr(holder, "get") else None
        error = getattr(thread, "exception", None) if thread is not None else None
        if error is not None and not thread.is_alive():
            raise self._save_error(self._in_flight, error)

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
                step_dir = self.directory / str(step)
                if step_dir.is_dir() and not (step_dir / CHECKSUM_FILE).exists():
                    try:
                        digests = json.dumps({"version": 2, "files": _file_digests(step_dir)},
                                             indent=0, sort_keys=True)
                        handle, temp = tempfile.mkstemp(prefix=CHECKSUM_FILE, suffix=".tmp",
                                                        dir=step_dir)
                        with os.fdopen(handle, "w") as out:
                            out.write(digests)
                        os.replace(temp, step_dir / CHECKSUM_FILE)
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
        """Raise CheckpointError if a file of `step` is missing or differs from its recorded sha256."""
        step_dir = self.directory / str(step)
        quick = checkpoint_damage(self.directory, step)
        if quick:
            raise CheckpointError(f"step {step}: {quick}")
        recorded = recorded_files(step_dir)
        if recorded is None:
            return  # saved by another writer or not sealed yet: the restore itself is the check
        actual = _file_digests(step_dir)
        bad = sorted(name for name, want in recorded.items()
                     if actual.get(name, {}).get("sha256") != want["sha256"])
        if bad:
            raise CheckpointError(f"step {step}: files missing or changed since the save: {bad[:5]}")

    def quarantine(self, step: int, reason: str) -> Path:
        """Move the damaged `step` aside (`<step>.damaged`, never deleted) and report it."""
        source = self.directory / str(step)
        target = self.directory / f"{step}{DAMAGED_SUFFIX}"
        taken = ({p.name for p in damaged_checkpoints(self.directory)} if self.remote else None)
        n = 1
        while target.name in taken if self.remote else target.exists():
            target = self.directory / f"{step}{DAMAGED_SUFFIX}.{n}"
            n += 1
        if self.remote:
            _move_objects(str(source), str(target))
        else:
            os.rename(source, target)
        self._manager.reload()
        warnings.warn(f"checkpoint at step {step} in {self.directory} is damaged ({reason}); moved "
                      f"aside to {target.name}", CheckpointCorruptionWarning, stacklevel=3)
        return target

    def restore(self, target: Any, step: int | None = None, *,
                quarantine: bool = False) -> tuple[int, Any, dict]:
        """(step, state, metadata) from `step`, or from the newest step that restores cleanly.

        `target` is a pytree like the saved state whose leaves are arrays or `jax.ShapeDtypeStruct`s
        with a `sharding` (see `abstract_like`): the state comes back with those shardings, whatever
        the mesh it was saved from. With `step=None`, a damaged checkpoint is skipped with a
        CheckpointCorruptionWarning and the next older one is tried; with `quarantine=True` it is
        also moved aside (`quarantine`), so that the step can be saved again.
        """
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
                self.verify(candidate)
                restored = self._manager.restore(candidate, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()))
                return candidate, restored["state"], dict(restored["metadata"])
            except Exception as err:  # noqa: BLE001 — any failure to read means "damaged"
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

    def quarantine_damaged(self, steps: Iterable[int]) -> list[int]:
        """The cheap check (sizes, missing files) on `steps`; moves the damaged ones aside."""
        moved = []
        for step in steps:
            if step in self.all_steps():
                reason = checkpoint_damage(self.directory, step)
                if reason:
                    self.quarantine(step, reason)
                    moved.append(step)
        return moved


def _short(err: BaseException, limit: int = 300) -> str:
    return " ".join(str(err).split())[:limit]


def _cause(err: BaseException) -> str:
    """The reason a save failed, short: the OS error when there is one (also inside tensorstore's
    messages, which end in `[os_error_code='28']`), else the end of the message."""
    import re
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror} [errno {seen.errno}]" + (f" ({seen.filename})" if seen.filename else "")
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(err).split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        return f"{os.strerror(int(code.group(1)))} [errno {code.group(1)}] ({type(err).__name__})"
    return f"{type(err).__name__}: " + (text if len(text) <= 300 else "..." + text[-300:])


def _has_concrete_leaves(tree: Any) -> bool:
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))

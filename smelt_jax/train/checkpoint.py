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
`smelt_checksums.json` with the sha256 of each of its files, checked before restoring.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

CHECKSUM_FILE = "smelt_checksums.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint (all candidates missing or damaged)."""


class CheckpointCorruptionWarning(UserWarning):
    """A checkpoint failed its checksums or its restore and was skipped."""


def _file_digests(step_dir: Path) -> dict[str, str]:
    out = {}
    for path in sorted(p for p in step_dir.rglob("*")
                       if p.is_file() and not p.name.startswith(CHECKSUM_FILE)):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
        out[path.relative_to(step_dir).as_posix()] = digest.hexdigest()
    return out


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
                 keep_forever: Iterable[int] = (), async_save: bool = True) -> None:
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        self.keep_forever = frozenset(int(s) for s in keep_forever)
        policy = checkpoint_managers.AnyPreservationPolicy([
            checkpoint_managers.LatestN(n=max_to_keep),
            checkpoint_managers.CustomSteps(sorted(self.keep_forever)),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, enable_async_checkpointing=async_save, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "metadata"))
        self._unsealed: list[int] = []

    # Saving -----------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, metadata: dict | None = None) -> None:
        """Start saving `state` (pytree of arrays) and `metadata` (JSON dict) as `step`; returns early."""
        metadata = dict(metadata or {})
        metadata.setdefault("step", int(step))
        json.dumps(metadata)  # fail here, not in the background thread, on non-JSON metadata
        self._seal_finished()
        saved = self._manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)), force=True)
        if not saved:
            raise CheckpointError(f"orbax declined to save step {step} (already saved?)")
        self._unsealed.append(int(step))

    def wait(self) -> None:
        """Block until every started save is committed (and checksummed)."""
        self._manager.wait_until_finished()
        self._seal_finished()

    def _seal_finished(self) -> None:
        """Write the checksum file of each committed step that has none yet."""
        if not self._unsealed:
            return
        self._manager.wait_until_finished()  # the previous async save must be done before sealing
        if jax.process_index() == 0:  # one writer per (shared) checkpoint folder
            for step in self._unsealed:
                step_dir = self.directory / str(step)
                if step_dir.is_dir() and not (step_dir / CHECKSUM_FILE).exists():
                    digests = json.dumps(_file_digests(step_dir), indent=0, sort_keys=True)
                    handle, temp = tempfile.mkstemp(prefix=CHECKSUM_FILE, suffix=".tmp", dir=step_dir)
                    with os.fdopen(handle, "w") as out:
                        out.write(digests)
                    os.replace(temp, step_dir / CHECKSUM_FILE)
        self._unsealed.clear()

    def close(self) -> None:
        self.wait()
        self._manager.close()

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
        recorded_path = step_dir / CHECKSUM_FILE
        if not recorded_path.is_file():
            return  # saved by another writer or not sealed yet: the restore itself is the check
        recorded = json.loads(recorded_path.read_text())
        actual = _file_digests(step_dir)
        bad = sorted(name for name in recorded if actual.get(name) != recorded[name])
        if bad:
            raise CheckpointError(f"step {step}: files missing or changed since the save: {bad[:5]}")

    def restore(self, target: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """(step, state, metadata) from `step`, or from the newest step that restores cleanly.

        `target` is a pytree like the saved state whose leaves are arrays or `jax.ShapeDtypeStruct`s
        with a `sharding` (see `abstract_like`): the state comes back with those shardings, whatever
        the mesh it was saved from. With `step=None`, a damaged checkpoint is skipped with a
        CheckpointCorruptionWarning and the next older one is tried.
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
                errors.append(f"step {candidate}: {type(err).__name__}: {str(err)[:300]}")
                if step is not None:
                    break
                warnings.warn(f"checkpoint at step {candidate} in {self.directory} is unusable "
                              f"({type(err).__name__}: {str(err)[:200]}); trying an older one",
                              CheckpointCorruptionWarning, stacklevel=2)
        raise CheckpointError("no usable checkpoint: " + " | ".join(errors))


def _has_concrete_leaves(tree: Any) -> bool:
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))

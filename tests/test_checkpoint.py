"""Checkpoints: rotation with kept fork steps, metadata, resharding on restore, damaged-step fallback."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from smelt_jax.run_files.checkpoint_format import CHECKSUM_FILE
from smelt_jax.train.checkpoint import (
    CheckpointCorruptionWarning,
    Checkpointer,
    CheckpointError,
    abstract_like,
)


def _state(offset: float) -> dict:
    return {"params": {"w": jnp.arange(32.0).reshape(8, 4) + offset, "b": jnp.full((4,), offset)},
            "opt": {"count": jnp.array(int(offset), jnp.int32)}}


def _assert_state(tree, offset: float) -> None:
    want = _state(offset)
    for got_leaf, want_leaf in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))
        assert got_leaf.dtype == want_leaf.dtype


def _largest_array_file(step_dir):
    """The largest file of the merged OCDBT data folder: the bytes a restore reads."""
    files = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def test_rotation_keeps_fork_steps_forever(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2, keep_forever=[2, 3]) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, _state(step), {"data_step": step * 10})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3, 5, 6]
        for step in (2, 3, 5, 6):
            got_step, state, meta = ckpt.restore(_state(0), step=step)
            assert got_step == step and meta == {"data_step": step * 10, "step": step}
            _assert_state(state, step)
        assert ckpt.restore(_state(0))[0] == 6
        with pytest.raises(CheckpointError, match="no checkpoint at step 4"):
            ckpt.restore(_state(0), step=4)
    # A new Checkpointer on the same folder sees the same steps (resume after a restart).
    with Checkpointer(tmp_path, max_to_keep=2, keep_forever=[2, 3]) as again:
        assert again.latest_step() == 6


def test_bad_metadata_and_options_fail_early(tmp_path):
    with pytest.raises(ValueError):
        Checkpointer(tmp_path / "a", max_to_keep=0)
    with Checkpointer(tmp_path / "b") as ckpt:
        with pytest.raises(TypeError):
            ckpt.save(1, _state(1), {"bad": object()})
        with pytest.raises(CheckpointError, match="no checkpoint"):
            ckpt.restore(_state(0))


@pytest.mark.parametrize("keep_checksums", [True, False])
def test_truncated_checkpoint_is_skipped_with_a_warning(tmp_path, keep_checksums):
    """Truncate the newest step's array data: restore warns and returns the previous step.

    With checksums the damage is caught before reading; without them (a step sealed by nobody) the
    orbax restore itself fails and the same fallback applies.
    """
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step), {"data_step": step})
        ckpt.wait()
        victim = _largest_array_file(tmp_path / "3")
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        if not keep_checksums:
            (tmp_path / "3" / CHECKSUM_FILE).unlink()
        with pytest.warns(CheckpointCorruptionWarning, match="step 3"):
            step, state, meta = ckpt.restore(_state(0))
        assert step == 2 and meta["data_step"] == 2
        _assert_state(state, 2)
        with pytest.raises(CheckpointError, match="step 3"):
            ckpt.restore(_state(0), step=3)  # an explicit step does not fall back


def test_partial_save_is_ignored_and_all_damaged_is_an_error(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait()
        # A crash mid-save leaves orbax's temporary folder: it is not a step.
        shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp-1234")
        assert ckpt.all_steps() == [1]
        assert ckpt.restore(_state(0))[0] == 1
        recorded = json.loads((tmp_path / "1" / CHECKSUM_FILE).read_text())["files"]
        assert recorded and all(len(v["sha256"]) == 64 and v["size"] >= 0 for v in recorded.values())
        (tmp_path / "1" / "state" / "_METADATA").unlink()
        with pytest.warns(CheckpointCorruptionWarning), pytest.raises(CheckpointError, match="usable"):
            ckpt.restore(_state(0))


def test_restore_onto_another_sharding(tmp_path):
    devices = np.array(jax.devices())
    assert devices.size == 8, "conftest fakes 8 CPU devices"
    row_mesh = jax.sharding.Mesh(devices, ("data",))
    grid_mesh = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "model"))
    saved = {"w": jax.device_put(jnp.arange(8 * 16.0).reshape(8, 16), NamedSharding(row_mesh, P("data"))),
             "v": jax.device_put(jnp.arange(16.0), NamedSharding(row_mesh, P()))}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, saved, {"data_step": 7})
        ckpt.wait()
        targets = {"w": NamedSharding(grid_mesh, P("model", "data")), "v": NamedSharding(grid_mesh, P("model"))}
        step, state, _ = ckpt.restore(abstract_like(saved, targets))
    assert step == 7
    for key, value in saved.items():
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(value))
        assert state[key].sharding == targets[key]
    assert len(state["w"].addressable_shards) == 8
    assert state["w"].addressable_shards[0].data.shape == (2, 8)  # 8/4 rows, 16/2 columns

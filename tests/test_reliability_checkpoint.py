"""Issue 15 at the Checkpointer: damaged steps moved aside and saved again, the cheap damage check,
old checksum files, and a failed background save on a real full filesystem (a small tmpfs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.run_files.checkpoint_format import (
    CHECKSUM_FILE,
    checkpoint_damage,
    committed_steps,
    damaged_checkpoints,
    good_steps,
)
from smelt_jax.train.checkpoint import CheckpointCorruptionWarning, Checkpointer

REPO = Path(__file__).resolve().parents[1]


def _state(offset: float) -> dict:
    return {"w": jnp.arange(64.0).reshape(8, 8) + offset, "count": jnp.array(int(offset), jnp.int32)}


def _truncate(step_dir: Path) -> None:
    victim = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])


DAMAGES = {
    "truncated": _truncate,
    "no_commit_metadata": lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
    "no_metadata_item": lambda d: shutil.rmtree(d / "metadata"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_step_is_moved_aside_and_can_be_saved_again(tmp_path, damage):
    """Before: the damaged step stayed, so saving it again failed with "already exists"."""
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step))
        ckpt.wait()
        DAMAGES[damage](tmp_path / "3")
        assert checkpoint_damage(tmp_path, 3) and good_steps(tmp_path) == [1, 2]
        with pytest.warns(CheckpointCorruptionWarning, match="step 3.*moved aside to 3.damaged"):
            step, state, _ = ckpt.restore(_state(0), quarantine=True)
        assert step == 2 and int(state["count"]) == 2
        assert committed_steps(tmp_path) == [1, 2]
        assert [p.name for p in damaged_checkpoints(tmp_path)] == ["3.damaged"]
        ckpt.save(3, _state(3))  # the step can be saved again
        ckpt.wait()
        assert ckpt.restore(_state(0))[0] == 3
        assert checkpoint_damage(tmp_path, 3) is None


def test_a_second_damage_of_the_same_step_gets_its_own_name(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for _round in range(2):
            ckpt.save(1, _state(1))
            ckpt.save(2, _state(2))
            ckpt.wait()
            _truncate(tmp_path / "2")
            with pytest.warns(CheckpointCorruptionWarning):
                ckpt.quarantine_damaged(ckpt.all_steps())
            shutil.rmtree(tmp_path / "1")
            ckpt._manager.reload()
    assert sorted(p.name for p in damaged_checkpoints(tmp_path)) == ["2.damaged", "2.damaged.1"]


def test_old_checksum_files_still_verify(tmp_path):
    """Checksum files written before sizes were recorded ({name: sha256}) are still checked."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait()
        recorded = json.loads((tmp_path / "1" / CHECKSUM_FILE).read_text())["files"]
        (tmp_path / "1" / CHECKSUM_FILE).write_text(
            json.dumps({name: v["sha256"] for name, v in recorded.items()}))
        assert checkpoint_damage(tmp_path, 1) is None
        ckpt.verify(1)
        _truncate(tmp_path / "1")
        assert checkpoint_damage(tmp_path, 1) is None  # no sizes: only the digests can tell
        with pytest.raises(Exception, match="changed since the save"):
            ckpt.verify(1)


TMPFS_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
import jax.numpy as jnp, numpy as np
from smelt_jax.train.checkpoint import Checkpointer, CheckpointSaveError
ckpt = Checkpointer({folder!r}, max_to_keep=5)
big = {{"w": jnp.asarray(np.random.default_rng(0).random((600, 600), np.float32))}}  # 1.4 MB
ckpt.save(1, {{"w": jnp.ones(4)}})
ckpt.wait()
ckpt.save(2, big)  # does not fit on the 1 MB tmpfs
start = time.monotonic()
while time.monotonic() - start < 60:
    try:
        ckpt.raise_if_save_failed()
    except CheckpointSaveError as err:
        print("STOPPED", f"{{time.monotonic() - start:.2f}}", err)
        ckpt.close()
        sys.exit(0)
    time.sleep(0.01)
print("NOT NOTICED")
sys.exit(1)
"""


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_failed_background_save_on_a_full_tmpfs_is_noticed_without_waiting(tmp_path):
    """A real ENOSPC: a 1 MB tmpfs in a private mount namespace. Before, the failure surfaced only at
    the next save (with dozens of tracebacks); now the next step boundary raises one message."""
    mount = tmp_path / "small"
    mount.mkdir()
    folder = mount / "checkpoints"
    script = tmp_path / "save.py"
    script.write_text(TMPFS_SCRIPT.format(repo=str(REPO), folder=str(folder)))
    shell = f"mount -t tmpfs -o size=1m none {mount} && exec {sys.executable} {script}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("STOPPED"))
    assert "step 2" in line and "No space left on device" in line
    assert "the run resumes from step 1 (" in line and f"{folder}/1)" in line
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    print(line[:200])


def test_clean_temporary_removes_what_a_failed_save_left(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait()
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp-99")
    with Checkpointer(tmp_path) as reader:  # a reader (a branch) leaves it alone
        assert reader.removed_temporary == []
    assert (tmp_path / "2.orbax-checkpoint-tmp-99").exists()
    with Checkpointer(tmp_path, clean_temporary=True) as writer:
        assert writer.removed_temporary == ["2.orbax-checkpoint-tmp-99"]
        assert writer.all_steps() == [1]
    assert not (tmp_path / "2.orbax-checkpoint-tmp-99").exists()
    np.testing.assert_array_equal(Checkpointer(tmp_path).restore(_state(0))[1]["w"], _state(1)["w"])


def _fail_next_save(ckpt: Checkpointer) -> None:
    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")
    ckpt._manager.save = full


def test_a_failed_save_names_the_step_the_run_really_resumes_from(tmp_path):
    """Before: "the newest good checkpoint is step 2, and the run resumes from it" although step 2 was
    damaged (the next run moves it aside and restores step 1)."""
    from smelt_jax.train.checkpoint import CheckpointSaveError
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step))
        ckpt.wait()
        _truncate(tmp_path / "2")
        _fail_next_save(ckpt)
        with pytest.raises(CheckpointSaveError) as failed:
            ckpt.save(3, _state(3))
    line = str(failed.value)
    assert "step 3" in line and "No space left on device" in line
    assert f"the run resumes from step 1 ({tmp_path / '1'}) once the cause is fixed" in line


def test_a_failed_save_with_no_checkpoint_says_the_phase_starts_again(tmp_path):
    """Before: "no checkpoint of this phase is committed yet, and the run resumes from it"."""
    from smelt_jax.train.checkpoint import CheckpointSaveError
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        _fail_next_save(ckpt)
        with pytest.raises(CheckpointSaveError) as failed:
            ckpt.save(1, _state(1))
    assert str(failed.value).endswith("no checkpoint of this phase is saved, so the run starts the phase again "
                                      "once the cause is fixed")

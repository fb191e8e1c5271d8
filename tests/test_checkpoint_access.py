"""Issue 27 item 2: a checkpoint that cannot be read for lack of access (permissions, credentials, a
storage error that persists) is not damage: restore stops with one line (CheckpointAccessError) and
moves nothing aside; transient errors are retried (3 times, 1 + 2 + 4 s); damage (missing, truncated,
changed files) is still moved aside as before.

How access errors are made while the tests run as root (where chmod 000 does not block reads):
- in process, the checksum reader's `open` is replaced by one raising PermissionError (what a chmod 000
  file gives a normal user), and orbax's restore by one raising tensorstore's PERMISSION_DENIED /
  UNAVAILABLE messages;
- in a real process (the issue's reproduction), files are chmod 000 and the trainer runs as root
  without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (`setpriv --bounding-set=-dac_override,...`), so
  the permission bits apply to it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from smelt_jax.run_files import checkpoint_format as fmt
from smelt_jax.run_files.checkpoint_format import (
    CheckpointAccessError,
    committed_steps,
    damaged_checkpoints,
    failure_kind,
)
from smelt_jax.train.checkpoint import CheckpointCorruptionWarning, Checkpointer

REPO = Path(__file__).resolve().parents[1]


def _state(offset: float) -> dict:
    return {"w": jnp.arange(64.0).reshape(8, 8) + offset, "count": jnp.array(int(offset), jnp.int32)}


@pytest.fixture
def saved(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step))
    return tmp_path


def _deny_state_files(monkeypatch):
    """Every file under a step's `state/` raises PermissionError when the checksum reader opens it."""
    real_open = open

    def guarded(path, *args, **kwargs):
        if "/state/" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(fmt, "open", guarded, raising=False)


def test_unreadable_files_stop_the_restore_and_move_nothing(saved, monkeypatch):
    _deny_state_files(monkeypatch)
    with Checkpointer(saved, max_to_keep=5) as ckpt:
        with pytest.raises(CheckpointAccessError) as err:
            ckpt.restore(_state(0), quarantine=True)
    line = str(err.value)
    assert "\n" not in line and "step 3" in line and "Permission denied" in line
    assert "nothing was moved aside" in line
    assert committed_steps(saved) == [1, 2, 3] and damaged_checkpoints(saved) == []


@pytest.mark.parametrize("message", [
    "PERMISSION_DENIED: Error opening file: /x/state/d/abc [source locations='...']",
    "UNAUTHENTICATED: Could not load Google application default credentials",
])
def test_storage_access_errors_from_the_reader_move_nothing(saved, monkeypatch, message):
    with Checkpointer(saved, max_to_keep=5) as ckpt:
        def denied(*_args, **_kwargs):
            raise ValueError(message)
        monkeypatch.setattr(ckpt._manager, "restore", denied)
        with pytest.raises(CheckpointAccessError, match=message.split(":")[0]):
            ckpt.restore(_state(0), quarantine=True)
    assert committed_steps(saved) == [1, 2, 3] and damaged_checkpoints(saved) == []


def test_transient_errors_are_retried_with_the_stated_delays(saved, monkeypatch):
    sleeps = []
    monkeypatch.setattr(fmt.time, "sleep", sleeps.append)
    with Checkpointer(saved, max_to_keep=5) as ckpt:
        real, calls = ckpt._manager.restore, []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) <= 2:
                raise ValueError("UNAVAILABLE: 503 Service Unavailable (retry later)")
            return real(*args, **kwargs)
        monkeypatch.setattr(ckpt._manager, "restore", flaky)
        step, state, _ = ckpt.restore(_state(0), quarantine=True)
    assert step == 3 and int(state["count"]) == 3
    assert sleeps == [1.0, 2.0] and len(calls) == 3
    assert damaged_checkpoints(saved) == []


def test_a_transient_error_that_persists_is_an_access_error_after_the_bound(saved, monkeypatch):
    sleeps = []
    monkeypatch.setattr(fmt.time, "sleep", sleeps.append)
    with Checkpointer(saved, max_to_keep=5) as ckpt:
        def down(*_args, **_kwargs):
            raise TimeoutError("timed out reading gs://b/x")
        monkeypatch.setattr(ckpt._manager, "restore", down)
        with pytest.raises(CheckpointAccessError, match="after 4 tries"):
            ckpt.restore(_state(0), quarantine=True)
    assert sleeps == list(fmt.RETRY_DELAYS) and sum(sleeps) == 7.0
    assert committed_steps(saved) == [1, 2, 3] and damaged_checkpoints(saved) == []


def test_damage_is_still_moved_aside(saved):
    victim = max((p for p in (saved / "3" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with Checkpointer(saved, max_to_keep=5) as ckpt:
        with pytest.warns(CheckpointCorruptionWarning, match="moved aside"):
            step, _, _ = ckpt.restore(_state(0), quarantine=True)
    assert step == 2 and [p.name for p in damaged_checkpoints(saved)] == ["3.damaged"]


def test_a_folder_that_cannot_be_listed_is_not_damage(saved, monkeypatch):
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if "/state/" in str(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)
    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(CheckpointAccessError):
        fmt.checkpoint_damage(saved, 3)


@pytest.mark.parametrize("err,kind", [
    (PermissionError(13, "Permission denied"), "access"),
    (OSError(1, "Operation not permitted"), "access"),
    (FileNotFoundError(2, "No such file"), "integrity"),
    (ValueError("DATA_LOSS: Error reading chunk"), "integrity"),
    (ValueError("NOT_FOUND: Error opening file"), "integrity"),
    (ValueError("PERMISSION_DENIED: open failed"), "access"),
    (ValueError("UNAVAILABLE: connection dropped"), "transient"),
    (ValueError("DEADLINE_EXCEEDED"), "transient"),
    (ConnectionResetError(104, "Connection reset by peer"), "transient"),
    (RuntimeError("anything else"), "integrity"),
])
def test_failure_kinds(err, kind):
    assert failure_kind(err) == kind
    wrapped = RuntimeError("restore failed")
    wrapped.__cause__ = err
    assert failure_kind(wrapped) == kind  # read from the exception chain


# The reproduction in a real process ----------------------------------------------------------

TRAIN = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from smelt_jax.data.token_store import TokenStore
from smelt_jax.platform.errors import SmeltError
from smelt_jax.train.trainer import train
from tests.test_trainer import OPTIONS, _run
try:
    print(train(_run(), root=Path({root!r}), corpus=TokenStore({corpus!r}), options=OPTIONS)["status"])
except SmeltError as err:
    print(f"smelt: error: {{err}}", file=sys.stderr)
    sys.exit(2)
"""


def _setpriv_works() -> bool:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "true"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.integration
@pytest.mark.skipif(not _setpriv_works(), reason="needs root and setpriv to drop CAP_DAC_OVERRIDE")
def test_unreadable_checkpoint_files_stop_smelt_train_and_discard_nothing(tmp_path):
    """Before: steps 40, 35 and 20 were called damaged, moved aside, and the run retrained from 0."""
    from smelt_jax.run_files.rundir import run_dir
    from smelt_jax.train.trainer import Preempted, TrainOptions, train
    from tests.data_helpers import build_tiny_corpus
    from tests.test_trainer import OPTIONS, _run

    corpus = build_tiny_corpus(tmp_path / "corpus")
    run = _run()
    root = tmp_path / "runs"
    with pytest.raises(Preempted):
        train(run, root=root, corpus=corpus,
              options=TrainOptions(**{**OPTIONS.__dict__, "stop_after": 9}))
    folder = run_dir(run.suite, run.id, root).checkpoints(None)
    steps = committed_steps(folder)
    assert len(steps) >= 2
    locked = []
    for step in steps:  # one file per step made unreadable
        victim = max((p for p in (folder / str(step) / "state").rglob("*") if p.is_file()),
                     key=lambda p: p.stat().st_size)
        victim.chmod(0)
        locked.append(victim)
    metrics = run_dir(run.suite, run.id, root).metrics(None)
    logged = metrics.read_text()
    script = TRAIN.format(repo=str(REPO), root=str(root), corpus=str(corpus.root))
    command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", script]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [x for x in result.stderr.splitlines() if x.startswith("smelt:")]
    assert len(lines) == 1 and "Permission denied" in lines[0] and "nothing was moved" in lines[0]
    assert committed_steps(folder) == steps and damaged_checkpoints(folder) == []
    assert metrics.read_text() == logged  # nothing retrained
    assert not (folder.parent / "trainer.lock").exists()
    for victim in locked:
        victim.chmod(0o644)
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [json.loads(x)["step"] for x in metrics.read_text()[len(logged):].splitlines()]
    assert resumed[0] == steps[-1] + 1  # resumed from the newest step, not from 0

"""Issue 15 on the tiny trainer: a damaged checkpoint never blocks a run, a failed save stops at once,
cumulative tokens and line-atomic metrics. Each test reproduces the failure the issue reports."""

from __future__ import annotations

import errno
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from smelt_jax.run_files.checkpoint_format import committed_steps, temporary_checkpoints
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.sweep.graph import JobStatus, artifact_statuses, build_graph
from smelt_jax.train.checkpoint import CheckpointSaveError
from smelt_jax.train.metrics_log import TornLineWarning, read_metrics
from smelt_jax.train.trainer import ForkCheckpointDamaged, TrainOptions, train
from tests.test_trainer import OPTIONS, SCHEDULE, _params, _run, corpus  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):  # noqa: F811
    """One undamaged stable run (checkpoints 6, 8, 12): copied, then damaged, by each test."""
    root = tmp_path_factory.mktemp("reference")
    train(_run(), root=root, corpus=corpus, options=OPTIONS)
    return root


def _copy(reference: Path, tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    shutil.copytree(reference, root)
    return root


def _truncate_biggest(step_dir: Path) -> None:
    biggest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


DAMAGES = {
    "truncated": _truncate_biggest,
    "no_commit_metadata": lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
    "no_metadata_item": lambda d: shutil.rmtree(d / "metadata"),
}


def _assert_same_params(a, b) -> None:
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes(
        tmp_path, corpus, reference, damage):  # noqa: F811
    """Issue item 1: the rerun used to retrain to 12 and die on "Checkpoint for step 12 already
    exists", on every rerun. Now the step is moved aside, retrained bit-identically, and the branch
    forking there trains."""
    run = _run()
    root = _copy(reference, tmp_path)
    ckpt_dir = run_dir(run.suite, run.id, root).checkpoints(None)
    DAMAGES[damage](ckpt_dir / "12")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(run, root=root, corpus=corpus, options=OPTIONS)
    assert summary["status"] == "done" and summary["step"] == 12
    assert any("step 12" in str(w.message) and "moved aside" in str(w.message) for w in caught)
    assert (ckpt_dir / "12.damaged").is_dir()  # kept, never deleted
    assert 12 in committed_steps(ckpt_dir)
    _assert_same_params(_params(root, run, 12), _params(reference, run, 12))
    # a rerun is a no-op, and the branch forking at 12 trains
    assert train(run, root=root, corpus=corpus, options=OPTIONS)["status"] == "done"
    assert train(run, branch=1, root=root, corpus=corpus, options=OPTIONS)["status"] == "done"
    assert run_dir(run.suite, run.id, root).endpoint(1).exists()


def test_damaged_fork_checkpoint_is_not_ready_and_the_stable_job_retrains_it(
        tmp_path, corpus, reference):  # noqa: F811
    """Issue item 1: the sweep counted the job done and `--branch` died with a CheckpointError
    traceback. Now: the stable job is DAMAGED (runnable), the branch PENDING, the branch trainer says
    one line, and the stable trainer retrains the fork step (only it) bit-identically."""
    run = _run()
    root = _copy(reference, tmp_path)
    ckpt_dir = run_dir(run.suite, run.id, root).checkpoints(None)
    _truncate_biggest(ckpt_dir / "6")
    graph = build_graph([run])
    stable, b0, b1 = graph.jobs
    statuses = artifact_statuses(graph, root)
    assert statuses[stable.name] == JobStatus.DAMAGED and statuses[stable.name].runnable
    assert statuses[b0.name] == JobStatus.PENDING and statuses[b1.name] == JobStatus.READY
    with pytest.raises(ForkCheckpointDamaged, match=r"step 6.*damaged.*smelt train") as err:
        train(run, branch=0, root=root, corpus=corpus, options=OPTIONS)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)  # the CLI's one line and exit 2
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert train(run, root=root, corpus=corpus, options=OPTIONS)["status"] == "done"
    assert (ckpt_dir / "6.damaged").is_dir() and {6, 12} <= set(committed_steps(ckpt_dir))
    _assert_same_params(_params(root, run, 6), _params(reference, run, 6))
    _assert_same_params(_params(root, run, 12), _params(reference, run, 12))
    statuses = artifact_statuses(graph, root)
    assert statuses[stable.name] == JobStatus.DONE and statuses[b0.name] == JobStatus.READY


def test_failed_async_save_stops_training_at_once(tmp_path, corpus, monkeypatch):  # noqa: F811
    """Issue item 2 on a fake full filesystem: the background commit of step 4 fails with ENOSPC.
    Training used to go on to the next save (and exit with dozens of tracebacks); now it stops before
    that, with one message naming the step, the cause and what is still good; the next start removes
    the temporary folder and finishes."""
    from orbax.checkpoint._src.path import async_path

    run = _run()
    original = async_path.write_text

    async def full_disk(path, *args, **kwargs):
        if "/4.orbax-checkpoint-tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return await original(path, *args, **kwargs)

    monkeypatch.setattr(async_path, "write_text", full_disk)
    options = TrainOptions(**{**OPTIONS.__dict__, "checkpoint_every": 4})
    with pytest.raises(CheckpointSaveError) as err:
        train(run, root=tmp_path, corpus=corpus, options=options)
    message = str(err.value)
    assert "step 4" in message and "No space left" in message and "no checkpoint" in message
    assert "\n" not in message
    rd = run_dir(run.suite, run.id, tmp_path)
    logged = [r["step"] for r in read_metrics(rd.metrics(None)) if "loss" in r]
    assert max(logged) < 8, logged  # stopped before the next save, not at it
    assert committed_steps(rd.checkpoints(None)) == []
    assert temporary_checkpoints(rd.checkpoints(None))  # left by the failed save ...
    monkeypatch.setattr(async_path, "write_text", original)
    assert train(run, root=tmp_path, corpus=corpus, options=options)["status"] == "done"
    assert temporary_checkpoints(rd.checkpoints(None)) == []  # ... and removed on the next start
    assert 12 in committed_steps(rd.checkpoints(None))


def test_metrics_tokens_are_cumulative_and_a_torn_line_is_skipped(tmp_path, corpus):  # noqa: F811
    """Issue items 5 and 7: `tokens` was the per-step count (2047, 2047, 2048, ...) and a torn last
    line swallowed the next record."""
    run = _run()
    with pytest.raises(Exception, match="stopped at step 5"):
        train(run, root=tmp_path, corpus=corpus, options=TrainOptions(**{**OPTIONS.__dict__,
                                                                          "stop_after": 5}))
    metrics = run_dir(run.suite, run.id, tmp_path).metrics(None)
    with open(metrics, "ab") as handle:
        handle.write(b'{"step": 99, "lo\xff\xfe')  # a torn line: no newline, not UTF-8
    train(run, root=tmp_path, corpus=corpus, options=OPTIONS)
    with pytest.warns(TornLineWarning, match="skipped 1"):
        records = read_metrics(metrics)
    train_records = [r for r in records if "loss" in r]
    assert train_records[-1]["step"] == SCHEDULE.stable_steps  # the record after the tear survives
    for record in train_records:
        assert record["tokens"] == record["step"] * SCHEDULE.tokens_per_step
        assert 0 < record["step_tokens"] <= SCHEDULE.tokens_per_step
    assert [r["step"] for r in train_records].count(5) == 1  # resumed from 5: nothing logged twice

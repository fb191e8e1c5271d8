"""Issue 27 item 3: one SIGTERM handler from the start of `train` to its end. A real process receives
SIGTERM while it restores, while its first step compiles, and during a branch's final evaluation;
each time it exits 42 after releasing the lock, having saved only when a step advanced since the last
save, and a restart finishes the phase. Before, outside the step loop the process died with 143, no
message and the lock left behind.

The signal is sent by the process to itself (`os.kill`) from inside the named operation (a wrapper
around the restore, the first call of the jitted train step, the validation batches), so each case
hits its point every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smelt_jax.run_files.checkpoint_format import committed_steps
from smelt_jax.platform.exit_codes import PREEMPTED
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.train.lock import LOCK_NAME
from smelt_jax.train.trainer import Preempted, TrainOptions, train
from tests.data_helpers import build_tiny_corpus
from tests.test_trainer import OPTIONS, _run

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from smelt_jax.data import pipeline
from smelt_jax.data.token_store import TokenStore
from smelt_jax.platform.exit_codes import PREEMPTED
from smelt_jax.train import checkpoint, state, trainer
from tests.test_trainer import OPTIONS, _run

point = {point!r}


def kill():
    os.kill(os.getpid(), signal.SIGTERM)


if point == "restore":
    restore_state = checkpoint.Checkpointer.restore_state

    def restoring(self, *args, **kwargs):
        kill()
        return restore_state(self, *args, **kwargs)
    checkpoint.Checkpointer.restore_state = restoring
elif point == "compile":
    jit_train_step = state.jit_train_step

    def jitting(*args, **kwargs):
        step, calls = jit_train_step(*args, **kwargs), []

        def first_call_compiles(*step_args):
            if not calls:
                calls.append(1)
                kill()
            return step(*step_args)
        return first_call_compiles
    state.jit_train_step = jitting
elif point == "evaluate":
    validation_sets = pipeline.validation_sets

    def validating(*args, **kwargs):
        kill()
        return validation_sets(*args, **kwargs)
    pipeline.validation_sets = validating
try:
    summary = trainer.train(_run(), {branch!r}, root=Path({root!r}), corpus=TokenStore({corpus!r}),
                            options=OPTIONS)
except trainer.Preempted as err:
    print("PREEMPTED", err)
    sys.exit(PREEMPTED)
print("DONE", summary["status"])
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _child(point: str | None, root: Path, corpus, branch: int | None = None):
    script = CHILD.format(repo=str(REPO), point=point, branch=branch, root=str(root),
                          corpus=str(corpus.root))
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _no_lock(root: Path) -> bool:
    return not list(root.rglob(LOCK_NAME))


@pytest.mark.integration
def test_sigterm_during_restore_exits_42_saves_nothing_and_releases_the_lock(tmp_path, corpus):
    run = _run()
    with pytest.raises(Preempted):
        train(run, root=tmp_path, corpus=corpus,
              options=TrainOptions(**{**OPTIONS.__dict__, "stop_after": 5}))
    folder = run_dir(run.suite, run.id, tmp_path).checkpoints(None)
    before, metrics = committed_steps(folder), run_dir(run.suite, run.id, tmp_path).metrics(None)
    logged = metrics.read_text()
    result = _child("restore", tmp_path, corpus)
    assert result.returncode == PREEMPTED, result.stdout[-2000:] + result.stderr[-3000:]
    assert "stopped by signal" in result.stdout and "after restoring" in result.stdout
    assert committed_steps(folder) == before and metrics.read_text() == logged  # no step advanced
    assert _no_lock(tmp_path)
    again = _child(None, tmp_path, corpus)
    assert again.returncode == 0 and "DONE" in again.stdout, again.stderr[-3000:]


@pytest.mark.integration
def test_sigterm_during_the_first_compile_saves_the_step_and_exits_42(tmp_path, corpus):
    run = _run()
    result = _child("compile", tmp_path, corpus)
    assert result.returncode == PREEMPTED, result.stdout[-2000:] + result.stderr[-3000:]
    assert "stopped at step 1 after saving" in result.stdout and "stable" in result.stdout
    assert committed_steps(run_dir(run.suite, run.id, tmp_path).checkpoints(None)) == [1]
    assert _no_lock(tmp_path)


@pytest.mark.integration
def test_sigterm_during_the_final_evaluation_exits_42_then_the_branch_finishes(tmp_path, corpus):
    run = _run()
    train(run, root=tmp_path, corpus=corpus, options=OPTIONS)  # the stable run, with its fork steps
    rd = run_dir(run.suite, run.id, tmp_path)
    result = _child("evaluate", tmp_path, corpus, branch=0)
    assert result.returncode == PREEMPTED, result.stdout[-2000:] + result.stderr[-3000:]
    assert "branch 0" in result.stdout and "during the final evaluation" in result.stdout
    end = run.schedule.fork_steps[0] + run.schedule.decay_steps
    assert end in committed_steps(rd.checkpoints(0))  # the last step was saved before evaluating
    assert not rd.endpoint(0).exists() and _no_lock(tmp_path)
    again = _child(None, tmp_path, corpus, branch=0)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(rd.endpoint(0).read_text())["branch"] == 0

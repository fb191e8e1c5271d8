"""The training loop on a tiny config and a tiny corpus: determinism, resume, NaN guard, endpoints."""

import json
import warnings

import jax
import numpy as np
import pytest

from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.data.pipeline import TrainPipeline
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files.results import read_results
from smelt_jax.run_files.checkpoint_format import committed_steps
from smelt_jax.run_files.rundir import results_dir, run_dir
from smelt_jax.train.checkpoint import Checkpointer
from smelt_jax.train.trainer import NonFiniteLoss, Preempted, TrainOptions, train
from tests.data_helpers import build_tiny_corpus

MODEL = ModelConfig(vocab=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                    n_experts=4, top_k=2, expert_ffn=32, loop_start=1, loop_length=1,
                    loop_repeats=2, seq_len=32, capacity_factor=2.0)
SCHEDULE = Schedule(batch_size=4, seq_len=32, stable_steps=12, fork_steps=(6, 12), decay_steps=4,
                    warmup_steps=2, peak_lr=3e-3)
OPTIONS = TrainOptions(log_every=1, checkpoint_every=4, eval_tokens=256, eval_batch_size=4,
                       progress=False, peak_flops=1e12, devices=1)  # one device: sharding is not the subject


def _run(**changes) -> RunSpec:
    model = MODEL.replace(**changes)
    return RunSpec(suite="unit", scale="tiny", sparsity_label="s50", arch="smelt", model=model,
                   schedule=SCHEDULE, control=model.replace(n_experts=2), pair_id="unit-tiny")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _losses(root, run, branch=None):
    lines = run_dir(run.suite, run.id, root).metrics(branch).read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def _params(root, run, step, branch=None):
    with Checkpointer(run_dir(run.suite, run.id, root).checkpoints(branch)) as ckpt:
        from smelt_jax.train.state import init_params
        from smelt_jax.train.step import optimizer
        _, params = init_params(run.model, 0)
        state = {"params": params, "opt_state": optimizer(run.schedule).init(params)}
        _, restored, _ = ckpt.restore(state, step=step)
    return jax.tree.leaves(restored["params"])


def test_same_seed_same_losses_and_loss_decreases(tmp_path, corpus):
    run = _run()
    cache = jax.config.jax_compilation_cache_dir
    for name in ("a", "b"):
        train(run, root=tmp_path / name, corpus=corpus, options=OPTIONS)
    assert jax.config.jax_compilation_cache_dir == cache  # the trainer sets no global JAX configuration
    first, second = _losses(tmp_path / "a", run), _losses(tmp_path / "b", run)
    assert len(first) == SCHEDULE.stable_steps
    assert first == second
    assert np.mean(first[-3:]) < first[0] - 0.2


def test_interrupted_and_resumed_is_bit_identical(tmp_path, corpus):
    run = _run()
    train(run, root=tmp_path / "whole", corpus=corpus, options=OPTIONS)
    with pytest.raises(Preempted, match="stopped at step 5"):
        train(run, root=tmp_path / "cut", corpus=corpus,
              options=TrainOptions(**{**OPTIONS.__dict__, "stop_after": 5}))
    assert 5 in committed_steps(run_dir(run.suite, run.id, tmp_path / "cut").checkpoints(None))
    train(run, root=tmp_path / "cut", corpus=corpus, options=OPTIONS)
    whole, cut = _params(tmp_path / "whole", run, 12), _params(tmp_path / "cut", run, 12)
    for a, b in zip(whole, cut):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # fork checkpoints are kept for good despite rotation (max_to_keep=2)
    steps = committed_steps(run_dir(run.suite, run.id, tmp_path / "whole").checkpoints(None))
    assert {6, 12} <= set(steps)


def test_branch_needs_the_fork_checkpoint_then_writes_an_endpoint(tmp_path, corpus):
    run = _run()
    with pytest.raises(ValueError, match="no committed checkpoint"):
        train(run, branch=0, root=tmp_path, corpus=corpus, options=OPTIONS)
    train(run, root=tmp_path, corpus=corpus, options=OPTIONS)
    summary = train(run, branch=0, root=tmp_path, corpus=corpus, options=OPTIONS)
    rd = run_dir(run.suite, run.id, tmp_path)
    row = json.loads(rd.endpoint(0).read_text())
    assert row["tokens"] == (6 + 4) * SCHEDULE.tokens_per_step
    assert row["val_loss"] == pytest.approx(summary["val_loss"])
    table = read_results(results_dir(run.suite, tmp_path))
    assert list(table["run_id"]) == [run.id] and list(table["branch"]) == [0]
    assert {"loss_code", "loss_words", "loss_tables"} <= set(table.columns)
    # the branch's learning rate decays from the fork
    lrs = [json.loads(line)["lr"] for line in rd.metrics(0).read_text().splitlines() if '"lr"' in line]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == pytest.approx(0.0, abs=1e-9)
    # a second call finds the endpoint and does nothing
    assert train(run, branch=0, root=tmp_path, corpus=corpus, options=OPTIONS)["status"] == "done"


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    run = _run()
    original = TrainPipeline.batch_at

    def poisoned(self, step):
        batch = original(self, step)
        if step >= 9:
            batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
        return batch

    monkeypatch.setattr(TrainPipeline, "batch_at", poisoned)
    with pytest.raises(NonFiniteLoss, match="non-finite loss"):
        train(run, root=tmp_path, corpus=corpus, options=OPTIONS)
    steps = committed_steps(run_dir(run.suite, run.id, tmp_path).checkpoints(None))
    assert max(steps) == 8  # the step-8 checkpoint predates the poison; nothing saved after it


def test_truncated_checkpoint_is_skipped_on_resume(tmp_path, corpus):
    run = _run()
    with pytest.raises(Preempted):
        train(run, root=tmp_path, corpus=corpus,
              options=TrainOptions(**{**OPTIONS.__dict__, "stop_after": 5}))
    ckpt_dir = run_dir(run.suite, run.id, tmp_path).checkpoints(None)
    assert committed_steps(ckpt_dir) == [4, 5]
    biggest = max((p for p in (ckpt_dir / "5").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(run, root=tmp_path, corpus=corpus, options=OPTIONS)
    assert any("step 5" in str(w.message) for w in caught)
    lines = [json.loads(x) for x in run_dir(run.suite, run.id, tmp_path).metrics(None)
             .read_text().splitlines()]
    # resumed from step 4: steps 5.. were logged twice, once before and once after the resume
    assert [x["step"] for x in lines].count(5) == 2


SIGTERM_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from smelt_jax.platform.exit_codes import PREEMPTED
from smelt_jax.train.trainer import Preempted, TrainOptions, train
from smelt_jax.data.token_store import TokenStore
from tests.test_trainer import OPTIONS, _run
import dataclasses
run = _run().__class__(**{{**_run().__dict__, "schedule": _run().schedule.replace(
    stable_steps=400, fork_steps=(400,))}})
try:
    train(run, root=Path({root!r}), corpus=TokenStore({corpus!r}),
          options=dataclasses.replace(OPTIONS, checkpoint_every=1000))
except Preempted:
    sys.exit(PREEMPTED)
"""


@pytest.mark.integration  # real processes
def test_sigterm_saves_and_exits_42(tmp_path, corpus):
    """A real process: SIGTERM mid-run -> a checkpoint at the current step and exit code 42."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    script = SIGTERM_SCRIPT.format(repo=repo, root=str(tmp_path), corpus=str(corpus.root))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=repo, env={**os.environ},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = None
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        found = list(tmp_path.glob("unit/*/stable/metrics.jsonl"))
        if found and found[0].read_text().count("\n") >= 3:  # training is under way
            metrics = found[0]
            break
        time.sleep(0.2)
    assert metrics is not None, proc.communicate()[0][-2000:]
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 42, output[-2000:]
    steps = committed_steps(metrics.parent / "checkpoints")
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert len(steps) == 1 and steps[0] >= 3 and steps[0] < 400  # saved where it stopped, not at a schedule point
    assert steps[0] == max(logged)

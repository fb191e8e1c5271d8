"""Two local processes (jax.distributed on localhost, 2 fake CPU devices each) train a micro config
with the same losses as one process; their checkpoint restores onto one process with another mesh."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from smelt_jax.parallel import sharding
from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.train.trainer import TrainOptions

MODEL = ModelConfig(vocab=512, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16,
                    n_experts=4, top_k=2, expert_ffn=16, loop_start=1, loop_length=1,
                    loop_repeats=2, seq_len=32)
SCHEDULE = Schedule(batch_size=8, seq_len=32, stable_steps=4, fork_steps=(4,), decay_steps=1,
                    warmup_steps=1, peak_lr=3e-3)
OPTIONS = TrainOptions(log_every=1, checkpoint_every=4, eval_tokens=256, eval_batch_size=4,
                       progress=False, peak_flops=1e12)
REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.integration  # two real processes: `make test-integration`


def micro_run() -> RunSpec:
    return RunSpec(suite="unit", scale="mh", sparsity_label="s50", arch="smelt", model=MODEL,
                   schedule=SCHEDULE, control=MODEL.replace(n_experts=2), pair_id="unit-mh")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _losses(root):
    lines = run_dir("unit", micro_run().id, root).metrics(None).read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def test_two_processes_train_like_one_and_their_checkpoint_restores_elsewhere(tmp_path):
    from smelt_jax.train.trainer import train
    from tests.data_helpers import build_tiny_corpus
    corpus = build_tiny_corpus(tmp_path / "corpus")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SMELT_XLA_CACHE": str(tmp_path / "xla")}
    env.pop("XLA_FLAGS", None)
    # data 2 x fsdp 2: the batch and the FSDP shards both span the two processes.
    workers = [subprocess.Popen([sys.executable, str(REPO / "tests" / "parallel_multihost_worker.py"),
                                 str(port), str(i), str(corpus.root), str(tmp_path / "multi"),
                                 "data=2,fsdp=2"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output[-3000:]
    single = train(micro_run(), root=tmp_path / "single", corpus=corpus, options=OPTIONS,
                   parallelism=Parallelism(data=2, fsdp=2, expert=2))
    assert single["status"] == "done"
    multi, one = _losses(tmp_path / "multi"), _losses(tmp_path / "single")
    assert len(multi) == len(one) == SCHEDULE.stable_steps
    np.testing.assert_allclose(multi, one, rtol=2e-5)

    # The two-process checkpoint restores onto this single process, on an 8-device mesh.
    from smelt_jax.train import state as train_state
    from smelt_jax.train.checkpoint import Checkpointer
    from smelt_jax.train.step import optimizer
    tx = optimizer(SCHEDULE)
    mesh = sharding.make_mesh(Parallelism(data=2, fsdp=4))
    plan = train_state.plan_training(MODEL, tx, mesh)
    params, opt_state = plan.abstract_state()
    target = {"params": params, "opt_state": opt_state}
    with Checkpointer(run_dir("unit", micro_run().id, tmp_path / "multi").checkpoints(None)) as ckpt:
        step, restored, _ = ckpt.restore(target, step=4)
    with Checkpointer(run_dir("unit", micro_run().id, tmp_path / "single").checkpoints(None)) as ckpt:
        _, reference, _ = ckpt.restore(target, step=4)
    assert step == 4
    w_gate = restored["params"]["loop"]["moe"]["w_gate"].get_value()
    assert w_gate.sharding.mesh.size == 8 and "fsdp" in str(w_gate.sharding.spec)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)

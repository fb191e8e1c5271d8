"""Meshes from a Parallelism, placement by the rules table, and a sharded train step that matches one
device (loss and gradients) on several data x fsdp x expert (x tensor) layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from smelt_jax.parallel import sharding
from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.train import state as train_state
from smelt_jax.train.step import optimizer

# Small enough to compile in seconds; a loop (two visits) and a real MoE (4 experts, top-2).
MICRO = ModelConfig(vocab=128, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16,
                    n_experts=4, top_k=2, expert_ffn=16, loop_start=1, loop_length=1,
                    loop_repeats=2, seq_len=32)
BATCH, SEQ = 8, 32


def test_mesh_shape_fills_the_rest_and_rejects_bad_layouts():
    assert sharding.mesh_shape(Parallelism(), 8) == (8, 1, 1, 1)
    assert sharding.mesh_shape(Parallelism(data=2, fsdp=-1, expert=2), 8) == (2, 2, 2, 1)
    assert sharding.mesh_shape(Parallelism(data=1, fsdp=2, expert=2, tensor=2), 8) == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="at most one"):
        sharding.mesh_shape(Parallelism(data=-1, fsdp=-1), 8)
    with pytest.raises(ValueError, match="do not divide"):
        sharding.mesh_shape(Parallelism(data=-1, expert=3), 8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.mesh_shape(Parallelism(data=2, fsdp=2), 8)


def test_make_mesh_uses_auto_axes_over_the_given_devices():
    mesh = sharding.make_mesh(Parallelism(data=2, fsdp=2, expert=-1))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
    assert sharding.make_mesh(Parallelism(), jax.devices()[:1]).size == 1


def test_fit_spec_drops_axes_that_do_not_divide():
    mesh = sharding.make_mesh(Parallelism(data=2, fsdp=4))
    assert sharding.fit_spec(P(("data", "fsdp"), None), (8, 3), mesh) == P(("data", "fsdp"), None)
    assert sharding.fit_spec(P(("data", "fsdp"), None), (6, 3), mesh) == P("data", None)
    assert sharding.fit_spec(P("fsdp", "data"), (6, 3), mesh) == P(None, None)
    assert sharding.fit_spec(P("expert"), (5,), mesh) == P(None)  # expert axis has size 1


def test_optimizer_state_is_placed_like_its_parameters_and_counts_replicated():
    mesh = sharding.make_mesh(Parallelism(data=2, fsdp=2, expert=2))
    tx = optimizer(Schedule(batch_size=BATCH, seq_len=SEQ, stable_steps=4, fork_steps=(4,),
                            decay_steps=1, warmup_steps=1, peak_lr=1e-3))
    plan = train_state.plan_training(MICRO, tx, mesh)
    w_gate = plan.params_shardings["loop"]["moe"]["w_gate"].get_value()
    assert w_gate.spec == P(None, "expert", "fsdp", None)  # mlp->tensor dropped: tensor has size 1
    specs = {str(s.spec) for s in jax.tree.leaves(plan.opt_shardings)}
    assert str(w_gate.spec) in specs and str(P()) in specs
    adam = plan.opt_shardings[1]  # chain: (clip, adam, weight decay)
    assert adam.mu["loop"]["moe"]["w_gate"].get_value() == w_gate
    assert adam.count.spec == P()


def _capture_grads() -> optax.GradientTransformation:
    """An 'optimizer' whose state is the last gradient and whose update is zero: one sharded step
    then returns exactly the gradients, placed like the parameters."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), updates))


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, MICRO.vocab, (BATCH, SEQ))
    segments = np.ones((BATCH, SEQ), np.int32)
    segments[1, 20:] = 2  # a packed second document
    segments[3, 28:] = 0  # padding
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": segments,
            "positions": np.tile(np.arange(SEQ), (BATCH, 1)), "loss_mask": (segments > 0) * 1.0}


def _loss_and_grads(parallelism: Parallelism, devices):
    tx = _capture_grads()
    mesh = sharding.make_mesh(parallelism, devices)
    plan = train_state.plan_training(MICRO, tx, mesh)
    params, opt_state = train_state.init_state(plan, tx, seed=3)
    step = train_state.jit_train_step(plan, tx, BATCH, SEQ)
    with jax.set_mesh(mesh):
        _, grads, metrics = step(params, opt_state, train_state.global_batch(plan, _batch(), BATCH),
                                 jnp.float32(1.0))
    return metrics, grads, plan


@pytest.fixture(scope="module")
def one_device():
    return _loss_and_grads(Parallelism(), jax.devices()[:1])


@pytest.mark.parametrize("layout", [{"data": 2, "fsdp": 2, "expert": 2}, {"data": 1, "fsdp": 4, "expert": 2},
                                    pytest.param({"data": 2, "fsdp": 1, "expert": 2, "tensor": 2},
                                                 marks=pytest.mark.slow)],
                         ids=["d2f2e2", "f4e2", "d2e2t2"])
def test_sharded_train_step_matches_one_device(one_device, layout):
    ref_metrics, ref_grads, _ = one_device
    metrics, grads, plan = _loss_and_grads(Parallelism(**layout), jax.devices())
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=2e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert [p for p, _ in flat] == [p for p, _ in flat_ref]
    for (path, g), (_, g_ref) in zip(flat, flat_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=2e-4, atol=2e-7,
                                   err_msg=jax.tree_util.keystr(path))
    # The gradients come back placed like the parameters (really sharded, not gathered).
    w_gate = grads["loop"]["moe"]["w_gate"].get_value()
    assert w_gate.sharding.is_equivalent_to(
        plan.params_shardings["loop"]["moe"]["w_gate"].get_value(), w_gate.ndim)
    assert w_gate.addressable_shards[0].data.shape[1] == MICRO.n_experts // layout["expert"]


def test_sharded_init_equals_the_unsharded_init():
    from smelt_jax.train.state import init_params
    tx = _capture_grads()
    mesh = sharding.make_mesh(Parallelism(data=2, fsdp=2, expert=2))
    plan = train_state.plan_training(MICRO, tx, mesh)
    params, _ = train_state.init_state(plan, tx, seed=5)
    _, reference = init_params(MICRO, 5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

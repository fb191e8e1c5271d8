"""The expert-parallel MoE (shard_map + all_to_all over `expert`) against the unsharded MoE layer:
outputs, statistics and gradients, on random routing, an empty expert, every token on the same
experts, odd token counts and capacity drops."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax import sharding
from smelt_jax.config import ModelConfig
from smelt_jax.descriptors import Parallelism
from smelt_jax.model.moe import MoE
from smelt_jax.parallel.expert_parallel import expert_parallel_moe, kept_copies

CFG = ModelConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  n_experts=8, top_k=2, expert_ffn=12, seq_len=16, expert_impl="capacity")


def _layer(cfg, routing: str):
    moe = MoE(cfg, rngs=nnx.Rngs(1))
    w = np.asarray(moe.router.weight[...]).copy()
    if routing == "empty_expert":  # feature 0 is a constant 1 in the inputs; expert 5 never wins
        w[0, 5] = -50.0
    elif routing == "one_expert":  # constant logits: every token picks experts 2 and 6
        w[:] = 0.0
        w[0, 2], w[0, 6] = 10.0, 9.0
    moe.router.weight[...] = jnp.asarray(w)
    return nnx.split(moe)


def _inputs(b, s, routing):
    rng = np.random.default_rng(b * 100 + s)
    x = rng.normal(size=(b, s, CFG.d_model)).astype(np.float32)
    x[..., 0] = 1.0 if routing != "random" else x[..., 0]
    mask = np.ones((b, s), bool)
    mask[-1, -1] = False  # one padding token
    return jnp.asarray(x), jnp.asarray(mask), jnp.asarray(rng.normal(size=x.shape).astype(np.float32))


def _objective(y, stats, cotangent):
    return jnp.sum(y * cotangent) + stats["load_balance_loss"] + 0.1 * stats["router_z_loss"]


@pytest.mark.parametrize("layout,b,s,routing,capacity_factor", [
    pytest.param({"data": 2, "expert": 4}, 4, 8, "random", None, marks=pytest.mark.slow),
    ({"data": 1, "expert": 8}, 3, 5, "random", None),  # 15 tokens over 8 shards
    ({"data": 2, "fsdp": 2, "expert": 2}, 2, 7, "empty_expert", None),
    ({"data": 1, "expert": 4, "tensor": 2}, 2, 8, "one_expert", None),
    ({"data": 2, "expert": 4}, 4, 8, "random", 1.0),  # capacity drops, as the unsharded layer drops
])
def test_expert_parallel_moe_matches_the_unsharded_layer(layout, b, s, routing, capacity_factor):
    cfg = dataclasses.replace(CFG, capacity_factor=capacity_factor)
    graphdef, state = _layer(cfg, routing)
    x, mask, cotangent = _inputs(b, s, routing)
    mesh = sharding.make_mesh(Parallelism(**layout))

    def reference(state, x):
        y, stats = nnx.merge(graphdef, state)(x, mask)
        return _objective(y, stats, cotangent), (y, stats)

    def sharded(state, x):
        y, stats = expert_parallel_moe(x, mask, state["router"]["weight"][...], state["w_gate"][...],
                                       state["w_up"][...], state["w_down"][...], cfg)
        return _objective(y, stats, cotangent), (y, stats)

    (ref_value, (ref_y, ref_stats)), ref_grads = jax.value_and_grad(reference, (0, 1), has_aux=True)(
        state, x)
    with jax.set_mesh(mesh):
        (value, (y, stats)), grads = jax.jit(jax.value_and_grad(sharded, (0, 1), has_aux=True))(
            state, x)
    if routing == "empty_expert":
        assert float(ref_stats["counts"][5]) == 0.0
    if routing == "one_expert":
        assert set(np.unique(np.asarray(ref_stats["topk_ids"]))) == {2, 6}
    if capacity_factor is not None:
        assert float(ref_stats["dropped_fraction"]) > 0.0
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for key in ("counts", "max_over_mean", "dropped_fraction", "topk_ids"):
        np.testing.assert_allclose(np.asarray(stats[key]), np.asarray(ref_stats[key]), rtol=1e-6)
    for (path, g), (_, g_ref) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree_util.tree_leaves_with_path(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_kept_copies_marks_what_the_capacity_drops():
    ids = jnp.array([[0, 1], [0, 2], [0, 1], [3, 0]])
    kept = np.asarray(kept_copies(ids, 4, capacity=2))
    # expert 0 is chosen by tokens 0, 1, 2, 3 in token order: the first two are kept
    np.testing.assert_array_equal(kept, [[True, True], [True, True], [False, True], [True, False]])
    assert np.asarray(kept_copies(ids, 4, None)).all()


def test_experts_must_split_over_the_expert_axis():
    _graphdef, _state = _layer(CFG, "random")
    x, mask, _ = _inputs(2, 4, "random")
    cfg = dataclasses.replace(CFG, n_experts=8)
    mesh = sharding.make_mesh(Parallelism(data=1, expert=8))
    bad = dataclasses.replace(cfg, n_experts=6)
    with pytest.raises(ValueError, match="do not split"):
        expert_parallel_moe(x, mask, jnp.zeros((16, 6)), jnp.zeros((6, 16, 12)), jnp.zeros((6, 16, 12)),
                            jnp.zeros((6, 12, 16)), bad, mesh=mesh)

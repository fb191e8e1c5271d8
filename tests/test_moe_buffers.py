"""Expert-parallel buffers sized by load (model/moe_buffers.py) with overflow passes: the sized exchange
equals the dropless reference (forward and gradients) on random routing, one hot expert (heavy
overflow), empty experts, token counts that divide neither the shards nor the tile, and capacity drops;
padded and (emulated) ragged; and the sizing arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.parallel import sharding
from smelt_jax.design.config import EXPERT_BUFFER_SLACK, ModelConfig
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.model import expert_exchange
from smelt_jax.model.dispatch import dispatch
from smelt_jax.model.expert_compute import local_expert_outputs
from smelt_jax.model.expert_exchange import exchanged_moe_outputs
from smelt_jax.model.moe import combine
from smelt_jax.model.moe_buffers import (buffer_fill, overflow_rows, rows_per_destination,
                                         worst_case_rows)
from test_parallel_expert import _ragged_all_to_all_emulated

D, F = 8, 6


def _routing(kind: str, tokens: int, n_experts: int, top_k: int, rng) -> np.ndarray:
    """[T, k] distinct experts per token."""
    if kind == "hot":  # every token picks experts 0..k-1: all on device 0 (heavy overflow)
        return np.tile(np.arange(top_k), (tokens, 1))
    if kind == "empty":  # experts of the upper half never chosen
        pool = n_experts // 2
        return np.argsort(rng.random((tokens, pool)), axis=1)[:, :top_k]
    return np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k]


def _problem(tokens, n_experts, top_k, kind, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(_routing(kind, tokens, n_experts, top_k, rng), jnp.int32)
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    weights = tuple(jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
                    for s in ((n_experts, D, F), (n_experts, D, F), (n_experts, F, D)))
    router = rng.random((tokens, top_k)) + 0.1
    router = jnp.asarray(router / router.sum(axis=1, keepdims=True), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    return ids, x, (router, *weights), cot


def _fullest_block(ids, kept, n_shards, n_ep, experts_local):
    """The most copies one token shard sends to one expert device (what the first pass must hold)."""
    dest = np.where(np.asarray(kept), np.asarray(ids) // experts_local, -1)
    per = -(-dest.shape[0] // n_shards)
    return max(int(np.sum(dest[s * per:(s + 1) * per] == j)) for s in range(n_shards) for j in range(n_ep))


@pytest.mark.parametrize("layout,tokens,n_experts,top_k,kind,slack,capacity,exchange", [
    ({"data": 1, "expert": 4, "tensor": 2}, 128, 8, 2, "random", 0.5, None, "padded"),   # overflow on random routing
    ({"data": 1, "expert": 4, "tensor": 2}, 128, 8, 2, "hot", 0.5, None, "padded"),      # everything on one device
    ({"data": 2, "expert": 4}, 101, 16, 3, "empty", 0.7, None, "padded"),   # empty experts, odd T
    ({"data": 1, "expert": 4, "tensor": 2}, 77, 16, 2, "random", 0.5, None, "padded"),   # T_l not a tile multiple
    ({"data": 2, "expert": 2, "tensor": 2}, 96, 8, 2, "hot", 0.3, 1.0, "padded"),        # capacity drops + overflow
    ({"data": 1, "expert": 4, "tensor": 2}, 128, 8, 2, "hot", 0.5, None, "ragged"),
    ({"data": 2, "expert": 4}, 101, 16, 3, "random", 0.7, None, "ragged"),
    ({"data": 1, "expert": 4, "tensor": 2}, 64, 8, 2, "random", None, None, "padded"),   # worst case: no overflow loop
])
def test_sized_exchange_equals_the_dropless_reference(layout, tokens, n_experts, top_k, kind, slack,
                                                       capacity, exchange, monkeypatch):
    if exchange == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_emulated)
    ids, x, weights, cot = _problem(tokens, n_experts, top_k, kind)
    cap = None if capacity is None else int(np.ceil(capacity * tokens * top_k / n_experts))
    plan = dispatch(ids, n_experts, cap)
    mesh = sharding.make_mesh(Parallelism(**layout))
    n_ep = layout["expert"]
    shards = layout["data"] * layout["expert"]  # tensor does not split tokens
    t_local = -(-tokens // shards)
    width = rows_per_destination(t_local, top_k, n_experts // n_ep, n_ep, slack)
    fullest = _fullest_block(ids.reshape(-1), plan.kept.reshape(-1), shards, n_ep, n_experts // n_ep)
    if slack is None:
        assert width == worst_case_rows(t_local, top_k, n_experts // n_ep)
    else:  # the cases are chosen so the overflow passes really run
        assert fullest > width

    def reference(x, weights):  # the local strategy and the layer's combine
        router, *experts = weights
        y = combine(local_expert_outputs(x, plan, *experts, backend="dense"), router)
        return jnp.sum(y * cot), y

    def sized(x, weights):  # router weights, tokens and the three expert weights all get gradients
        y = exchanged_moe_outputs(x, plan, *weights, backend="capacity", ragged=exchange == "ragged",
                                  mesh=mesh, slack=slack)
        return jnp.sum(y * cot), y

    (_, y_ref), g_ref = jax.value_and_grad(reference, (0, 1), has_aux=True)(x, weights)
    with jax.set_mesh(mesh):
        (_, y), grads = jax.jit(jax.value_and_grad(sized, (0, 1), has_aux=True))(x, weights)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-4, atol=1e-5)


def test_overflow_passes_run_as_often_as_the_fullest_block_needs(monkeypatch):
    """The pass loop's trip count: what the fullest (token shard -> device) block of any device needs past
    the first pass, the same on every device; 0 when the first pass holds everything."""
    seen = []
    real = expert_exchange.overflow_outputs
    monkeypatch.setattr(expert_exchange, "overflow_outputs",
                        lambda *a: (jax.debug.callback(lambda v: seen.append(int(v)), a[6]), real(*a))[1])
    mesh = sharding.make_mesh(Parallelism(data=1, expert=4, tensor=2))
    for kind, slack in (("random", 2.0), ("hot", 0.5)):
        seen.clear()
        ids, x, weights, _ = _problem(128, 8, 2, kind)
        plan = dispatch(ids, 8, None)
        with jax.set_mesh(mesh):
            jax.jit(lambda x, w, plan=plan, slack=slack: exchanged_moe_outputs(
                x, plan, *w, backend="capacity", ragged=False, mesh=mesh, slack=slack))(x, weights)
        jax.effects_barrier()
        width = rows_per_destination(32, 2, 2, 4, slack)
        extra = overflow_rows(width, 32, 2, 2)
        fullest = _fullest_block(ids.reshape(-1), plan.kept.reshape(-1), 4, 4, 2)
        assert seen == [max(0, -(-(fullest - width) // extra))] * 8  # 8 devices, tensor 2 included
    assert seen[0] == 7  # hot: one 64-row block past an 8-row first pass, in 8-row passes


def test_rows_are_sized_by_load_and_rounded_to_the_tile():
    # 100M S95 SMELT on v5p-128: T_l 16,384 tokens, k 8, E_l 36, n 8
    assert worst_case_rows(16384, 8, 36) == 131072
    assert rows_per_destination(16384, 8, 36, 8, None) == 131072
    assert rows_per_destination(16384, 8, 36, 8, 1.25) == 20480  # 1.25 x 16,384, a multiple of 128
    assert rows_per_destination(16384, 8, 36, 8, 1.3) % 128 == 0
    assert rows_per_destination(10, 2, 4, 4, 1.0) == 8  # small buffers round to 8 (5 -> 8)
    assert rows_per_destination(10, 2, 4, 4, 100.0) == 20  # never past the worst case
    assert overflow_rows(20480, 16384, 8, 36) == 5120
    assert overflow_rows(131072, 16384, 8, 36) == 0
    assert buffer_fill(8, 288, 8) == 1 / 8  # worst case, as before
    assert buffer_fill(8, 288, 8, tokens_local=16384, slack=1.25) == 0.8


def test_the_slack_is_an_execution_choice():
    cfg = ModelConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                      n_experts=8, top_k=2, expert_ffn=12, seq_len=16)
    assert cfg.expert_buffer_slack == EXPERT_BUFFER_SLACK
    assert "expert_buffer_slack" not in cfg.to_dict()  # spec files read as before
    other = cfg.replace(expert_buffer_slack=None)
    assert other.identity() == cfg.identity()  # run ids do not change with it
    assert ModelConfig.from_dict(other.to_dict()) == other
    with pytest.raises(ValueError, match="expert_buffer_slack"):
        cfg.replace(expert_buffer_slack=0.0)


def _sub_jaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def _loop_bodies(jaxpr, inside=False):
    """(equation, inside a while loop) for every equation of jaxpr and the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for sub in _sub_jaxprs(eqn.params):
            yield from _loop_bodies(sub, inside or eqn.primitive.name == "while")


def test_overflow_passes_work_on_their_rows_only():
    """Forward and backward: inside the overflow loops, no array has a dimension of the device's R = T_l * k
    copies (the old passes repeated, scattered and gathered [R, d] rows in every pass); only the sorted-order
    buffers [R + W, d] are updated in place, W rows at a time."""
    tokens, n_experts, top_k = 1024, 8, 2
    mesh = sharding.make_mesh(Parallelism(data=1, expert=4, tensor=2))
    ids, x, weights, cot = _problem(tokens, n_experts, top_k, "hot")
    plan = dispatch(ids, n_experts, None)
    r_local = tokens // 4 * top_k

    def sized(x, weights):
        y = exchanged_moe_outputs(x, plan, *weights, backend="capacity", ragged=False, mesh=mesh, slack=0.5)
        return jnp.sum(y * cot)

    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(sized, (0, 1)))(x, weights).jaxpr
    in_loops = [eqn for eqn, inside in _loop_bodies(jaxpr) if inside]
    assert any(eqn.primitive.name == "all_to_all" for eqn in in_loops)  # the overflow passes are there
    big = [(eqn.primitive.name, v.aval.shape) for eqn in in_loops if eqn.primitive.name != "dynamic_update_slice"
           for v in eqn.outvars if any(dim >= r_local for dim in getattr(v.aval, "shape", ()))]
    assert not big, big


def test_slack_cost_counts_the_passes_an_imbalanced_layer_needs():
    from benchmarks.moe_load import OVERFLOW_FIXED, slack_cost

    assert slack_cost(1.2, 1.5) == (0, 1.5)  # fits: the first pass only
    assert slack_cost(1.5, 1.5) == (0, 1.5)
    assert slack_cost(2.2, 1.5) == (2, 1.5 + 2 * 0.375 + OVERFLOW_FIXED)  # 0.7 past C in passes of C / 4
    assert slack_cost(6.0, 3.0) == (4, 3.0 + 4 * 0.75 + OVERFLOW_FIXED)


def test_imbalance_groups_experts_into_contiguous_devices_even_when_n_does_not_divide_them():
    from benchmarks.moe_load import imbalance

    # 10 experts on 4 devices: e * 4 // 10 puts experts 0-2, 3-4, 5-7, 8-9 on devices 0-3
    ids = np.array([[0, 1], [2, 3], [5, 8], [0, 9], [1, 4], [6, 7], [2, 0], [0, 5]])  # T 8, k 2
    counts = np.bincount(ids.ravel(), minlength=10)
    per_device = [counts[0:3].sum(), counts[3:5].sum(), counts[5:8].sum(), counts[8:10].sum()]  # 7 2 4 3
    got = imbalance(ids, 10, 4, shards=2)
    assert got["device"] == pytest.approx(max(per_device) / np.mean(per_device))  # 7 / 4
    assert got["expert"] == pytest.approx(counts.max() / counts.mean())  # 4 / 1.6
    # blocks: shard 0 (tokens 0-3) sends 4 copies to device 0; balanced = 4 tokens x 2 / 4 devices = 2
    assert got["block"] == pytest.approx(4 / 2)
    # when n divides E the groups are E / n experts each, as the MoE shard_map holds them
    even = np.array([[0, 7], [1, 2], [3, 3], [6, 5]])
    assert imbalance(even, 8, 4, shards=1)["device"] == pytest.approx(3 / 2)  # devices 0-3: 2, 3, 1, 2

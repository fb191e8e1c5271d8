"""The ring-of-experts exchange (model/ring_exchange.py) on 8 fake CPU devices against the reference:
a dense per-token computation of the routed experts, forward and gradients, and the MoE layer run
without a mesh. Random routing, an empty expert, one hot expert, odd token counts, capacity drops,
slack small enough to force overflow passes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.parallel import sharding
from smelt_jax.design.config import ModelConfig
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.kernels.backend import choose_expert_exchange
from smelt_jax.model import moe as moe_module
from smelt_jax.model.dispatch import dispatch
from smelt_jax.model.ring_exchange import ring_expert_outputs, ring_fill, ring_rows

D, F, E, K = 16, 12, 16, 8


def _reference(tokens, ids, kept, route_w, w_gate, w_up, w_down):
    """Per token: sum over its kept copies of weight * SwiGLU with the copy's expert (dense gather of
    each copy's weights, no sorting, no exchange). tokens [T, d], ids / kept / route_w [T, k]."""
    wg, wu, wd = w_gate[ids], w_up[ids], w_down[ids]  # [T, k, ...]
    gate = jnp.einsum("td,tkdf->tkf", tokens, wg)
    up = jnp.einsum("td,tkdf->tkf", tokens, wu)
    y = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(gate) * up, wd)
    return jnp.einsum("tkd,tk->td", y, jnp.where(kept, route_w, 0.0))


def _routing(kind, t, rng):
    if kind == "random":
        return np.stack([rng.permutation(E)[:K] for _ in range(t)])
    if kind == "empty_experts":  # experts 0-3 and 12 never chosen: device 0 (experts 0, 1) gets no row
        pool = np.array([e for e in range(E) if e not in (0, 1, 2, 3, 12)])
        return np.stack([rng.permutation(pool)[:K] for _ in range(t)])
    if kind == "one_hot":  # every token picks experts 0-7: devices 4-7 compute nothing
        return np.stack([rng.permutation(8) for _ in range(t)])
    raise ValueError(kind)


def _random_routed_problem(seed: int, t: int, d: int):
    """t random float32 tokens of width d, random routing over E experts (k = K), softmax router weights,
    expert weights, the dispatch plan and an 8-device expert mesh: (tokens, route_w, experts, plan, mesh)."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.normal(size=(t, d)).astype(np.float32))
    ids = jnp.asarray(_routing("random", t, rng).astype(np.int32))
    route_w = jax.nn.softmax(jnp.asarray(rng.normal(size=(t, K)).astype(np.float32)), axis=-1)
    experts = [jnp.asarray(0.3 * rng.normal(size=shape).astype(np.float32)) for shape in ((E, d, F),) * 2 + ((E, F, d),)]
    return tokens, route_w, experts, dispatch(ids, E, None), sharding.make_mesh(Parallelism(data=1, expert=8))


@pytest.mark.parametrize("layout,t,kind,capacity,slack", [
    ({"data": 1, "expert": 8}, 40, "random", None, 1.5),
    ({"data": 1, "expert": 8}, 15, "random", None, None),  # odd token count, worst-case buffer
    ({"data": 1, "expert": 8}, 37, "one_hot", None, 0.25),  # overflow passes on devices 0-3
    ({"data": 2, "expert": 4}, 21, "empty_experts", None, 1.0),
    ({"data": 1, "expert": 8}, 24, "random", 2, 1.5),  # capacity drops: dropped copies add nothing
    ({"data": 1, "fsdp": 2, "expert": 4}, 9, "one_hot", None, 0.5),
])
def test_ring_exchange_matches_the_dense_reference(layout, t, kind, capacity, slack):
    _check_against_the_reference(layout, t, kind, capacity, slack, backend="capacity")


@pytest.mark.parametrize("layout,t,kind,capacity,slack", [
    ({"data": 1, "expert": 8}, 37, "one_hot", None, 0.25),  # overflow passes on devices 0-3
    ({"data": 2, "expert": 4}, 21, "empty_experts", 2, 1.0),  # an empty device, capacity drops
])
def test_ring_exchange_with_the_tpu_kernels_matches_the_dense_reference(layout, t, kind, capacity, slack):
    """The `pallas` backend (interpreted here): the router weight applied in the down-projection kernel's
    epilogue and its gradient taken in that kernel's backward give the reference's values and gradients."""
    _check_against_the_reference(layout, t, kind, capacity, slack, backend="pallas")


def _check_against_the_reference(layout, t, kind, capacity, slack, *, backend):
    rng = np.random.default_rng(t)
    tokens = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
    ids = jnp.asarray(_routing(kind, t, rng).astype(np.int32))
    route_w = jax.nn.softmax(jnp.asarray(rng.normal(size=(t, K)).astype(np.float32)), axis=-1)
    w_gate, w_up = (jnp.asarray(0.3 * rng.normal(size=(E, D, F)).astype(np.float32)) for _ in range(2))
    w_down = jnp.asarray(0.3 * rng.normal(size=(E, F, D)).astype(np.float32))
    cotangent = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
    plan = dispatch(ids, E, capacity)
    if capacity is not None:
        assert not bool(jnp.all(plan.kept))
    mesh = sharding.make_mesh(Parallelism(**layout))

    def ring(x, rw, wg, wu, wd):
        return ring_expert_outputs(x, plan, rw, wg, wu, wd, backend=backend, mesh=mesh, slack=slack)

    def ref(x, rw, wg, wu, wd):
        return _reference(x, ids, plan.kept, rw, wg, wu, wd)

    args = (tokens, route_w, w_gate, w_up, w_down)
    with jax.set_mesh(mesh):
        y, vjp = jax.vjp(jax.jit(ring), *args)
        grads = vjp(cotangent)
    y_ref, vjp_ref = jax.vjp(ref, *args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(y_ref))) > 0.1  # the outputs are not all zero
    for name, g, g_ref in zip(("tokens", "router_w", "w_gate", "w_up", "w_down"), grads, vjp_ref(cotangent)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5, err_msg=name)
    if kind == "empty_experts":
        assert float(jnp.max(jnp.abs(grads[2][:4]))) == 0.0  # never-chosen experts get no gradient


def test_the_ring_buffer_holds_the_expected_load_times_slack():
    # T_l = 512 tokens per device, n = 8, k = 8 -> G = 4096 gathered tokens, 4096 expected copies per
    # device. E_l = 8: slack 1.5 -> 6144 rows (a multiple of the 128-row tile), the worst case 32768.
    assert ring_rows(4096, 8, 8, 8, 1.5) == 6144
    assert ring_rows(4096, 8, 8, 8, None) == 32768
    assert ring_fill(8, 64, 8, 512, 1.5) == pytest.approx(4096 / 6144)
    # E_l = 1: a token sends at most one copy to a device, so the expected load is the worst case.
    assert ring_rows(4096, 8, 1, 8, 1.5) == 4096 and ring_fill(8, 8, 8, 512, 1.5) == 1.0
    assert ring_rows(4096 + 8, 8, 8, 8, 1.5) == 6656  # 6156 -> 6272 (128-row tile) -> 13 x 512
    assert ring_rows(40, 8, 2, 8, 1.5) == 64  # small: 60 rounded to 8


CFG = ModelConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  n_experts=8, top_k=2, expert_ffn=12, seq_len=16, expert_impl="capacity",
                  expert_exchange="ring")


def test_the_moe_layer_takes_the_ring_and_matches_the_unsharded_layer(monkeypatch):
    """The whole layer (router, statistics, auxiliary losses) under a data 2 x expert 4 mesh."""
    graphdef, state = nnx.split(moe_module.MoE(CFG, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 7, CFG.d_model)).astype(np.float32))  # 21 tokens over 8 shards
    mask = jnp.ones((3, 7), bool).at[-1, -1].set(False)
    cotangent = jnp.asarray(rng.normal(size=x.shape).astype(np.float32))

    def objective(state, x):
        y, stats = nnx.merge(graphdef, state)(x, mask)
        return jnp.sum(y * cotangent) + stats["load_balance_loss"] + 0.1 * stats["router_z_loss"], y

    (ref_value, ref_y), ref_grads = jax.value_and_grad(objective, (0, 1), has_aux=True)(state, x)
    calls = []
    monkeypatch.setattr(moe_module, "ring_expert_outputs",
                        lambda *a, **k: calls.append(k) or ring_expert_outputs(*a, **k))
    with jax.set_mesh(sharding.make_mesh(Parallelism(data=2, expert=4))):
        (value, y), grads = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(state, x)
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for (path, g), (_, g_ref) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree_util.tree_leaves_with_path(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_ring_is_a_valid_exchange_never_chosen_by_auto():
    assert choose_expert_exchange("ring", "tpu") == "ring"
    assert all(choose_expert_exchange("auto", p) != "ring" for p in ("cpu", "gpu", "tpu"))
    assert dataclasses.replace(CFG).to_dict()["expert_exchange"] == "ring"


def test_a_layout_records_its_exchange_without_changing_ids_at_auto():
    import experiments
    from smelt_jax.design.config import ConfigError

    run = next(r for r in experiments.load_suite("smelt16") if r.arch == "smelt")
    assert run.parallelism.exchange == "ring"  # what the compile report chose (experiments/layouts.json)
    assert run.model.expert_exchange == "auto"  # the model keeps 'auto'; the layout applies the exchange
    auto = dataclasses.replace(run.parallelism, exchange="auto")
    assert "exchange" not in auto.to_dict()  # compile-cache keys of padded layouts as before
    assert run.parallelism.to_dict()["exchange"] == "ring"
    assert run.parallelism.with_exchange(run.model).expert_exchange == "ring"
    assert auto.with_exchange(run.model) is run.model
    with pytest.raises(ConfigError, match="exchange"):
        Parallelism(exchange="sparse")


def test_the_ring_saves_its_rows_in_the_compute_dtype_and_no_float32_rows():
    """bfloat16 tokens and experts, overflow passes compiled in: the residuals the backward keeps hold
    no float32 array of rows (last dim d); the FFN's input rows are saved in bfloat16 (its output rows are
    not saved at all: the router weight's gradient comes from the FFN's backward)."""
    rng = np.random.default_rng(3)
    t = 40
    tokens = jnp.asarray(rng.normal(size=(t, D)), jnp.bfloat16)
    ids = jnp.asarray(_routing("random", t, rng).astype(np.int32))
    route_w = jax.nn.softmax(jnp.asarray(rng.normal(size=(t, K)).astype(np.float32)), axis=-1)
    experts = [jnp.asarray(0.3 * rng.normal(size=shape), jnp.bfloat16) for shape in ((E, D, F),) * 2 + ((E, F, D),)]
    plan = dispatch(ids, E, None)
    mesh = sharding.make_mesh(Parallelism(data=1, expert=8))

    def ring(x, rw, wg, wu, wd):
        return ring_expert_outputs(x, plan, rw, wg, wu, wd, backend="capacity", mesh=mesh, slack=0.5)

    with jax.set_mesh(mesh):
        _, vjp = jax.vjp(ring, tokens, route_w, *experts)
    saved = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "dtype") and leaf.ndim >= 2]
    rows = [leaf for leaf in saved if leaf.shape[-1] == D]
    assert any(leaf.dtype == jnp.bfloat16 for leaf in rows)  # the FFN's input rows are among the residuals
    assert not [leaf.shape for leaf in rows if leaf.dtype == jnp.float32]


def _float32_rows(jaxpr, d: int, inside: bool = False) -> list:
    """(primitive, shape) of the float32 arrays of rows (ndim >= 2, last dim d) that equations inside a
    shard_map make."""
    found = []
    for eqn in jaxpr.eqns:
        here = inside or eqn.primitive.name == "shard_map"
        if here:
            found += [(eqn.primitive.name, v.aval.shape) for v in eqn.outvars
                      if getattr(v.aval, "dtype", None) == jnp.float32 and len(v.aval.shape) >= 2
                      and v.aval.shape[-1] == d]
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += _float32_rows(sub, d, here)
    return found


def test_the_ring_combines_in_the_compute_dtype_and_matches_the_reference_in_bfloat16():
    """Issue 50 item 3: the weighted rows are added into the [G, d] buffer in bfloat16 (no float32 rows,
    no float32 accumulator, no convert before the reduce-scatter), and the result stays within bfloat16's
    rounding of the float32 dense reference, forward and gradients, overflow passes included."""
    rng = np.random.default_rng(5)
    t = 40
    tokens32 = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
    ids = jnp.asarray(_routing("one_hot", t, rng).astype(np.int32))
    route_w = jax.nn.softmax(jnp.asarray(rng.normal(size=(t, K)).astype(np.float32)), axis=-1)
    experts32 = [jnp.asarray(0.3 * rng.normal(size=shape).astype(np.float32))
                 for shape in ((E, D, F),) * 2 + ((E, F, D),)]
    plan = dispatch(ids, E, None)
    mesh = sharding.make_mesh(Parallelism(data=1, expert=8))

    def ring(x, rw, wg, wu, wd):
        return ring_expert_outputs(x, plan, rw, wg, wu, wd, backend="ragged_dot", mesh=mesh, slack=0.5)

    bf16 = [a.astype(jnp.bfloat16) for a in (tokens32, *experts32)]
    with jax.set_mesh(mesh):
        traced = jax.make_jaxpr(ring)(bf16[0], route_w, *bf16[1:])
        y, vjp = jax.vjp(jax.jit(ring), bf16[0], route_w, *bf16[1:])
        cotangent = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
        grads = vjp(cotangent)
    # the expert FFN's own float32 outputs on CPU ([rows, d], cast in the backend) aside: no float32 array
    # of the G gathered tokens (the accumulator) and no float32 scatter (the combine)
    found = _float32_rows(traced.jaxpr, D)
    assert not [shape for _, shape in found if shape[0] == t]
    assert not [name for name, _ in found if name.startswith("scatter")]
    assert found  # the check sees the shard_map's float32 rows (the backend's)
    y_ref, vjp_ref = jax.vjp(lambda *a: _reference(a[0], ids, plan.kept, a[1], *a[2:]), tokens32, route_w, *experts32)
    scale = float(jnp.max(jnp.abs(y_ref)))
    assert scale > 0.1 and float(jnp.max(jnp.abs(y - y_ref))) < 0.03 * scale
    for name, g, g_ref in zip(("tokens", "router_w", "w_gate", "w_up", "w_down"), grads, vjp_ref(cotangent)):
        g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref)
        assert np.max(np.abs(g - g_ref)) < 0.03 * np.max(np.abs(g_ref)), name


def _layout_constraints(jaxpr) -> list:
    """Shapes that `layout_constraint` equations hold, sub-jaxprs (the shard_map's body) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "layout_constraint":
            found.append((eqn.invars[0].aval.shape, eqn.params["layout"].major_to_minor))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += _layout_constraints(sub)
    return found


@pytest.mark.parametrize("d", [D, 128])
def test_the_ring_holds_its_local_tokens_row_major_only_where_d_does_not_fill_lanes(d):
    """XLA:TPU lays a [T, d] activation out tokens-minor when d is not a multiple of 128, and the ring's
    [G, d] buffers with it (a transposing copy of [G, d] per layer and direction, docs/roofline.md): the
    ring holds its [T_l, d] input and output row-major there, and leaves every other program as it was
    (no constraint at d = 128). The values are the same either way (the tests above run at d = 16)."""
    tokens, route_w, experts, plan, mesh = _random_routed_problem(7, 24, d)

    def ring(x, rw, wg, wu, wd):
        return ring_expert_outputs(x, plan, rw, wg, wu, wd, backend="capacity", mesh=mesh, slack=0.5)

    with jax.set_mesh(mesh):
        forward = _layout_constraints(jax.make_jaxpr(ring)(tokens, route_w, *experts).jaxpr)
        backward = _layout_constraints(jax.make_jaxpr(
            lambda *a: jax.grad(lambda *b: jnp.sum(ring(*b) ** 2), argnums=0)(*a))(tokens, route_w, *experts).jaxpr)
    local = tokens.shape[0] // 8
    if d % 128:
        assert forward == [((local, d), (0, 1))] * 2  # the input and the reduce-scatter's output
        assert len(backward) == 4 and set(backward) == {((local, d), (0, 1))}  # and both cotangents
    else:
        assert forward == [] and backward == []


def _row_arithmetic(jaxpr, d: int, inside: bool = False) -> list:
    """(primitive, shape) of the multiplies of arrays of rows (ndim 2, last dim d) and the sums over their
    rows' d elements that equations inside a shard_map make outside any Pallas kernel."""
    found = []
    for eqn in jaxpr.eqns:
        here = inside or eqn.primitive.name == "shard_map"
        if here and eqn.primitive.name in ("mul", "reduce_sum"):
            over_d = eqn.primitive.name == "mul" or 1 in eqn.params["axes"]
            found += [(eqn.primitive.name, v.aval.shape) for v in eqn.invars
                      if len(getattr(v.aval, "shape", ())) == 2 and v.aval.shape[-1] == d and over_d]
        if eqn.primitive.name != "pallas_call":
            for sub in jax.core.jaxprs_in_params(eqn.params):
                found += _row_arithmetic(sub, d, here)
    return found


@pytest.mark.parametrize("backend", ["pallas", "capacity"])
def test_the_tpu_kernels_weigh_the_rows_and_take_the_weight_gradient_in_the_down_kernel(backend):
    """Issue 50 item 3: with the TPU kernels the router weight is applied in the down-projection kernel's
    epilogue and its gradient taken in that kernel's backward, so the shard_map's XLA program multiplies
    and sums no array of expert rows [rows, d], forward or backward (the `capacity` backend, which
    multiplies the rows after its FFN, shows the check sees them)."""
    tokens, route_w, experts, plan, mesh = _random_routed_problem(9, 24, D)

    def loss(x, rw, wg, wu, wd):
        y = ring_expert_outputs(x, plan, rw, wg, wu, wd, backend=backend, mesh=mesh, slack=0.5)
        return jnp.sum(y * y)

    with jax.set_mesh(mesh):
        traced = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3, 4)))(tokens, route_w, *experts)
    found = _row_arithmetic(traced.jaxpr, D)
    if backend == "pallas":
        assert not found
    else:
        assert {"mul", "reduce_sum"} <= {name for name, _ in found}

"""The MoE layer's expert-parallel strategy (shard_map + all_to_all over `expert`, taken under a mesh
with an `expert` axis) against the same layer without a mesh: outputs, statistics and gradients, on
random routing, an empty expert, every token on the same experts, odd token counts and capacity drops."""

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
from smelt_jax.model.dispatch import kept_copies
from smelt_jax.model.expert_exchange import exchanged_moe_outputs
from smelt_jax.model.moe import MoE

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


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, built from `all_to_all` (XLA:CPU has no
    ragged-all-to-all): slice i of `operand` (input_offsets[i], send_sizes[i] rows) goes to device
    i // (N / n) and lands there at output_offsets[i]; the rest of `output` is kept."""
    n = jax.lax.axis_size(axis_name)
    per = input_offsets.shape[0] // n
    rows, tail = operand.shape[0], operand.shape[1:]
    r = jnp.arange(rows)
    valid = (r[None] < send_sizes[:, None]).reshape(-1, rows, *(1,) * len(tail))
    data = jnp.where(valid, operand[jnp.clip(input_offsets[:, None] + r[None], 0, rows - 1)], 0)
    recv = jax.lax.all_to_all(data.reshape(n, per, rows, *tail), axis_name, 0, 0)
    land = jax.lax.all_to_all(output_offsets.reshape(n, per), axis_name, 0, 0)
    sizes = recv_sizes.reshape(n, per)
    out = output
    for source in range(n):
        for j in range(per):
            target = jnp.where(r < sizes[source, j], land[source, j] + r, output.shape[0])
            out = out.at[target].set(recv[source, j], mode="drop")
    return out


@pytest.mark.parametrize("layout,b,s,routing,capacity_factor,exchange", [
    pytest.param({"data": 2, "expert": 4}, 4, 8, "random", None, "padded", marks=pytest.mark.slow),
    ({"data": 1, "expert": 8}, 3, 5, "random", None, "padded"),  # 15 tokens over 8 shards
    ({"data": 2, "fsdp": 2, "expert": 2}, 2, 7, "empty_expert", None, "padded"),
    ({"data": 1, "expert": 4, "tensor": 2}, 2, 8, "one_expert", None, "padded"),
    ({"data": 2, "expert": 4}, 4, 8, "random", 1.0, "padded"),  # capacity drops, as the unsharded layer
    ({"data": 1, "expert": 8}, 3, 5, "random", None, "ragged"),
    ({"data": 1, "expert": 8}, 3, 5, "random", None, "auto"),  # the default: padded on this CPU
    ({"data": 2, "expert": 4}, 4, 8, "one_expert", 1.0, "ragged"),
])
def test_expert_parallel_moe_matches_the_unsharded_layer(layout, b, s, routing, capacity_factor, exchange,
                                                         monkeypatch):
    cfg = dataclasses.replace(CFG, capacity_factor=capacity_factor, expert_exchange=exchange)
    if exchange == "ragged":  # the block offsets and counts checked against the primitive's semantics
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_emulated)
    graphdef, state = _layer(cfg, routing)
    x, mask, cotangent = _inputs(b, s, routing)
    mesh = sharding.make_mesh(Parallelism(**layout))

    def objective(state, x):  # the one MoE layer; under the mesh it takes the exchange strategy
        y, stats = nnx.merge(graphdef, state)(x, mask)
        return _objective(y, stats, cotangent), (y, stats)

    (ref_value, (ref_y, ref_stats)), ref_grads = jax.value_and_grad(objective, (0, 1), has_aux=True)(
        state, x)
    calls = []
    monkeypatch.setattr(moe_module, "exchanged_moe_outputs",
                        lambda *a, **k: calls.append(k) or exchanged_moe_outputs(*a, **k))
    with jax.set_mesh(mesh):
        (value, (y, stats)), grads = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(
            state, x)
    # the exchange strategy really ran, and "auto" took padded on this CPU
    assert calls and calls[0]["ragged"] == (exchange == "ragged")
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


@pytest.mark.tpu
@pytest.mark.integration
def test_the_padded_exchange_is_the_tpu_default_and_ragged_still_compiles():
    """The default (`auto`) exchange for a TPU slice is the padded all-to-all; the explicit ragged one
    (the real ragged-all-to-all, and JAX's transpose of it in the backward pass) is accepted by the TPU
    compiler and replaces the expert all-to-alls. Why padded: its program walks fewer HBM bytes."""
    from smelt_jax.compile import aot
    from smelt_jax.compile import report as cr

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments

    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    layout = Parallelism(data=1, fsdp=2, expert=2)
    assert run.model.expert_exchange == "auto"
    padded = cr.compile_run(run, "v5p-8", layout, remat="full")  # the default
    ragged_run = dataclasses.replace(run, model=run.model.replace(expert_exchange="ragged"))
    ragged = cr.compile_run(ragged_run, "v5p-8", layout, remat="full")
    assert padded.peak_fits_hbm and ragged.peak_fits_hbm
    assert padded.collectives.get("ragged-all-to-all", 0) == 0
    assert ragged.collectives.get("ragged-all-to-all", 0) > 0
    assert ragged.collectives.get("all-to-all", 0) < padded.collectives["all-to-all"]
    assert padded.hbm_traffic_bytes < ragged.hbm_traffic_bytes, (padded.hbm_traffic_bytes, ragged.hbm_traffic_bytes)


@pytest.mark.parametrize("requested,platform,expected", [
    ("auto", "tpu", "padded"), ("auto", "gpu", "ragged"), ("auto", "cuda", "ragged"),
    ("auto", "cpu", "padded"), ("padded", "tpu", "padded"), ("ragged", "cpu", "ragged"),
])
def test_the_exchange_is_chosen_by_platform_in_one_place(requested, platform, expected):
    assert choose_expert_exchange(requested, platform) == expected


def test_auto_exchange_reads_the_default_backend():
    assert choose_expert_exchange("auto") == ("ragged" if jax.default_backend() == "gpu" else "padded")
    with pytest.raises(ValueError, match="not in"):
        choose_expert_exchange("sparse", "tpu")


def test_the_auto_exchange_leaves_run_ids_alone():
    assert CFG.expert_exchange == "auto"
    assert "expert_exchange" not in CFG.to_dict()  # the default is left out of every content hash
    for explicit in ("ragged", "padded"):  # an explicit choice is part of the configuration
        chosen = CFG.replace(expert_exchange=explicit)
        assert chosen.to_dict()["expert_exchange"] == explicit
        assert ModelConfig.from_dict(chosen.to_dict()) == chosen
    assert ModelConfig.from_dict(CFG.to_dict()) == CFG
    with pytest.raises(ValueError, match="expert_exchange"):
        CFG.replace(expert_exchange="sparse")


def test_kept_copies_marks_what_the_capacity_drops():
    ids = jnp.array([[0, 1], [0, 2], [0, 1], [3, 0]])
    kept = np.asarray(kept_copies(ids, 4, capacity=2))
    # expert 0 is chosen by tokens 0, 1, 2, 3 in token order: the first two are kept
    np.testing.assert_array_equal(kept, [[True, True], [True, True], [False, True], [True, False]])
    assert np.asarray(kept_copies(ids, 4, None)).all()


def test_experts_must_split_over_the_expert_axis():
    bad = dataclasses.replace(CFG, n_experts=6)
    moe = MoE(bad, rngs=nnx.Rngs(0))
    x, mask, _ = _inputs(2, 4, "random")
    mesh = sharding.make_mesh(Parallelism(data=1, expert=8))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="do not split"):
        moe(x, mask)

"""GQA in the TPU attention (issue 50 item 6): splash's kernels take K/V with their kv heads and map each
query head to its group in their index maps, so no K/V copy per query head exists and dk/dv are
accumulated per KV head inside the backward kernel. Checked on CPU in Pallas interpret mode against the
reference (`dot_product_attention`), forward and gradients, for one KV head (MQA), a group of 2 and as
many KV heads as query heads (MHA), with documents and padding per row, one block and an odd number of
blocks; the head-major layer path (`Attention._splash`, full-width RoPE with the scale folded in) against
the reference layer; the kernels' operands in the traced program; and, with libtpu, the compiled layer's
buffers (no [.., hd/2] RoPE halves, no transposes around the kernel, K/V at kv heads)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels import splash
from smelt_jax.model.attention import (Attention, dot_product_attention, rope_head_major, rotate_half_matrix,
                                       segment_causal_mask)
from smelt_jax.model.rope import apply_rope, rope_angles

HEADS, HD = 4, 16


def _inputs(kv, s, b=2, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, HEADS, s, HD)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, kv, s, HD)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, kv, s, HD)), jnp.float32)
    segments = np.ones((b, s), np.int32)
    segments[0, s // 3:] = 2  # a document boundary inside a block
    segments[1, s // 2:], segments[1, s - 7:] = 3, 0  # and a padded tail (segment 0)
    cotangent = jnp.asarray(rng.normal(size=(b, HEADS, s, HD)), jnp.float32)
    return q, k, v, jnp.asarray(segments), cotangent


def _reference(q, k, v, segments):
    """Head-major in and out, through the grouped reference core: [b, h, s, hd] -> [b, h, s, hd]."""
    b, h, s, hd = q.shape
    kv = k.shape[1]
    slots = jnp.arange(s)
    mask = segment_causal_mask(segments, segments, slots, slots)
    grouped = q.swapaxes(1, 2).reshape(b, s, kv, h // kv, hd)
    out, _ = dot_product_attention(grouped, k.swapaxes(1, 2), v.swapaxes(1, 2), mask)
    return out.reshape(b, s, h, hd).swapaxes(1, 2)


def _value_and_grads(attention, q, k, v, segments, cotangent):
    def objective(q, k, v):
        return jnp.sum(attention(q, k, v, segments).astype(jnp.float32) * cotangent)

    return jax.value_and_grad(objective, (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("kv,s", [(1, 384), (2, 128), (4, 256)])  # MQA / GQA / MHA; 3, 1, 2 blocks
def test_head_major_splash_matches_the_reference_forward_and_gradients(kv, s):
    q, k, v, segments, cotangent = _inputs(kv, s)
    attention = lambda *a: splash.splash_attention_head_major(*a, interpret=True)  # noqa: E731
    out = attention(q, k, v, segments)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(q, k, v, segments)), rtol=1e-5, atol=1e-5)
    value, grads = _value_and_grads(attention, q, k, v, segments, cotangent)
    ref_value, ref_grads = _value_and_grads(_reference, q, k, v, segments, cotangent)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert g.shape == g_ref.shape  # dk, dv at kv heads: [b, kv, s, hd]
        assert float(jnp.max(jnp.abs(g_ref))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5, err_msg=name)


def test_query_scaled_skips_the_kernels_scaling():
    q, k, v, segments, _ = _inputs(2, 128)
    scaled = splash.splash_attention_head_major(q * HD ** -0.5, k, v, segments, query_scaled=True, interpret=True)
    plain = splash.splash_attention_head_major(q, k, v, segments, interpret=True)
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(plain), rtol=1e-5, atol=1e-6)


def _equations(jaxpr):
    from jax.extend.core import subjaxprs

    yield from jaxpr.eqns
    for sub in subjaxprs(jaxpr):
        yield from _equations(sub)


def _pallas_calls(jaxpr):
    return [eqn for eqn in _equations(jaxpr) if eqn.primitive.name == "pallas_call"]


@pytest.mark.parametrize("kv", [1, 2])
def test_the_kernels_read_and_write_kv_at_kv_heads(kv):
    """In the traced forward + backward, every splash kernel's K and V operands and the backward's dk, dv
    results are [b, kv, s, hd] (the kernels vmapped over rows): nothing broadcasts K/V to the query heads,
    and no dk/dv of query-head shape is summed over a group afterwards."""
    q, k, v, segments, cotangent = _inputs(kv, 256)
    attention = lambda *a: splash.splash_attention_head_major(*a, interpret=True)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda q, k, v: _value_and_grads(attention, q, k, v, segments, cotangent))(q, k, v)
    calls = list(_pallas_calls(jaxpr.jaxpr))
    assert len(calls) == 2  # forward, fused backward
    kv_shape = (2, kv, 256, HD)
    for call in calls:
        shapes = [tuple(x.aval.shape) for x in call.invars]
        assert shapes.count(kv_shape) == 2, shapes  # k and v, once each
        assert (2, HEADS, 256, HD) in shapes  # q
    backward_outputs = [tuple(x.aval.shape) for x in calls[1].outvars]
    assert backward_outputs.count(kv_shape) == 2  # dk, dv
    assert not any(shape[-3:] == (HEADS, 256, HD) and shape[0] == 2 and len(shape) == 4
                   for shape in backward_outputs if kv != HEADS)  # no dk/dv per query head
    if kv == HEADS:
        return
    for eqn in _equations(jaxpr.jaxpr):  # no K/V copy per query head (jnp.repeat, broadcast_to, tile)
        if not eqn.outvars:
            continue
        out = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        if eqn.primitive.name == "broadcast_in_dim" and eqn.invars[0].aval.ndim > 0:
            assert out not in ((2, HEADS, 256, HD), (2, kv, HEADS // kv, 256, HD)), eqn
        if eqn.primitive.name in ("concatenate", "gather"):
            assert out != (2, HEADS, 256, HD), eqn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_width_rope_equals_apply_rope(dtype):
    rng = np.random.default_rng(3)
    b, h, s, hd = 2, 3, 40, 72  # hd / 2 = 36: the SMELT 100M head
    x = jnp.asarray(rng.normal(size=(b, h, s, hd)), dtype)
    positions = jnp.asarray(rng.integers(0, 4096, size=(b, s)))
    cos, sin = rope_angles(positions, hd, 10000.0)
    want = apply_rope(x.swapaxes(1, 2), cos, sin).swapaxes(1, 2).astype(jnp.float32)
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
    got = rope_head_major(x, cos, sin).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tolerance, atol=tolerance)
    scaled = rope_head_major(x, cos, sin, hd ** -0.5).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(want) * hd ** -0.5, rtol=tolerance, atol=tolerance)
    r = rotate_half_matrix(hd)  # a signed permutation: exact in any dtype
    assert sorted(np.abs(r).sum(0)) == [1.0] * hd and sorted(np.abs(r).sum(1)) == [1.0] * hd


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_the_splash_layer_equals_the_reference_layer_with_gradients(kv):
    cfg = ModelConfig(vocab=64, d_model=32, n_layers=1, n_heads=HEADS, n_kv_heads=kv, head_dim=HD,
                      n_experts=2, top_k=1, expert_ffn=16, seq_len=128, attention_impl="reference")
    ref_layer = Attention(cfg, rngs=nnx.Rngs(kv))
    splash_layer = Attention(cfg.replace(attention_impl="splash"), rngs=nnx.Rngs(kv))
    rng = np.random.default_rng(kv)
    x = jnp.asarray(rng.normal(size=(2, 128, 32)), jnp.float32)
    segments = jnp.asarray(np.array([[1] * 50 + [2] * 78, [1] * 120 + [0] * 8]))
    positions = jnp.asarray(np.array([list(range(50)) + list(range(78)), list(range(128))]))
    cos, sin = rope_angles(positions, HD, 10000.0)

    def loss(layer, x):
        out, _, _ = layer(x, cos, sin, segments)
        return jnp.sum(out * jnp.sin(jnp.arange(32.0)))

    want, want_grads = nnx.value_and_grad(loss, argnums=(0, 1))(ref_layer, x)
    got, got_grads = nnx.value_and_grad(loss, argnums=(0, 1))(splash_layer, x)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for (path, g), (_, g_ref) in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                                     jax.tree_util.tree_leaves_with_path(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-6, err_msg=str(path))
    _, _, internals = splash_layer(x, cos, sin, segments, capture=True)
    _, _, ref_internals = ref_layer(x, cos, sin, segments, capture=True)
    for name in ("q", "k", "v", "pv"):
        np.testing.assert_allclose(np.asarray(internals[name]), np.asarray(ref_internals[name]),
                                   rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.tpu
def test_the_compiled_tpu_layer_has_no_half_width_or_per_head_kv_buffers():
    """The layer's forward + backward compiled for one v5p chip at the SMELT 100M head (8 query heads,
    2 KV heads, head_dim 72): the Mosaic kernels take K/V at 2 heads (no copy per query head), and
    nothing per head is written at the RoPE's half width (36 lanes, padded to 128 in HBM)."""
    from smelt_jax.compile import aot
    from smelt_jax.parallel.sharding import MESH_AXES

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    b, s, d, heads, kv, hd = 2, 1024, 576, 8, 2, 72
    cfg = ModelConfig(vocab=64, d_model=d, n_layers=1, n_heads=heads, n_kv_heads=kv, head_dim=hd, n_experts=2,
                      top_k=1, expert_ffn=16, seq_len=s, compute_dtype="bfloat16",
                      attention_impl="splash")  # as the compile report resolves `auto` for a TPU
    devices = aot.tpu_topology("v5p:2x2x1").devices[:1]
    mesh = jax.sharding.Mesh(np.array(devices).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    graphdef, state = nnx.split(Attention(cfg, rngs=nnx.Rngs(0)))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)

    def step(state, x, segments):
        cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(s), (b, s)), hd, 10000.0)
        loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x, cos, sin, segments)[0].astype(jnp.float32))
        return jax.grad(loss, (0, 1))(state, x)

    compiled, _ = aot.compile_for_tpu(step, [abstract, jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16),
                                             jax.ShapeDtypeStruct((b, s), jnp.int32)], mesh)
    text = compiled.as_text()
    kernels = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(kernels) == 2 and all(f"bf16[{b},{kv},{s},{hd}]" in line for line in kernels)
    assert not re.search(rf"\[\d+,\d+,\d+,{hd // 2}\]", text)  # no per-head buffer at the half width

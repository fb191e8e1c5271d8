"""Splash attention (`smelt_jax.kernels.splash`, the TPU attention backend) against the reference
attention (`model.attention.dot_product_attention`, the CPU path and the oracle): on CPU in Pallas
interpret mode, forward and gradients, GQA, several documents and padding per row, a row length that is a
multiple of the block but not a power of 2, with and without a mesh; the choice of backend; the program
FLOPs it is counted at; and, with libtpu, a train step compiled ahead of time for v5p and v6e with it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.parallel import sharding
from smelt_jax.compile.program_flops import program_flops
from smelt_jax.design.config import ModelConfig
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.kernels import splash
from smelt_jax.kernels.backend import choose_attention_backend
from smelt_jax.model.attention import Attention, dot_product_attention, segment_causal_mask

B, S, HEADS, KV, HD = 2, 384, 4, 2, 32  # 384 = 3 blocks of 128


def _inputs(dtype=jnp.float32, b=B, s=S):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, s, HEADS, HD)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, KV, HD)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, KV, HD)), dtype)
    segments = np.ones((b, s), np.int32)
    segments[0, 100:], segments[0, 300:] = 2, 3  # documents across block boundaries
    segments[1, 200:], segments[1, -10:] = 2, 0  # and a padded tail (segment 0)
    cotangent = jnp.asarray(rng.normal(size=(b, s, HEADS, HD)), jnp.float32)
    return q, k, v, jnp.asarray(segments), cotangent


def _reference(q, k, v, segments):
    b, s = segments.shape
    slots = jnp.arange(s)
    mask = segment_causal_mask(segments, segments, slots, slots)
    out, _ = dot_product_attention(q.reshape(b, s, KV, HEADS // KV, HD), k, v, mask)
    return out.reshape(b, s, HEADS, HD)


def _value_and_grads(attention, q, k, v, segments, cotangent):
    def objective(q, k, v):
        return jnp.sum(attention(q, k, v, segments).astype(jnp.float32) * cotangent)

    return jax.value_and_grad(objective, (0, 1, 2))(q, k, v)


def test_splash_matches_the_reference_forward_and_gradients():
    q, k, v, segments, cotangent = _inputs()
    out = splash.splash_attention(q, k, v, segments, interpret=True)
    want = _reference(q, k, v, segments)
    assert out.shape == (B, S, HEADS, HD) and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    value, grads = _value_and_grads(splash.splash_attention, q, k, v, segments, cotangent)
    ref_value, ref_grads = _value_and_grads(_reference, q, k, v, segments, cotangent)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert float(jnp.max(jnp.abs(g_ref))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5, err_msg=name)


def test_splash_under_a_mesh_splits_batch_and_heads():
    """Mosaic kernels are not partitioned by GSPMD: under a mesh the kernel runs in a shard_map."""
    q, k, v, segments, cotangent = _inputs(b=4, s=256)
    mesh = sharding.make_mesh(Parallelism(data=2, fsdp=2, tensor=2))
    want = _value_and_grads(_reference, q, k, v, segments, cotangent)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: _value_and_grads(splash.splash_attention, *a))(q, k, v, segments, cotangent)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, g_ref in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5)


def test_splash_in_bf16_keeps_float32_statistics():
    q, k, v, segments, _ = _inputs(jnp.bfloat16)
    out = splash.splash_attention(q, k, v, segments, interpret=True)
    want = _reference(*(a.astype(jnp.float32) for a in (q, k, v)), segments)
    assert out.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) < 0.05


def test_the_attention_layer_takes_splash_when_asked():
    cfg = ModelConfig(vocab=64, d_model=32, n_layers=1, n_heads=HEADS, n_kv_heads=KV, head_dim=16,
                      n_experts=2, top_k=1, expert_ffn=16, seq_len=128)
    ref_layer = Attention(cfg, rngs=nnx.Rngs(0))
    splash_layer = Attention(cfg.replace(attention_impl="splash"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 128, 32)), jnp.float32)
    cos, sin = jnp.ones((2, 128, 8)), jnp.zeros((2, 128, 8))
    segments = jnp.asarray(np.repeat([[1] * 50 + [2] * 78], 2, axis=0))
    want, _, _ = ref_layer(x, cos, sin, segments)
    got, _, internals = splash_layer(x, cos, sin, segments, capture=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert internals["pv"].shape == (2, 128, HEADS, 16)
    # asking for the probabilities takes the reference (splash does not form them)
    _, _, with_probs = splash_layer(x, cos, sin, segments, capture=True, return_probs=True)
    assert with_probs["attn_probs"].shape == (2, HEADS, 128, 128)


@pytest.mark.parametrize("requested,platform,seq_len,full,expected", [
    ("auto", "tpu", 4096, True, "splash"),
    ("auto", "tpu", 4000, True, "reference"),  # not whole blocks of 128
    ("auto", "tpu", 4096, False, "reference"),  # decoding with a KV cache, or probabilities captured
    ("auto", "cpu", 4096, True, "blocked"),  # tests/test_attention_blocked.py
    ("auto", "gpu", 4096, True, "reference"),
    ("splash", "cpu", 256, True, "splash"),
    ("reference", "tpu", 4096, True, "reference"),
])
def test_attention_backend_is_chosen_in_one_place(requested, platform, seq_len, full, expected):
    assert choose_attention_backend(requested, platform, seq_len=seq_len, full_forward=full) == expected


def test_attention_impl_is_validated_and_left_out_of_run_ids_by_default():
    cfg = ModelConfig(vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=2,
                      top_k=1, expert_ffn=16)
    assert "attention_impl" not in cfg.to_dict()
    assert cfg.replace(attention_impl="reference").to_dict()["attention_impl"] == "reference"
    with pytest.raises(ValueError, match="attention_impl"):
        cfg.replace(attention_impl="flash")
    with pytest.raises(ValueError, match="multiple of 128"):
        splash.block_size(200)
    assert [splash.block_size(s) for s in (4096, 384, 768)] == [512, 128, 256]


def test_program_flops_count_the_causal_blocks_splash_runs():
    """4096 keys in blocks of 512: 8 x 8 block pairs per head, 36 on or below the diagonal run. Forward
    2 matmuls per pair, fused backward 5, each 2 x 512^2 x hd: 7 (nb + 1) / (12 nb) = 0.66 of the
    reference's dense forward and backward (6 matmuls of every pair)."""
    b, s, heads, kv, hd = 1, 4096, 2, 1, 128
    q = jax.ShapeDtypeStruct((b, s, heads, hd), jnp.bfloat16)
    k = v = jax.ShapeDtypeStruct((b, s, kv, hd), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def train(attention):
        def objective(q, k, v, segments):
            return jnp.sum(attention(q, k, v, segments).astype(jnp.float32))
        return program_flops(jax.make_jaxpr(jax.grad(objective, (0, 1, 2)))(q, k, v, segments))

    def reference(q, k, v, segments):
        slots = jnp.arange(s)
        mask = segment_causal_mask(segments, segments, slots, slots)
        return dot_product_attention(q.reshape(b, s, kv, heads // kv, hd), k, v, mask)[0]

    counted = train(splash.splash_attention)
    dense = train(reference)
    nb, pair = s // 512, 2.0 * 512 * 512 * hd
    assert counted.by_kind["splash"] == b * heads * nb * (nb + 1) / 2 * (2 + 5) * pair
    assert counted.pallas_without_estimate == 0
    assert dense.by_kind["dot_general"] == b * heads * nb * nb * 6 * pair
    assert counted.by_kind["splash"] / dense.by_kind["dot_general"] == pytest.approx(7 * 9 / 96)


@pytest.mark.tpu
@pytest.mark.integration
@pytest.mark.parametrize("slice_name", ["v5p-8", pytest.param("v6e-4", marks=pytest.mark.slow)])
def test_a_train_step_compiles_with_splash_for_tpu(slice_name, tmp_path):
    """A micro run's full train step (forward, backward, AdamW), compiled by the TPU compiler with the
    default attention, which is splash on TPU: its Mosaic kernels are in the program."""
    from smelt_jax.compile import aot
    from smelt_jax.compile import report as cr

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments

    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    assert run.model.attention_impl == "auto" and run.schedule.seq_len % 128 == 0
    hlo = tmp_path / "step.hlo.gz"
    report = cr.compile_run(run, slice_name, Parallelism(data=2, fsdp=2), hlo_path=hlo)
    assert report.peak_fits_hbm and report.error is None
    text = cr.read_hlo(hlo)
    # the experts run as ragged_dot on this mesh (no expert axis): every Mosaic kernel is splash's
    assert report.expert_impl == "ragged_dot"
    # The kernels' names are in the HLO metadata in interpret mode too: look at what runs them.
    mosaic = [line.split(" = ", 1)[0].strip() for line in text.splitlines()
              if 'custom_call_target="tpu_custom_call"' in line]
    assert any(name.startswith("%splash_mha_fwd") for name in mosaic)
    assert any(name.startswith("%splash_mha_dkv") for name in mosaic)
    assert not re.search(r' while\(.*op_name="[^"]*/splash_mha', text)  # no interpret-mode grid loop
    assert report.program_flops_by_kind["splash"] > 0

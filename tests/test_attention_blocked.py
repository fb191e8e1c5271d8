"""The CPU's `blocked` attention (model.attention.causal_blocked_attention) against the reference on random
inputs: forward and gradients, documents across block boundaries, a padded tail, odd and short rows; its
FLOPs in XLA's count; and the platform choice (CPU only, never an ahead-of-time TPU program)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.design import budget
from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels.backend import CAUSAL_BLOCK, choose_attention_backend
from smelt_jax.model.attention import (Attention, blocked_attended_keys, causal_blocked_attention,
                                       dot_product_attention, segment_causal_mask)
from tests.platform_fakes import FakeMesh

KV, GROUP, HD = 2, 2, 16


def _inputs(b, s, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, s, KV, GROUP, HD)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, KV, HD)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, KV, HD)), jnp.float32)
    segments = np.ones((b, s), np.int32)
    segments[0, s // 3:] = 2  # a document starting inside a block
    if b > 1:
        segments[1, s // 2:], segments[1, -5:] = 3, 0  # and a padded tail (segment 0)
    cotangent = jnp.asarray(rng.normal(size=(b, s, KV, GROUP, HD)), jnp.float32)
    return q, k, v, jnp.asarray(segments), cotangent


def _reference(q, k, v, segments, block=None):
    slots = jnp.arange(segments.shape[1])
    return dot_product_attention(q, k, v, segment_causal_mask(segments, segments, slots, slots))[0]


def _value_and_grads(attention, q, k, v, segments, cotangent, block):
    def objective(q, k, v):
        return jnp.sum(attention(q, k, v, segments, block) * cotangent)
    return jax.jit(jax.value_and_grad(objective, (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("s,block", [(256, 64), (200, 64), (77, 16), (16, 64), (1, 8)])
def test_blocked_attention_matches_the_reference_forward_and_gradients(s, block):
    q, k, v, segments, cotangent = _inputs(2, s, seed=s)
    got = jax.jit(causal_blocked_attention, static_argnums=4)(q, k, v, segments, block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, segments)), rtol=1e-5, atol=1e-5)
    value, grads = _value_and_grads(causal_blocked_attention, q, k, v, segments, cotangent, block)
    ref_value, ref_grads = _value_and_grads(_reference, q, k, v, segments, cotangent, block)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5, atol=1e-4)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert float(jnp.max(jnp.abs(g_ref))) > 0 or (s == 1 and name != "v")  # one key: softmax constant
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_attention_layer_on_cpu_takes_blocked_and_matches_the_reference_layer():
    cfg = ModelConfig(vocab=64, d_model=32, n_layers=1, n_heads=KV * GROUP, n_kv_heads=KV, head_dim=HD,
                      n_experts=2, top_k=1, expert_ffn=16, seq_len=160)
    assert choose_attention_backend(cfg.attention_impl, seq_len=cfg.seq_len) == "blocked"  # this CPU
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 160, 32)), jnp.float32)
    cos, sin = jnp.ones((2, 160, HD // 2)), jnp.zeros((2, 160, HD // 2))
    segments = jnp.asarray(np.repeat([[1] * 70 + [2] * 90], 2, axis=0))

    def loss(layer):
        return jnp.sum(layer(x, cos, sin, segments)[0] ** 2)

    ref_layer = Attention(cfg.replace(attention_impl="reference"), rngs=nnx.Rngs(0))
    auto_layer = Attention(cfg, rngs=nnx.Rngs(0))
    want, want_grads = nnx.jit(nnx.value_and_grad(loss))(ref_layer)
    got, got_grads = nnx.jit(nnx.value_and_grad(loss))(auto_layer)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for g, g_ref in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("requested,platform,seq_len,full,expected", [
    ("auto", "cpu", 256, True, "blocked"),
    ("auto", "cpu", CAUSAL_BLOCK, True, "reference"),  # one block: nothing to skip
    ("auto", "cpu", 256, False, "reference"),  # decoding, or probabilities captured
    ("auto", "gpu", 256, True, "reference"),
    ("auto", "tpu", 256, True, "splash"),
    ("blocked", "tpu", 256, True, "blocked"),  # an explicit choice is honoured
    ("blocked", "cpu", 256, False, "reference"),
])
def test_blocked_is_the_cpu_choice_for_a_full_forward(requested, platform, seq_len, full, expected):
    assert choose_attention_backend(requested, platform, seq_len=seq_len, full_forward=full) == expected


def test_an_ahead_of_time_tpu_program_never_takes_blocked():
    """Traced on this CPU under a TPU mesh: the TPU's choice (splash is decided by the compile report,
    which passes the platform; with none given it stays the reference), never the CPU's `blocked`."""
    assert choose_attention_backend("auto", seq_len=256, mesh=FakeMesh("tpu")) == "reference"
    assert choose_attention_backend("auto", seq_len=256, mesh=FakeMesh("cpu")) == "blocked"


def test_blocked_attended_keys_count_the_blocks_on_and_below_the_diagonal():
    assert blocked_attended_keys(256, 64) == (64 + 128 + 192 + 256) / 4  # 160 of 256
    assert blocked_attended_keys(64, 64) == 64 * 64 / 64
    assert blocked_attended_keys(100, 64) == (64 * 64 + 100 * 36) / 100


def test_xla_counts_the_blocked_attention_flops_of_the_budget():
    """XLA's FLOP count of the compiled attention core matches the budget's attention term at the mean
    keys the blocks score, and is below the reference's (every key)."""
    b, s = 2, 256
    q, k, v, segments, _ = _inputs(b, s)
    cfg = ModelConfig(vocab=64, d_model=64, n_layers=1, n_heads=KV * GROUP, n_kv_heads=KV, head_dim=HD,
                      n_experts=2, top_k=1, expert_ffn=16, seq_len=s)

    def matmul_flops(fn):
        compiled = jax.jit(fn, static_argnums=4).lower(q, k, v, segments, CAUSAL_BLOCK).compile()
        return compiled.cost_analysis()["flops"]

    def attention_term(keys):  # forward attention FLOPs per token of one layer, from the budget
        return (budget.forward_flops_per_token(cfg, attended_keys=keys)
                - budget.forward_flops_per_token(cfg, attended_keys=0))

    blocked = matmul_flops(causal_blocked_attention)
    reference = matmul_flops(_reference)
    want = b * s * attention_term(blocked_attended_keys(s, CAUSAL_BLOCK))
    # the matmuls dominate; softmax and masking add a few percent on top
    assert want <= blocked < 1.15 * want, (blocked, want)
    assert blocked < 0.75 * reference


def test_blocked_attention_keeps_bfloat16_inputs_dtypes_in_its_output_and_gradients():
    q, k, v, segments, cotangent = _inputs(2, 130, seed=5)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    _, grads = _value_and_grads(causal_blocked_attention, q16, k16, v16, segments, cotangent, 64)
    _, ref_grads = _value_and_grads(_reference, q16.astype(jnp.float32), k16.astype(jnp.float32),
                                    v16.astype(jnp.float32), segments, cotangent, 64)
    assert causal_blocked_attention(q16, k16, v16, segments, 64).dtype == jnp.bfloat16
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref), rtol=2e-2, atol=2e-2, err_msg=name)

"""KV-cache decoding: cache size, prefill + steps == full forward, greedy == argmax of a forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.design import budget
from smelt_jax.design.config import ModelConfig
from smelt_jax.model import (
    Decoder,
    cache_entries_per_token,
    decode_step,
    greedy_decode,
    init_cache,
    prefill,
)

TINY = ModelConfig(vocab=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                   n_experts=8, top_k=2, expert_ffn=32, loop_start=1, loop_length=2,
                   loop_repeats=2, seq_len=64)
PROMPT, TOTAL = 10, 16


@pytest.fixture(scope="module")
def model():
    return Decoder(TINY, rngs=nnx.Rngs(3))


@nnx.jit
def _full_forward(model, tokens, segments, positions):
    return model(tokens, segments, positions)[0]


_jit_prefill = nnx.jit(prefill)
_jit_step = nnx.jit(decode_step)


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(loop_repeats=3),
                                 TINY.replace(loop_start=0, loop_length=0, loop_repeats=1)])
def test_cache_holds_one_slot_per_executed_layer(cfg):
    cache = jax.eval_shape(lambda: init_cache(cfg, batch=3, max_len=5))
    assert cache_entries_per_token(cache) == budget.kv_per_token(cfg)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])  # TPU's and CPU's layer loops
def test_prefill_and_steps_reproduce_the_full_forward(model, layer_loop):
    model = nnx.clone(model)
    model.layer_loop = layer_loop
    tokens = jax.random.randint(jax.random.key(0), (2, TOTAL), 0, TINY.vocab, jnp.int32)
    # Row 0 packs two documents (6 + 10 tokens); row 1 is one document.
    segments = jnp.array([[1] * 6 + [2] * 10, [1] * 16], jnp.int32)
    positions = jnp.array([list(range(6)) + list(range(10)), list(range(16))], jnp.int32)
    want = np.asarray(_full_forward(model, tokens, segments, positions))

    cache = init_cache(TINY, batch=2, max_len=TOTAL)
    logits, cache = _jit_prefill(model, tokens[:, :PROMPT], segments[:, :PROMPT],
                                 positions[:, :PROMPT], cache)
    np.testing.assert_allclose(np.asarray(logits), want[:, :PROMPT], rtol=1e-5, atol=1e-5)
    for t in range(PROMPT, TOTAL):
        step_logits, cache = _jit_step(model, tokens[:, t:t + 1], segments[:, t:t + 1],
                                       positions[:, t:t + 1], cache)
        np.testing.assert_allclose(np.asarray(step_logits), want[:, t], rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {t}")
    assert int(cache["index"]) == TOTAL
    with pytest.raises(ValueError, match="cache full"):
        prefill(model, tokens[:, :1], segments[:, :1], positions[:, :1], cache)


def test_greedy_decoding_equals_argmax_of_a_full_forward(model):
    prompt = jax.random.randint(jax.random.key(1), (2, PROMPT), 0, TINY.vocab, jnp.int32)
    generated = greedy_decode(model, prompt, steps=TOTAL - PROMPT)
    assert generated.shape == (2, TOTAL)
    np.testing.assert_array_equal(np.asarray(generated[:, :PROMPT]), np.asarray(prompt))
    segments = jnp.ones_like(generated)
    positions = jnp.broadcast_to(jnp.arange(TOTAL, dtype=jnp.int32), generated.shape)
    logits = _full_forward(model, generated, segments, positions)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, PROMPT - 1:-1], -1)),
                                  np.asarray(generated[:, PROMPT:]))

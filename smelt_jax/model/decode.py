"""KV-cache decoding: prefill a prompt, then one token per step.

The cache holds one K and one V slot per *executed* layer (each loop visit has its own, since every
visit recomputes K and V from its own residual stream): per token 2 * executed_layers * kv_width
entries, `budget.kv_per_token(cfg)`. Layout, per stack: 'prefix' / 'suffix' {'k', 'v':
[layers, b, max_len, kv_heads, head_dim]}, 'loop' {'k', 'v': [loop_repeats, layers, b, max_len,
kv_heads, head_dim]}; shared: 'segment_ids' [b, max_len] (0 = empty slot) and 'index' (next slot).
Every row of a batch advances together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.platform.errors import UsageError
from smelt_jax.model.decoder import Decoder, stack_layers


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty cache for `batch` rows of up to `max_len` tokens."""
    if batch <= 0 or max_len <= 0:
        raise UsageError(f"batch ({batch}) and max_len ({max_len}) must be positive")
    slot = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    cache = {"segment_ids": jnp.zeros((batch, max_len), jnp.int32),
             "index": jnp.zeros((), jnp.int32)}
    for name, layers in stack_layers(cfg).items():
        if not len(layers):
            continue
        lead = (cfg.loop_repeats, len(layers)) if name == "loop" else (len(layers),)
        cache[name] = {"k": jnp.zeros(lead + slot, dtype), "v": jnp.zeros(lead + slot, dtype)}
    return cache


def cache_entries_per_token(cache: dict) -> int:
    """K/V entries stored per cached token (per row and slot)."""
    batch, max_len = cache["segment_ids"].shape
    total = sum(leaf.size for name in ("prefix", "loop", "suffix") if name in cache
                for leaf in (cache[name]["k"], cache[name]["v"]))
    return total // (batch * max_len)


def extend(model: Decoder, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array,
           cache: dict) -> tuple[jax.Array, dict]:
    """Run tokens [b, n] at cache slots [index, index + n): (logits [b, n, vocab], new cache).

    The caller keeps index + n <= max_len (slots past the end would be silently clipped by
    dynamic_update_slice, so this is checked when the index is concrete).
    """
    max_len = cache["segment_ids"].shape[1]
    if not isinstance(cache["index"], jax.core.Tracer) and int(cache["index"]) + tokens.shape[1] > max_len:
        raise UsageError(f"cache full: index {int(cache['index'])} + {tokens.shape[1]} tokens "
                         f"> max_len {max_len}")
    logits, _, new_cache = model.forward(tokens, segment_ids, positions, cache=cache)
    return logits, new_cache


prefill = extend  # a prompt is an extension of the empty cache


def decode_step(model: Decoder, token: jax.Array, segment_id: jax.Array, position: jax.Array,
                cache: dict) -> tuple[jax.Array, dict]:
    """One new token per row: token, segment_id, position [b, 1] -> (logits [b, vocab], cache)."""
    logits, cache = extend(model, token, segment_id, position, cache)
    return logits[:, -1], cache


@nnx.jit
def _jit_extend(model, tokens, segment_ids, positions, cache):
    return extend(model, tokens, segment_ids, positions, cache)


def greedy_decode(model: Decoder, prompt: jax.Array, steps: int) -> jax.Array:
    """Greedy continuation of prompt [b, p] (one document per row) by `steps` tokens -> [b, p + steps]."""
    batch, prompt_len = prompt.shape
    cache = init_cache(model.cfg, batch, prompt_len + steps)
    segments = jnp.ones_like(prompt)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
    logits, cache = _jit_extend(model, prompt, segments, positions, cache)
    tokens = [prompt]
    next_token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None]
    for step in range(steps):
        tokens.append(next_token)
        if step == steps - 1:
            break
        position = jnp.full((batch, 1), prompt_len + step, jnp.int32)
        logits, cache = _jit_extend(model, next_token, segments[:, :1], position, cache)
        next_token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None]
    return jnp.concatenate(tokens, axis=1)

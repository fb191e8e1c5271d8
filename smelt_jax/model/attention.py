"""Grouped-query attention over packed rows with per-document (segment) masks.

A query attends to a key only when both carry the same segment id and the key's slot (its index in
the row, or in the KV cache) is not after the query's. RoPE uses per-document positions.

Two backends for the core, chosen by `kernels.backend.choose_attention_backend(cfg.attention_impl)`:
- reference (`dot_product_attention`; CPU, GPU, decoding with a KV cache, captured probabilities, and the
  test oracle): the full [seq, keys] score matrix is computed and masked, so the attention matmuls cost
  4 * q_width * keys FLOPs per token and layer with keys = the row length (the cost-analysis test's
  convention; see docs/model.md);
- splash (TPU, full forward): Pallas splash attention (`kernels/splash.py`), which skips the key blocks
  after each query block (about the causal half) and applies the segment ids inside the blocks it runs;
- blocked (CPU, full forward; `causal_blocked_attention`): the reference's arithmetic over query blocks
  of `CAUSAL_BLOCK` rows, each against only the keys up to its own last row, so the score matrix's
  blocks above the diagonal are never computed: keys per query (n + 1) B / 2 for s = n B (160 of 256 at
  B 64), the softmax and its backward shrunk alike. Plain XLA, with a written-out (flash-style) backward
  that reuses the forward's weights.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels.backend import CAUSAL_BLOCK, choose_attention_backend
from smelt_jax.kernels.splash import splash_attention_head_major
from smelt_jax.model.rope import apply_rope
from smelt_jax.parallel.sharding import constrain, current_mesh, param

INIT_STD = 0.02


def truncated_normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    """Normal(0, std) truncated at +-2 std (a common LM init; docs/model.md)."""
    return (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape)).astype(dtype)


def segment_causal_mask(query_segments: jax.Array, key_segments: jax.Array,
                        query_slots: jax.Array, key_slots: jax.Array) -> jax.Array:
    """[batch, q, k] bool: same document and key slot <= query slot.

    query_segments [batch, q], key_segments [batch, k], query_slots [q], key_slots [k].
    """
    same_document = query_segments[:, :, None] == key_segments[:, None, :]
    causal = key_slots[None, :] <= query_slots[:, None]
    return same_document & causal[None]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
                          ) -> tuple[jax.Array, jax.Array]:
    """GQA core.

    q [b, s, kv_heads, group, hd], k and v [b, t, kv_heads, hd], mask [b, s, t].
    Returns the output [b, s, kv_heads, group, hd] and probabilities [b, kv_heads, group, s, t]
    (float32). Every query sees at least itself, so no row of the softmax is empty.
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype), probs


def _head_major(q: jax.Array, k: jax.Array, v: jax.Array):
    """q [b, s, kv, g, hd] -> [b, kv, g, s, hd] scaled by hd^-0.5; k, v [b, s, kv, hd] -> [b, kv, s, hd];
    all float32 (the blocked core's working layout: each block's products need no further transpose)."""
    scale = q.shape[-1] ** -0.5
    return (jnp.transpose(q.astype(jnp.float32), (0, 2, 3, 1, 4)) * scale,
            jnp.transpose(k.astype(jnp.float32), (0, 2, 1, 3)), jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3)))


def _blocked_forward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block: int):
    """The blocked core in the head-major layout (`_head_major`). Returns the output [b, kv, g, s, hd]
    and, per query block [lo, hi), the unnormalised weights exp(score - row max) [b, kv, g, hi - lo, hi]
    (zero where masked) and their rows' 1 / sum [b, kv, g, hi - lo, 1], which the backward reuses."""
    s = q.shape[3]
    slots = jnp.arange(s, dtype=jnp.int32)
    outs, weights, inverse_sums = [], [], []
    for lo in range(0, s, block):
        hi = min(lo + block, s)
        mask = segment_causal_mask(segment_ids[:, lo:hi], segment_ids[:, :hi], slots[lo:hi], slots[:hi])
        scores = jnp.einsum("bkgsd,bktd->bkgst", q[:, :, :, lo:hi], k[:, :, :hi])
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        w = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        inverse_sum = 1.0 / jnp.sum(w, axis=-1, keepdims=True)  # a query sees itself: the sum is >= 1
        outs.append(jnp.einsum("bkgst,bktd->bkgsd", w, v[:, :, :hi]) * inverse_sum)
        weights.append(w)
        inverse_sums.append(inverse_sum)
    return jnp.concatenate(outs, axis=3), weights, inverse_sums


def _from_head_major(out: jax.Array, dtype) -> jax.Array:
    """[b, kv, g, s, hd] -> [b, s, kv, g, hd] in `dtype`."""
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def causal_blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                             block: int) -> jax.Array:
    """The reference core over query blocks, skipping the keys after each block (a full forward only:
    keys are this row's).

    q [b, s, kv_heads, group, hd], k and v [b, s, kv_heads, hd], segment_ids [b, s]. Block i takes
    queries [i B, min((i + 1) B, s)) against keys [0, min((i + 1) B, s)) with the same segment-causal
    mask; any s works (the last block may be short). Returns the output [b, s, kv_heads, group, hd].

    Float32 inside. The backward is written out (flash-attention style) rather than autodiffed: it
    reuses the forward's unnormalised weights P~ and row factors r = 1 / sum P~ and takes the softmax's
    row term from the output, D = rowsum(dO * O), an [s, hd] reduction in place of autodiff's [s, keys]
    one; with P = r P~: dV = P^T dO, dS = P (dO V^T - D), dQ = dS K / sqrt(hd), dK = dS^T Q / sqrt(hd).
    Masked weights are exactly zero, so the backward needs no mask.
    """
    out, _, _ = _blocked_forward(*_head_major(q, k, v), segment_ids, block)
    return _from_head_major(out, q.dtype)


def _blocked_attention_fwd(q, k, v, segment_ids, block):
    qh, kh, vh = _head_major(q, k, v)
    out, weights, inverse_sums = _blocked_forward(qh, kh, vh, segment_ids, block)
    dtypes = tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v))  # residuals are arrays: dtypes as empties
    return _from_head_major(out, q.dtype), (qh, kh, vh, out, weights, inverse_sums, dtypes)


def _blocked_attention_bwd(block, residuals, d_out):
    qh, kh, vh, out, weights, inverse_sums, dtypes = residuals
    q_dtype, k_dtype, v_dtype = (x.dtype for x in dtypes)
    s, scale = qh.shape[3], qh.shape[-1] ** -0.5
    d_out = jnp.transpose(d_out.astype(jnp.float32), (0, 2, 3, 1, 4))  # [b, kv, g, s, hd]
    row_term = jnp.sum(d_out * out, axis=-1, keepdims=True)  # D [b, kv, g, s, 1]
    dk, dv, dq_blocks = jnp.zeros_like(kh), jnp.zeros_like(vh), []
    for lo, w, inverse_sum in zip(range(0, s, block), weights, inverse_sums):
        hi = min(lo + block, s)
        d_out_block = d_out[:, :, :, lo:hi]
        dv = dv.at[:, :, :hi].add(jnp.einsum("bkgst,bkgsd->bktd", w, d_out_block * inverse_sum))
        d_weights = jnp.einsum("bkgsd,bktd->bkgst", d_out_block, vh[:, :, :hi])
        d_scores = w * (inverse_sum * (d_weights - row_term[:, :, :, lo:hi]))
        dq_blocks.append(jnp.einsum("bkgst,bktd->bkgsd", d_scores, kh[:, :, :hi]))
        dk = dk.at[:, :, :hi].add(jnp.einsum("bkgst,bkgsd->bktd", d_scores, qh[:, :, :, lo:hi]))
    dq = _from_head_major(jnp.concatenate(dq_blocks, axis=3) * scale, q_dtype)
    dk = jnp.transpose(dk, (0, 2, 1, 3)).astype(k_dtype)
    dv = jnp.transpose(dv, (0, 2, 1, 3)).astype(v_dtype)
    return dq, dk, dv, None


causal_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)


def blocked_attended_keys(seq_len: int, block: int) -> float:
    """Mean keys scored per query by `causal_blocked_attention` (the budget's `attended_keys`)."""
    return sum(min(lo + block, seq_len) * (min(lo + block, seq_len) - lo)
               for lo in range(0, seq_len, block)) / seq_len


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R [hd, hd] with x @ R = concat(-x[hd/2:], x[:hd/2]) (RoPE's rotate-half; model/rope.py): a signed
    permutation, so x @ R in any dtype is exact."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[half:, :half] = -np.eye(half)
    r[:half, half:] = np.eye(half)
    return r


def rope_head_major(x: jax.Array, cos: jax.Array, sin: jax.Array, scale: float = 1.0) -> jax.Array:
    """`rope.apply_rope` in the head-major layout, times `scale`: x [b, heads, s, hd], cos/sin
    [b, s, hd/2] -> [b, heads, s, hd] in x's dtype.

    Written at full width, x cos' + (x R) sin' with cos' = [cos, cos], sin' = [sin, sin] (float32) and R
    the exact rotate-half matrix, instead of on the two halves: at head_dim 72 a half is 36 lanes, which
    a TPU pads to 128 in every buffer it is written to (3.6x); the [hd, hd] product costs 2 hd^2 FLOPs per
    head and token. The same values as apply_rope (then x scale), to float32 rounding."""
    cos_full = (jnp.concatenate([cos, cos], axis=-1) * scale)[:, None]
    sin_full = (jnp.concatenate([sin, sin], axis=-1) * scale)[:, None]
    rotated = jnp.einsum("bhse,ef->bhsf", x, jnp.asarray(rotate_half_matrix(x.shape[-1]), x.dtype))
    return (x.astype(jnp.float32) * cos_full + rotated.astype(jnp.float32) * sin_full).astype(x.dtype)


class Attention(nnx.Module):
    """Q, K, V, O projections without biases; n_heads query heads share n_kv_heads K/V heads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        dtype = jnp.dtype(cfg.param_dtype)
        self.wq = param(truncated_normal(rngs, (d, h, hd), INIT_STD, dtype),
                        ("embed", "heads", "head_dim"))
        self.wk = param(truncated_normal(rngs, (d, kv, hd), INIT_STD, dtype),
                        ("embed", "kv_heads", "head_dim"))
        self.wv = param(truncated_normal(rngs, (d, kv, hd), INIT_STD, dtype),
                        ("embed", "kv_heads", "head_dim"))
        self.wo = param(truncated_normal(rngs, (h, hd, d), INIT_STD, dtype),
                        ("heads", "head_dim", "embed"))

    @jax.named_scope("attention")  # names the ops for profiles (benchmarks/bench_ops.py)
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 *, cache: dict | None = None, capture: bool = False, return_probs: bool = False):
        """x [b, s, d] (compute dtype), cos/sin [b, s, hd/2], segment_ids [b, s].

        cache: None for a full forward (keys = this row), or {'k', 'v': [b, T, kv, hd],
        'segment_ids': [b, T] already holding this step's ids, 'index': int32 scalar slot of x[:, 0]}.
        Returns (out [b, s, d], updated {'k', 'v'} or None, internals). internals is {} unless
        `capture`: then 'q' [b, s, heads, hd] and 'k', 'v' [b, s, kv, hd] (this row's, after RoPE for
        q and k), 'pv' [b, s, heads, hd] (probability-weighted values, before the output projection)
        and, with `return_probs`, 'attn_probs' [b, heads, s, keys] float32.
        """
        cfg = self.cfg
        dtype = x.dtype
        b, s, _ = x.shape
        group = cfg.n_heads // cfg.n_kv_heads
        backend = choose_attention_backend(cfg.attention_impl, seq_len=s, mesh=current_mesh(),
                                           full_forward=cache is None and not return_probs)
        if backend == "splash":
            return self._splash(x, cos, sin, segment_ids, capture)
        q = jnp.einsum("bsd,dhe->bshe", x, self.wq[...].astype(dtype))
        k = jnp.einsum("bsd,dhe->bshe", x, self.wk[...].astype(dtype))
        v = jnp.einsum("bsd,dhe->bshe", x, self.wv[...].astype(dtype))
        q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
        k = constrain(apply_rope(k, cos, sin), ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        query_slots = jnp.arange(s, dtype=jnp.int32)
        new_cache = None
        if cache is None:
            keys, values, key_segments, key_slots = k, v, segment_ids, query_slots
        else:
            index = cache["index"]
            keys = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype),
                                                (0, index, 0, 0))
            values = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype),
                                                  (0, index, 0, 0))
            new_cache = {"k": keys, "v": values}
            keys, values = keys.astype(dtype), values.astype(dtype)
            key_segments = cache["segment_ids"]
            key_slots = jnp.arange(keys.shape[1], dtype=jnp.int32)
            query_slots = query_slots + index
        grouped_q = q.reshape(b, s, cfg.n_kv_heads, group, cfg.head_dim)
        if backend == "blocked":  # the same function, query blocks against their keys only
            out = causal_blocked_attention(grouped_q, keys, values, segment_ids, CAUSAL_BLOCK)
        else:
            mask = segment_causal_mask(segment_ids, key_segments, query_slots, key_slots)
            out, probs = dot_product_attention(grouped_q, keys, values, mask)
        pv = out.reshape(b, s, cfg.n_heads, cfg.head_dim)
        out = jnp.einsum("bshe,hed->bsd", pv, self.wo[...].astype(dtype))
        internals = {}
        if capture:  # a Python flag: without it the program has no extra outputs
            internals = {"q": q, "k": k, "v": v, "pv": pv}
            if return_probs:
                internals["attn_probs"] = probs.reshape(b, cfg.n_heads, s, keys.shape[1])
        return out, new_cache, internals

    def _splash(self, x, cos, sin, segment_ids, capture: bool):
        """The full forward on TPU: the same function, in the splash kernel's head-major layout from the
        projections to the output projection (no transposes around the kernel), RoPE at full width with
        the queries' hd^-0.5 folded in (`rope_head_major`); K/V keep their kv heads (GQA in the kernel)."""
        cfg, dtype = self.cfg, x.dtype
        scale = 1.0 if capture else cfg.head_dim ** -0.5  # captured q is reported unscaled
        q = jnp.einsum("bsd,dhe->bhse", x, self.wq[...].astype(dtype))
        k = jnp.einsum("bsd,dhe->bhse", x, self.wk[...].astype(dtype))
        v = jnp.einsum("bsd,dhe->bhse", x, self.wv[...].astype(dtype))
        q = constrain(rope_head_major(q, cos, sin, scale), ("batch", "act_heads", "seq", None))
        k = constrain(rope_head_major(k, cos, sin), ("batch", "act_kv_heads", "seq", None))
        v = constrain(v, ("batch", "act_kv_heads", "seq", None))
        pv = splash_attention_head_major(q, k, v, segment_ids, query_scaled=not capture)
        out = jnp.einsum("bhse,hed->bsd", pv, self.wo[...].astype(dtype))
        internals = {}
        if capture:
            internals = {name: t.swapaxes(1, 2) for name, t in (("q", q), ("k", k), ("v", v), ("pv", pv))}
        return out, None, internals

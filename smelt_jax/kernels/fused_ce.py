"""Fused linear cross-entropy (Pallas, Mosaic on TPU): logits = h @ w are made tile by tile in VMEM with
float32 accumulation and never written to HBM, forward or backward.

    token_stats(h [n, d], w [d, V], targets [n] int32) -> (lse [n] f32, target_logit [n] f32)
    token_grads(h [n, d], w [d, V], targets [n], lse [n], a [n], c [n]) -> (dh [n, d] f32, dw [d, V] f32)

`token_stats` (forward kernel, grid (token tiles "parallel", vocab tiles "arbitrary")): per token tile, a
loop over vocabulary tiles computes the [tm, tv] logits tile, updates an online log-sum-exp (running max
and sum in VMEM scratch) and picks the target's logit; it writes only lse and the target logit. Targets
outside [0, V) pick nothing (target_logit 0): a vocabulary shard's caller passes targets minus its offset.

`token_grads` (backward kernel) returns the gradients of sum_t sum_v dlogits[t, v] * logits[t, v] with
dlogits = a_t * exp(logits - lse_t) - c_t * onehot(target_t) (cast to h's dtype for the matmuls, as the
chunked loss does): for the cross-entropy with upstream gradient g, mask m and z-loss weight z,
a = g m (1 + 2 z lse) and c = g m. Grid (splits "parallel", vocab tiles, token tiles): vocabulary tiles
outer, so each [d, tv] block of dw is an output-resident float32 accumulator over all token tiles,
written to HBM once; dh [n, d] float32 is accumulated over vocabulary tiles by reading and writing its
token tile (an input aliased to the output). `splits` cuts the vocabulary tiles into that many
independent halves with their own dh partials (summed after the kernel), so a megacore chip (v4, v5p)
runs both TensorCores.

Shapes need not divide the tiles: tokens are padded (padded rows have a = c = 0 and give 0) and the
vocabulary is padded with zero columns whose logits are masked to -inf. d is one whole block.
Traffic per call, re-reads included, is `traffic_bytes` (also the kernels' cost estimates).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from smelt_jax.kernels.backend import pallas_interpret

# Budget for the blocks of one kernel (double-buffered blocks + f32 temporaries). The scoped VMEM limit
# is raised to 2x this, at most 3/4 of a core's VMEM (`pltpu.get_tpu_info`: v5e 128 MiB, v5p 64 MiB ->
# 48 MiB); the default tiles compile for v5e and v5p at the smelt16 shapes (tests/test_fused_ce.py).
VMEM_BUDGET = 40 * 2**20
VECTORS = 8  # rows of the backward's packed per-token inputs [8, n] f32 (lane-dense: 32 B a token)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes: forward (tm, tv) and backward (tm, tv); multiples of 8 and 128. Shrunk to the input."""

    fwd_tokens: int = 2048
    fwd_vocab: int = 512
    bwd_tokens: int = 256
    bwd_vocab: int = 4096
    splits: int = 2  # independent vocabulary halves of the backward (megacore); 1 when they do not divide


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_tiles(d: int, itemsize: int = 2) -> Tiles:
    """Tiles whose backward blocks fit VMEM_BUDGET at width d: the dw accumulator [d, tv] f32 and the w
    block [d, tv] of `itemsize` bytes (both double-buffered) shrink tv from 4096 for wide models (bf16:
    d 672 -> 4096, d 2304 -> 1024)."""
    tv = 4096
    while tv > 512 and _round_up(d, 8) * tv * (2 * 4 + 2 * itemsize) > VMEM_BUDGET:
        tv //= 2
    return Tiles(bwd_vocab=tv)


def fit_tiles(n: int, v: int, d: int, tiles: Tiles | None = None, itemsize: int = 2) -> Tiles:
    """`tiles` (default: `default_tiles(d, itemsize)`) shrunk so no tile exceeds the (8, 128)-rounded
    input. For Mosaic, bwd_tokens must be a multiple of 128 or cover all tokens."""
    t = tiles or default_tiles(d, itemsize)
    n8, v128 = _round_up(max(n, 1), 8), _round_up(max(v, 1), 128)
    return dataclasses.replace(t, fwd_tokens=min(t.fwd_tokens, n8), fwd_vocab=min(t.fwd_vocab, v128),
                               bwd_tokens=min(t.bwd_tokens, n8), bwd_vocab=min(t.bwd_vocab, v128))


def traffic_bytes(n: int, d: int, v: int, itemsize: int, tiles: Tiles | None = None) -> dict[str, int]:
    """HBM bytes each kernel moves, block re-reads included (padded sizes; per-token vectors as [n, 1]
    f32 padded to 128 lanes in the forward, packed [8, n] in the backward). forward: w once per token
    tile, h once; backward: h once per vocabulary tile, dh f32 read and written once per vocabulary tile,
    w read and dw written once."""
    t = fit_tiles(n, v, d, tiles, itemsize)
    nf, vf = _round_up(n, t.fwd_tokens), _round_up(v, t.fwd_vocab)
    nb, vb = _round_up(n, t.bwd_tokens), _round_up(v, t.bwd_vocab)
    vec = 128 * 4  # one token's lane-padded scalar
    forward = (nf // t.fwd_tokens) * d * vf * itemsize + nf * d * itemsize + 3 * nf * vec
    backward = ((vb // t.bwd_vocab) * (nb * d * itemsize + 2 * nb * d * 4 + VECTORS * nb * 4)
                + d * vb * itemsize + d * vb * 4)
    return {"forward": forward, "backward": backward}


def _vmem_limit(interpret: bool) -> int | None:
    if interpret:
        return None
    return int(min(max(2 * VMEM_BUDGET, 32 * 2**20), pltpu.get_tpu_info().vmem_capacity_bytes * 3 // 4))


def _pad(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == shape:
        return a
    return jnp.pad(a, [(0, s - x) for x, s in zip(a.shape, shape)])


def _targets_in_range(targets: jax.Array, v: int) -> jax.Array:
    """int32 targets, -1 where outside [0, v) (they must not pick a padded column)."""
    t = targets.astype(jnp.int32)
    return jnp.where((t >= 0) & (t < v), t, -1)


def _masked_logits(h, w, col0, vocab):
    """[tm, tv] f32 logits of h [tm, d] @ w [d, tv]; columns >= vocab are -inf. Also the column ids."""
    logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return jnp.where(cols < vocab, logits, -jnp.inf), cols


def _stats_kernel(targets_ref, h_ref, w_ref, lse_ref, target_logit_ref, max_sc, sum_sc, pick_sc, *,
                  tv, vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        max_sc[...] = jnp.full(max_sc.shape, -jnp.inf, jnp.float32)
        sum_sc[...] = jnp.zeros(sum_sc.shape, jnp.float32)
        pick_sc[...] = jnp.zeros(pick_sc.shape, jnp.float32)

    logits, cols = _masked_logits(h_ref[...], w_ref[...], j * tv, vocab)
    old_max = max_sc[...]
    new_max = jnp.maximum(old_max, jnp.max(logits, axis=1, keepdims=True))  # finite: a tile has a real column
    sum_sc[...] = (sum_sc[...] * jnp.exp(old_max - new_max)
                   + jnp.sum(jnp.exp(logits - new_max), axis=1, keepdims=True))
    max_sc[...] = new_max
    pick_sc[...] += jnp.sum(jnp.where(cols == targets_ref[...], logits, 0.0), axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        lse_ref[...] = max_sc[...] + jnp.log(sum_sc[...])
        target_logit_ref[...] = pick_sc[...]


def token_stats(h: jax.Array, w: jax.Array, targets: jax.Array, *, tiles: Tiles | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(log-sum-exp [n] f32, target logit [n] f32) of logits = h [n, d] @ w [d, V] (same dtype; f32
    accumulation). targets [n] int; one outside [0, V) gives target logit 0."""
    (n, d), v = h.shape, w.shape[1]
    t = fit_tiles(n, v, d, tiles, h.dtype.itemsize)
    tm, tv = t.fwd_tokens, t.fwd_vocab
    np_, vp = _round_up(n, tm), _round_up(v, tv)
    interpret = pallas_interpret(interpret)
    vector = pl.BlockSpec((tm, 1), lambda i, j: (i, 0))
    cost = pl.CostEstimate(flops=2 * np_ * d * vp, transcendentals=np_ * vp,
                           bytes_accessed=traffic_bytes(n, d, v, h.dtype.itemsize, t)["forward"])
    lse, target_logit = pl.pallas_call(
        functools.partial(_stats_kernel, tv=tv, vocab=v),
        grid=(np_ // tm, vp // tv),
        in_specs=[vector, pl.BlockSpec((tm, d), lambda i, j: (i, 0)), pl.BlockSpec((d, tv), lambda i, j: (0, j))],
        out_specs=[vector, vector],
        out_shape=[jax.ShapeDtypeStruct((np_, 1), jnp.float32)] * 2,
        scratch_shapes=[pltpu.VMEM((tm, 1), jnp.float32)] * 3,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=_vmem_limit(interpret)),
        cost_estimate=cost, interpret=interpret, name="fused_ce_forward",
    )(_pad(_targets_in_range(targets, v)[:, None], (np_, 1)), _pad(h, (np_, d)), _pad(w, (d, vp)))
    return lse[:n, 0], target_logit[:n, 0]


def _grads_kernel(tile_ref, vectors_ref, h_ref, w_ref, *refs, tv, vocab, splits, accumulate):
    dh_prev_ref, dh_ref, dw_ref = refs if accumulate else (None,) + refs
    s, i = pl.program_id(0), pl.program_id(1)
    h, w = h_ref[...], w_ref[...]
    logits, cols = _masked_logits(h, w, (tile_ref[0] * splits + s) * tv, vocab)
    per_token = vectors_ref[...].T  # [8, tm] -> [tm, 8]: target, lse, a, c
    targets, lse, a, c = (per_token[:, k:k + 1] for k in range(4))
    probs = jnp.exp(logits - lse)  # 0 in padded columns
    dlogits = probs * a - jnp.where(cols == targets.astype(jnp.int32), c, 0.0)
    dlogits = dlogits.astype(h.dtype)
    dh = jax.lax.dot_general(  # [tm, tv] x [d, tv] -> [tm, d]
        dlogits, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dh_ref[0] = dh_prev_ref[0] + dh if accumulate else dh

    @pl.when(i == 0)
    def _init():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    dw_ref[...] += jax.lax.dot_general(  # [tm, d] x [tm, tv] -> [d, tv]
        h, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def token_grads(h: jax.Array, w: jax.Array, targets: jax.Array, lse: jax.Array, a: jax.Array, c: jax.Array,
                *, tiles: Tiles | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(dh [n, d] f32, dw [d, V] f32): gradients of sum(dlogits * (h @ w)) with dlogits = a * softmax -
    c * onehot(targets) per token (module docstring). h [n, d], w [d, V] same dtype; targets [n] int;
    lse, a, c [n] f32 (lse from `token_stats`, over the whole vocabulary when w is a shard of it).

    One kernel per group of `splits` vocabulary tiles (grid: splits "parallel", token tiles "arbitrary"),
    the first alone and the others in a `fori_loop`: it adds the group's terms to the dh partials
    [splits, n, d] f32 in place (the partials are an input aliased to the output; each block is read and
    written once per kernel) and writes the group's dw columns [d, splits * tv], each block accumulated
    over all token tiles in VMEM, into dw.
    """
    (n, d), v = h.shape, w.shape[1]
    t = fit_tiles(n, v, d, tiles, h.dtype.itemsize)
    tm, tv = t.bwd_tokens, t.bwd_vocab
    np_, vp = _round_up(n, tm), _round_up(v, tv)
    n_vocab_tiles = vp // tv
    splits = t.splits if t.splits > 0 and n_vocab_tiles % t.splits == 0 else 1
    interpret = pallas_interpret(interpret)
    vectors = pl.BlockSpec((VECTORS, tm), lambda s, i, g: (0, i))
    rows = pl.BlockSpec((1, tm, d), lambda s, i, g: (s, i, 0))
    cost = pl.CostEstimate(flops=6 * np_ * d * tv * splits, transcendentals=np_ * tv * splits,
                           bytes_accessed=traffic_bytes(n, d, v, h.dtype.itemsize, t)["backward"]
                           * splits // n_vocab_tiles)

    def group(accumulate):
        return pl.pallas_call(
            functools.partial(_grads_kernel, tv=tv, vocab=v, splits=splits, accumulate=accumulate),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(splits, np_ // tm),
                in_specs=[vectors, pl.BlockSpec((tm, d), lambda s, i, g: (i, 0)),
                          pl.BlockSpec((d, tv), lambda s, i, g: (0, g[0] * splits + s))] + [rows] * accumulate,
                out_specs=[rows, pl.BlockSpec((d, tv), lambda s, i, g: (0, s))]),
            out_shape=[jax.ShapeDtypeStruct((splits, np_, d), jnp.float32),
                       jax.ShapeDtypeStruct((d, splits * tv), jnp.float32)],
            input_output_aliases={4: 0} if accumulate else {},
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                                 vmem_limit_bytes=_vmem_limit(interpret)),
            cost_estimate=cost, interpret=interpret, name="fused_ce_backward")

    packed = jnp.stack([_targets_in_range(targets, v).astype(jnp.float32), lse, a, c])  # ids < 2**24 exact
    packed = _pad(packed.astype(jnp.float32), (VECTORS, np_))
    h, w = _pad(h, (np_, d)), _pad(w, (d, vp))
    index = lambda g: jnp.reshape(g, (1,)).astype(jnp.int32)  # noqa: E731

    def body(g, carry):
        dh, dw = carry
        dh, dw_group = group(True)(index(g), packed, h, w, dh)
        return dh, jax.lax.dynamic_update_slice(dw, dw_group, (0, g * splits * tv))

    dh, dw_first = group(False)(index(0), packed, h, w)
    dw = jax.lax.dynamic_update_slice(jnp.zeros((d, vp), jnp.float32), dw_first, (0, 0))
    dh, dw = jax.lax.fori_loop(1, n_vocab_tiles // splits, body, (dh, dw))
    return dh.sum(axis=0)[:n], dw[:, :v]

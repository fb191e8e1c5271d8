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
a = g m (1 + 2 z lse) and c = g m. Vocabulary blocks outer (one kernel per group of `splits` blocks, a
`fori_loop` over the groups), token tiles inner: each [d, tv] block of w and of dw stays resident in
VMEM over all token tiles, so dw is accumulated in float32 on chip and written to HBM once; each step
walks the block in [tm, bwd_sub] logits sub-tiles; dh [n, d] float32 is accumulated over vocabulary
blocks by reading and writing its token tile (an input aliased to the output). `splits` cuts the
vocabulary blocks into that many independent halves with their own dh partials (summed at the end), so
a megacore chip (v4, v5p) runs both TensorCores.

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

KERNEL_PREFIX = "fused_ce"  # its pallas_calls' names (compile/program_flops.py counts them apart)

VECTORS = 8  # rows of the backward's packed per-token inputs [8, n] f32 (lane-dense: 32 B a token)
V5P_VMEM = 64 * 2**20  # a v5p core's VMEM (`pltpu.get_tpu_info`); the tiles' reference when interpreting


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes, multiples of 8 (tokens) and 128 (vocabulary); shrunk to the input by `fit_tiles`.
    forward: (fwd_tokens, fwd_vocab) blocks. backward: (bwd_tokens, bwd_vocab) blocks, the vocabulary
    block walked in sub-tiles of bwd_sub columns inside the kernel; splits: independent vocabulary
    halves (megacore), 1 when they do not divide the vocabulary blocks."""

    fwd_tokens: int = 2048
    fwd_vocab: int = 512
    bwd_tokens: int = 256
    bwd_vocab: int = 8192
    splits: int = 2
    bwd_sub: int = 1024


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _resident_vocab(d: int, itemsize: int, tokens: int, sub: int, vmem_bytes: int) -> int:
    """The largest power-of-two backward vocabulary block (512 to 16384) whose resident blocks, w [d, tv]
    (itemsize bytes) and the dw accumulator [d, tv] f32, both single-buffered, fit the scoped VMEM limit
    (3/4 of the core's) beside the per-token blocks (~32 bytes a token x d: h, dh in and out, the dh
    accumulator), the f32 temporaries of a [tokens, sub] sub-tile (~24 bytes a logit) and 2 MiB."""
    d8 = _round_up(d, 8)
    room = vmem_bytes * 3 // 4 - tokens * d8 * 32 - tokens * sub * 24 - 2 * 2**20
    tv = 16384
    while tv > 512 and d8 * tv * (4 + itemsize) > room:
        tv //= 2
    return tv


def default_tiles(d: int, itemsize: int = 2, vmem_bytes: int = V5P_VMEM) -> Tiles:
    """Tiles for width d: the backward's vocabulary block as large as VMEM allows (`_resident_vocab`;
    bf16 on v5p: d 672 -> 8192, d 1280 -> 4096, d 1792 -> 2048, d 2304 -> 2048 with 128-token tiles),
    its token tile 256, or 128 where that buys a larger block. Chips of < 64 MiB VMEM (v4) get smaller
    forward token tiles."""
    sub = 1024
    tokens, tv = max(((t, _resident_vocab(d, itemsize, t, sub, vmem_bytes)) for t in (256, 128)),
                     key=lambda pair: (pair[1], pair[0]))
    small = vmem_bytes < V5P_VMEM
    return Tiles(fwd_tokens=512 if small else 2048, bwd_tokens=tokens, bwd_vocab=tv, bwd_sub=min(sub, tv))


def fit_tiles(n: int, v: int, d: int, tiles: Tiles | None = None, itemsize: int = 2,
              vmem_bytes: int = V5P_VMEM) -> Tiles:
    """`tiles` (default: `default_tiles(d, itemsize, vmem_bytes)`) shrunk so no tile exceeds the
    (8, 128)-rounded input; bwd_vocab a multiple of bwd_sub. For Mosaic, bwd_tokens must be a multiple
    of 128 or cover all tokens."""
    t = tiles or default_tiles(d, itemsize, vmem_bytes)
    n8, v128 = _round_up(max(n, 1), 8), _round_up(max(v, 1), 128)
    sub = min(t.bwd_sub, t.bwd_vocab, v128)
    return dataclasses.replace(t, fwd_tokens=min(t.fwd_tokens, n8), fwd_vocab=min(t.fwd_vocab, v128),
                               bwd_tokens=min(t.bwd_tokens, n8),
                               bwd_vocab=_round_up(min(t.bwd_vocab, v128), sub), bwd_sub=sub)


def traffic_bytes(n: int, d: int, v: int, itemsize: int, tiles: Tiles | None = None) -> dict[str, int]:
    """HBM bytes each kernel moves, block re-reads included (padded sizes; per-token vectors as [n, 1]
    f32 padded to 128 lanes in the forward, packed [8, n] in the backward). forward: w once per token
    tile, h once; backward: h once per vocabulary block, dh f32 read and written once per vocabulary
    block, w read and dw written once. Default tiles: v5p's."""
    t = fit_tiles(n, v, d, tiles, itemsize)
    nf, vf = _round_up(n, t.fwd_tokens), _round_up(v, t.fwd_vocab)
    nb, vb = _round_up(n, t.bwd_tokens), _round_up(v, t.bwd_vocab)
    vec = 128 * 4  # one token's lane-padded scalar
    forward = (nf // t.fwd_tokens) * d * vf * itemsize + nf * d * itemsize + 3 * nf * vec
    backward = ((vb // t.bwd_vocab) * (nb * d * itemsize + 2 * nb * d * 4 + VECTORS * nb * 4)
                + d * vb * itemsize + d * vb * 4)
    return {"forward": forward, "backward": backward}


def _vmem_bytes(interpret: bool) -> int:
    """The traced-for core's VMEM (V5P_VMEM when interpreting)."""
    return V5P_VMEM if interpret else int(pltpu.get_tpu_info().vmem_capacity_bytes)


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
    interpret = pallas_interpret(interpret)
    vmem = _vmem_bytes(interpret)
    t = fit_tiles(n, v, d, tiles, h.dtype.itemsize, vmem)
    tm, tv = t.fwd_tokens, t.fwd_vocab
    np_, vp = _round_up(n, tm), _round_up(v, tv)
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
                                             vmem_limit_bytes=vmem * 3 // 4),
        cost_estimate=cost, interpret=interpret, name=f"{KERNEL_PREFIX}_forward",
    )(_pad(_targets_in_range(targets, v)[:, None], (np_, 1)), _pad(h, (np_, d)), _pad(w, (d, vp)))
    return lse[:n, 0], target_logit[:n, 0]


def _grads_kernel(tile_ref, vectors_ref, h_ref, w_ref, *refs, tv, sub, vocab, splits, accumulate):
    dh_prev_ref, dh_ref, dw_ref = refs if accumulate else (None,) + refs
    s, i = pl.program_id(0), pl.program_id(1)
    h = h_ref[...]
    per_token = vectors_ref[...].T  # [8, tm] -> [tm, 8]: target, lse, a, c
    targets, lse, a, c = (per_token[:, k:k + 1] for k in range(4))
    targets = targets.astype(jnp.int32)
    col0 = (tile_ref[0] * splits + s) * tv

    @pl.when(i == 0)
    def _init():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    def sub_tile(k, dh):  # columns [k * sub, (k + 1) * sub) of the resident w and dw blocks
        start = pl.multiple_of(k * sub, sub)
        w = w_ref[:, pl.ds(start, sub)]
        logits, cols = _masked_logits(h, w, col0 + start, vocab)
        probs = jnp.exp(logits - lse)  # 0 in padded columns
        dlogits = (probs * a - jnp.where(cols == targets, c, 0.0)).astype(h.dtype)
        dw_ref[:, pl.ds(start, sub)] += jax.lax.dot_general(  # [tm, d] x [tm, sub] -> [d, sub]
            h, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dh + jax.lax.dot_general(  # [tm, sub] x [d, sub] -> [tm, d]
            dlogits, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    dh = jax.lax.fori_loop(0, tv // sub, sub_tile, jnp.zeros((h.shape[0], h.shape[1]), jnp.float32))
    dh_ref[0] = dh_prev_ref[0] + dh if accumulate else dh


def token_grads(h: jax.Array, w: jax.Array, targets: jax.Array, lse: jax.Array, a: jax.Array, c: jax.Array,
                *, tiles: Tiles | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(dh [n, d] f32, dw [d, V] f32): gradients of sum(dlogits * (h @ w)) with dlogits = a * softmax -
    c * onehot(targets) per token (module docstring). h [n, d], w [d, V] same dtype; targets [n] int;
    lse, a, c [n] f32 (lse from `token_stats`, over the whole vocabulary when w is a shard of it).

    One kernel per group of `splits` vocabulary blocks (grid: splits "parallel", token tiles "arbitrary"),
    the first alone and the others in a `fori_loop`: it adds the group's terms to the dh partials
    [splits, n, d] f32 in place (the partials are an input aliased to the output; each block is read and
    written once per kernel) and writes the group's dw columns [d, splits * tv], each block accumulated
    over all token tiles in VMEM, into dw. The w and dw blocks stay resident over the token tiles
    (single-buffered); each step walks them in sub-tiles of bwd_sub columns, so the f32 temporaries are
    [tm, bwd_sub] however large the block (a larger block: fewer passes over h and dh).
    """
    (n, d), v = h.shape, w.shape[1]
    interpret = pallas_interpret(interpret)
    vmem = _vmem_bytes(interpret)
    t = fit_tiles(n, v, d, tiles, h.dtype.itemsize, vmem)
    tm, tv = t.bwd_tokens, t.bwd_vocab
    np_, vp = _round_up(n, tm), _round_up(v, tv)
    n_vocab_tiles = vp // tv
    splits = t.splits if t.splits > 0 and n_vocab_tiles % t.splits == 0 else 1
    vectors = pl.BlockSpec((VECTORS, tm), lambda s, i, g: (0, i))
    rows = pl.BlockSpec((1, tm, d), lambda s, i, g: (s, i, 0))
    once = pl.Buffered(1)  # the w and dw blocks change only with the split: no second buffer
    cost = pl.CostEstimate(flops=6 * np_ * d * tv * splits, transcendentals=np_ * tv * splits,
                           bytes_accessed=traffic_bytes(n, d, v, h.dtype.itemsize, t)["backward"]
                           * splits // n_vocab_tiles)

    def group(accumulate):
        return pl.pallas_call(
            functools.partial(_grads_kernel, tv=tv, sub=t.bwd_sub, vocab=v, splits=splits,
                              accumulate=accumulate),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(splits, np_ // tm),
                in_specs=[vectors, pl.BlockSpec((tm, d), lambda s, i, g: (i, 0)),
                          pl.BlockSpec((d, tv), lambda s, i, g: (0, g[0] * splits + s), pipeline_mode=once)]
                + [rows] * accumulate,
                out_specs=[rows, pl.BlockSpec((d, tv), lambda s, i, g: (0, s), pipeline_mode=once)]),
            out_shape=[jax.ShapeDtypeStruct((splits, np_, d), jnp.float32),
                       jax.ShapeDtypeStruct((d, splits * tv), jnp.float32)],
            input_output_aliases={4: 0} if accumulate else {},
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                                 vmem_limit_bytes=vmem * 3 // 4),
            cost_estimate=cost, interpret=interpret, name=f"{KERNEL_PREFIX}_backward")

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

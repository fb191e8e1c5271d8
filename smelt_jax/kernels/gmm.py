"""Pallas grouped matmul for rows sorted by expert (TPU Mosaic lowering; interpret mode elsewhere).

    gmm(lhs [m, k], rhs [G, k, n], group_sizes [G], row_weight=None | [m]) -> [m, n]
        out[r] = lhs[r] @ rhs[g(r)] for the rows r of group g (groups are consecutive row ranges, in order);
        rows beyond sum(group_sizes) give 0. With row_weight, out[r] = row_weight[r] * (lhs[r] @ rhs[g(r)]),
        the weight applied to the f32 accumulator in the epilogue; its backward computes the weight's
        gradient, row_weight[r]'s = grad[r] . (lhs[r] @ rhs[g(r)]) = lhs[r] . (grad[r] @ rhs[g(r)].T), in
        the epilogue of the kernel that computes d lhs (which reads lhs as a row input), and the weight
        gradient of rhs from the rows of grad scaled by row_weight inside the kernel: no [m, n] array of
        weighted rows is ever written (the MoE combine, issue 50 item 3).
    tgmm(lhs [m, k], grad [m, n], group_sizes [G]) -> [G, k, n]
        out[g] = lhs[rows of g].T @ grad[rows of g]; an empty group gives 0. (The weight gradient of gmm.)

Both share two kernel engines, also used by the fused SwiGLU kernels in `swiglu.py`:

* `grouped_matmul_call`: grid (n tiles, visits, k tiles). A *visit* is one (group, row tile) pair whose rows
  overlap; visits are listed in row order, so a row tile shared by two groups is visited twice in a row and
  its output block stays in VMEM between the two visits (each visit writes only its own group's rows). Rows
  past the last group form a pseudo-group whose visits only write zeros. Several matmuls may share the
  grid (one f32 accumulator each) and an epilogue combines them on the last k step (e.g. silu(g) * u). The
  epilogue may read per-row scales ([m] f32, read as lane-dense [tm] blocks: an [m, 1] array would be laid
  out with its one lane padded to 128) and return per-row f32 results (e.g. a row sum), written per n tile.
* `grouped_transposed_call`: grid (k tiles, n tiles, visits); the [tk, tn] accumulator of a group is zeroed
  at the group's first visit and stored at its last; rows outside the group are masked to zero (and the
  rows of grad optionally scaled by a per-row weight).

The per-visit group and tile ids, and the row range of every group, are computed once per call by
`make_group_metadata` (a small pure jnp function) and passed as scalar-prefetch operands (SMEM), so the
block index maps can read them. The number of visits is data dependent and is the grid's middle extent.

Shapes that are not tile multiples are zero padded in the wrappers (padding rows sit past the groups, so
they come out as zeros and are sliced off; padded k columns multiply zeros).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from smelt_jax.kernels.backend import pallas_interpret
from smelt_jax.kernels.gmm_tiles import (
    Tiling,
    check_dtype,
    check_group_sizes,
    effective_tiling,
    pad_to,
    round_up,
)

# ------------------------------------------------------------------------------------ group metadata


class GroupMetadata(NamedTuple):
    """Scalar-prefetch operands (all int32) describing which (group, row tile) pairs the grid visits.

    group_starts, group_ends: [R] the row range of each group (R = G, or G + 1 with the tail pseudo-group
        that covers rows past sum(group_sizes)); ranges are clipped to the rows that exist.
    visit_group, visit_tile: [tiles_m + R - 1] group and row tile of each visit (entries past
        num_visits are padding and never run).
    num_visits: [] how many visits run (the grid extent).
    """

    group_starts: jax.Array
    group_ends: jax.Array
    visit_group: jax.Array
    visit_tile: jax.Array
    num_visits: jax.Array


def make_group_metadata(group_sizes: jax.Array, num_rows: int, row_tile: int, *,
                        visit_empty_groups: bool, cover_tail: bool) -> GroupMetadata:
    """Visit list for rows sorted by group; `num_rows` must be a multiple of `row_tile`.

    A non-empty group visits every row tile its rows touch; an empty group visits one tile when
    `visit_empty_groups` (tgmm must still write its zero gradient) and none otherwise. Visits are in row
    order, so revisits of a row tile are consecutive. The bound on their number: the non-empty groups tile
    [0, num_rows) with at most one shared tile per boundary, so visits <= tiles_m + R - 1.
    """
    if num_rows % row_tile:
        raise ValueError(f"num_rows={num_rows} must be a multiple of row_tile={row_tile}")
    tiles_m = num_rows // row_tile
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    if cover_tail:
        starts = jnp.concatenate([starts, ends[-1:]])
        ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    num_ranges = starts.shape[0]
    nonempty = ends > starts
    first_tile = jnp.minimum(starts // row_tile, tiles_m - 1)
    last_tile = (ends - 1) // row_tile
    visits_per_group = jnp.where(nonempty, last_tile - first_tile + 1, 1 if visit_empty_groups else 0)
    visit_end = jnp.cumsum(visits_per_group).astype(jnp.int32)
    visit_begin = visit_end - visits_per_group

    max_visits = tiles_m + num_ranges - 1
    visit_ids = jnp.arange(max_visits, dtype=jnp.int32)
    visit_group = jnp.minimum(jnp.searchsorted(visit_end, visit_ids, side="right"), num_ranges - 1)
    visit_group = visit_group.astype(jnp.int32)
    visit_tile = first_tile[visit_group] + visit_ids - visit_begin[visit_group]
    visit_tile = jnp.clip(visit_tile, 0, tiles_m - 1).astype(jnp.int32)
    return GroupMetadata(starts, ends, visit_group, visit_tile, visit_end[-1])


def _check_row_blocks(tm: int, rows: int | None, *, interpret: bool) -> None:
    """Mosaic takes a 1-D block of a per-row array (row scales, per-row outputs) only when it is a
    multiple of 128 lanes or the whole array (`rows`; None: no block is the whole array): tm must be one
    or the other where the kernel compiles."""
    if not interpret and tm % 128 and tm != rows:
        raise ValueError(f"per-row inputs or outputs need a row tile that is a multiple of 128 or all "
                         f"{rows} rows for Mosaic; got tm={tm} (use the default tiling)")


# ------------------------------------------------------------------------------------ engine: m x k @ k x n


Epilogue = Callable[[Sequence[jax.Array], Sequence[jax.Array]], Sequence[jax.Array]]


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
    """Static description of one `grouped_matmul_call` (hashable, so it can sit in nondiff args).

    products: (lhs index, rhs index, accumulator index) triples; each adds lhs_tile @ rhs_tile to an f32
        accumulator of shape [tm, tn].
    epilogue: f(accumulators, row_inputs, row_scales) -> outputs, applied on the last k step: accumulators
        and row inputs [tm, tn] float32, row scales [tm, 1] float32; the outputs are the [tm, tn] results
        (one per out dtype) followed by `row_outputs` [tm, 1] float32 per-row results.
    row_outputs: per-row results of the epilogue, each returned as [tiles_n, m] float32 (one column per n
        tile: a sum over n is the caller's, over the tiles).
    transcendentals_per_output: for the cost estimate (e.g. 1 for the sigmoid in SwiGLU).
    """

    products: tuple[tuple[int, int, int], ...]
    num_accumulators: int
    epilogue: Epilogue
    transpose_rhs: bool = False
    row_outputs: int = 0
    transcendentals_per_output: int = 0


def identity_epilogue(accumulators, row_inputs, row_scales):
    del row_inputs, row_scales
    return tuple(accumulators)


def _vmem_limit(estimate_bytes: int, interpret: bool) -> int | None:
    """Scoped VMEM limit: the estimate with headroom, at least 32 MiB, at most 3/4 of the core's VMEM."""
    if interpret:
        return None
    capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    return int(min(max(2 * estimate_bytes, 32 * 2**20), capacity * 3 // 4))


def grouped_matmul_call(lhs_list: Sequence[jax.Array], rhs_list: Sequence[jax.Array],
                        row_inputs: Sequence[jax.Array], group_sizes: jax.Array, *, plan: MatmulPlan,
                        out_dtypes: Sequence[jnp.dtype], tiling: Tiling, interpret: bool,
                        row_scales: Sequence[jax.Array] = ()) -> list[jax.Array]:
    """Run the grouped-matmul engine on tile-aligned operands.

    lhs_list: each [m, K]; rhs_list: each [G, K, N] ([G, N, K] when plan.transpose_rhs); row_inputs: each
    [m, N], read on the last k step for the epilogue; row_scales: each [m] float32, read there too. m, K, N
    must be multiples of (tm, tk, tn) or equal to the tile. Returns one [m, N] array per dtype in
    out_dtypes, then plan.row_outputs [N // tn, m] float32 arrays; rows outside every group are 0.
    """
    tm, tk, tn = tiling
    m, k_dim = lhs_list[0].shape
    num_groups = rhs_list[0].shape[0]
    n_dim = rhs_list[0].shape[1] if plan.transpose_rhs else rhs_list[0].shape[2]
    if m % tm or k_dim % tk or n_dim % tn:
        raise ValueError(f"operands ({m}, {k_dim}, {n_dim}) are not multiples of the tiles {tiling}")
    tiles_n, tiles_k = n_dim // tn, k_dim // tk
    meta = make_group_metadata(group_sizes, m, tm, visit_empty_groups=False, cover_tail=True)
    num_lhs, num_rhs, num_rows, num_out = len(lhs_list), len(rhs_list), len(row_inputs), len(out_dtypes)
    num_scales, num_row_out = len(row_scales), plan.row_outputs
    if num_scales or num_row_out:  # a per-row output is one flat [tiles_n * m] array: whole only at 1 tile
        _check_row_blocks(tm, m if num_row_out == 0 or tiles_n == 1 else None, interpret=interpret)

    def k_block(v, k_i, visit_group):
        # Tail visits compute nothing: pin k to block 0 so their operand blocks are fetched once.
        return jnp.where(visit_group[v] < num_groups, k_i, 0)

    def lhs_map(n_i, v, k_i, starts, ends, visit_group, visit_tile):
        return visit_tile[v], k_block(v, k_i, visit_group)

    def rhs_map(n_i, v, k_i, starts, ends, visit_group, visit_tile):
        group = jnp.minimum(visit_group[v], num_groups - 1)
        k_b = k_block(v, k_i, visit_group)
        return (group, n_i, k_b) if plan.transpose_rhs else (group, k_b, n_i)

    def row_map(n_i, v, k_i, starts, ends, visit_group, visit_tile):
        return visit_tile[v], n_i

    def scale_map(n_i, v, k_i, starts, ends, visit_group, visit_tile):
        return (visit_tile[v],)

    def row_out_map(n_i, v, k_i, starts, ends, visit_group, visit_tile):
        return (n_i * (m // tm) + visit_tile[v],)  # flat [tiles_n * m]: a 1-D block needs no sublane rule

    rhs_block = (None, tn, tk) if plan.transpose_rhs else (None, tk, tn)
    contract = (((1,), (1,)), ((), ())) if plan.transpose_rhs else (((1,), (0,)), ((), ()))

    def kernel(starts, ends, visit_group, visit_tile, *refs):
        refs = iter(refs)
        lhs_refs, rhs_refs, row_refs, scale_refs, out_refs, row_out_refs, acc_refs = (
            [next(refs) for _ in range(count)] for count in
            (num_lhs, num_rhs, num_rows, num_scales, num_out, num_row_out, plan.num_accumulators))
        v, k_i = pl.program_id(1), pl.program_id(2)
        group = visit_group[v]
        tile = visit_tile[v]
        first_visit_of_tile = jnp.logical_or(v == 0, tile != visit_tile[jnp.maximum(v - 1, 0)])

        @pl.when(jnp.logical_and(k_i == 0, first_visit_of_tile))
        def _zero_outputs():
            for out_ref in out_refs + row_out_refs:
                out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

        @pl.when(group < num_groups)
        def _compute():
            @pl.when(k_i == 0)
            def _zero_accumulators():
                for acc_ref in acc_refs:
                    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

            for lhs_i, rhs_i, acc_i in plan.products:
                acc_refs[acc_i][...] += jax.lax.dot_general(
                    lhs_refs[lhs_i][...], rhs_refs[rhs_i][...], contract,
                    preferred_element_type=jnp.float32)

            @pl.when(k_i == tiles_k - 1)
            def _store():
                rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
                in_group = jnp.logical_and(rows >= starts[group], rows < ends[group])  # [tm, 1]
                results = plan.epilogue([acc[...] for acc in acc_refs],
                                        [ref[...].astype(jnp.float32) for ref in row_refs],
                                        [ref[...].reshape(tm, 1) for ref in scale_refs])
                for out_ref, result in zip(out_refs + row_out_refs, results):
                    kept = out_ref[...].astype(jnp.float32).reshape(result.shape)
                    out_ref[...] = jnp.where(in_group, result, kept).reshape(out_ref.shape).astype(out_ref.dtype)

    in_itemsize = sum(x.dtype.itemsize for x in lhs_list) * tm * tk + \
        sum(w.dtype.itemsize for w in rhs_list) * tk * tn + sum(r.dtype.itemsize for r in row_inputs) * tm * tn \
        + 4 * tm * num_scales
    out_itemsize = sum(jnp.dtype(d).itemsize for d in out_dtypes) * tm * tn + 4 * tm * num_row_out
    vmem_estimate = 2 * (in_itemsize + out_itemsize) + 4 * tm * tn * plan.num_accumulators
    flops = 2 * m * k_dim * n_dim * len(plan.products)
    bytes_accessed = (sum(x.size * x.dtype.itemsize for x in lhs_list) * tiles_n
                      + sum(w.size * w.dtype.itemsize for w in rhs_list)
                      + sum(r.size * r.dtype.itemsize for r in row_inputs)
                      + 4 * m * (num_scales + num_row_out) * tiles_n
                      + sum(m * n_dim * jnp.dtype(d).itemsize for d in out_dtypes))
    call = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((m, n_dim), d) for d in out_dtypes]
        + [jax.ShapeDtypeStruct((tiles_n * m,), jnp.float32) for _ in range(num_row_out)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(tiles_n, meta.num_visits, tiles_k),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map) for _ in lhs_list]
            + [pl.BlockSpec(rhs_block, rhs_map) for _ in rhs_list]
            + [pl.BlockSpec((tm, tn), row_map) for _ in row_inputs]
            + [pl.BlockSpec((tm,), scale_map) for _ in row_scales],
            out_specs=[pl.BlockSpec((tm, tn), row_map) for _ in out_dtypes]
            + [pl.BlockSpec((tm,), row_out_map) for _ in range(num_row_out)],
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32) for _ in range(plan.num_accumulators)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=_vmem_limit(vmem_estimate, interpret)),
        cost_estimate=pl.CostEstimate(
            flops=flops, bytes_accessed=bytes_accessed,
            transcendentals=m * n_dim * num_out * plan.transcendentals_per_output),
        interpret=interpret,
    )
    outputs = call(meta.group_starts, meta.group_ends, meta.visit_group, meta.visit_tile,
                   *lhs_list, *rhs_list, *row_inputs, *row_scales)
    return list(outputs[:num_out]) + [out.reshape(tiles_n, m) for out in outputs[num_out:]]


# ------------------------------------------------------------------------------ engine: k x m @ m x n


def grouped_transposed_call(lhs: jax.Array, grads: Sequence[jax.Array], group_sizes: jax.Array, *,
                            out_dtype: jnp.dtype, tiling: Tiling, interpret: bool,
                            row_scale: jax.Array | None = None) -> list[jax.Array]:
    """out_j[g] = lhs[rows of g].T @ grads_j[rows of g] for each grad; lhs [m, K], grads [m, N] -> [G, K, N].
    With row_scale [m] float32, each row of the grads is scaled by it first (in f32, inside the kernel).

    Operands must be tile aligned (m % tm == 0, K % tk == 0, N % tn == 0, or equal to the tile). Rows past
    sum(group_sizes) are ignored; empty groups give zeros.
    """
    tm, tk, tn = tiling
    m, k_dim = lhs.shape
    n_dim = grads[0].shape[1]
    num_groups = group_sizes.shape[0]
    if m % tm or k_dim % tk or n_dim % tn:
        raise ValueError(f"operands ({m}, {k_dim}, {n_dim}) are not multiples of the tiles {tiling}")
    tiles_k, tiles_n = k_dim // tk, n_dim // tn
    meta = make_group_metadata(group_sizes, m, tm, visit_empty_groups=True, cover_tail=False)
    num_grads = len(grads)
    scales = [] if row_scale is None else [row_scale]
    if scales:
        _check_row_blocks(tm, m, interpret=interpret)

    def lhs_map(k_i, n_i, v, starts, ends, visit_group, visit_tile):
        return visit_tile[v], k_i

    def grad_map(k_i, n_i, v, starts, ends, visit_group, visit_tile):
        return visit_tile[v], n_i

    def out_map(k_i, n_i, v, starts, ends, visit_group, visit_tile):
        return visit_group[v], k_i, n_i

    def scale_map(k_i, n_i, v, starts, ends, visit_group, visit_tile):
        return (visit_tile[v],)

    def kernel(starts, ends, visit_group, visit_tile, lhs_ref, *refs):
        grad_refs = refs[:num_grads]
        scale_refs = refs[num_grads:num_grads + len(scales)]
        out_refs = refs[num_grads + len(scales):2 * num_grads + len(scales)]
        acc_refs = refs[2 * num_grads + len(scales):]
        v = pl.program_id(2)
        last = pl.num_programs(2) - 1
        group = visit_group[v]
        group_begins = jnp.logical_or(v == 0, group != visit_group[jnp.maximum(v - 1, 0)])
        group_ends = jnp.logical_or(v == last, group != visit_group[jnp.minimum(v + 1, last)])

        @pl.when(group_begins)
        def _zero_accumulators():
            for acc_ref in acc_refs:
                acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(ends[group] > starts[group])
        def _compute():
            first_row = visit_tile[v] * tm

            def rows_of_group(x, scale=None):
                # Mask in f32 (v5e has no bf16 VPU); rows of other groups and padding must not contribute.
                rows = first_row + jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
                keep = jnp.logical_and(rows >= starts[group], rows < ends[group])
                x = x.astype(jnp.float32) if scale is None else x.astype(jnp.float32) * scale
                return jnp.where(keep, x, 0.0)

            lhs_t = rows_of_group(lhs_ref[...]).T.astype(lhs_ref.dtype)  # [tk, tm]
            scale = scale_refs[0][...].reshape(tm, 1) if scale_refs else None
            for grad_ref, acc_ref in zip(grad_refs, acc_refs):
                acc_ref[...] += jnp.dot(lhs_t, rows_of_group(grad_ref[...], scale).astype(grad_ref.dtype),
                                        preferred_element_type=jnp.float32)

        @pl.when(group_ends)
        def _store():
            for out_ref, acc_ref in zip(out_refs, acc_refs):
                out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    out_bytes = jnp.dtype(out_dtype).itemsize
    vmem_estimate = 2 * (tm * tk * lhs.dtype.itemsize + sum(tm * tn * g.dtype.itemsize for g in grads)
                         + 4 * tm * len(scales) + num_grads * tk * tn * out_bytes) + num_grads * tk * tn * 4 + 4 * tm * tk
    call = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((num_groups, k_dim, n_dim), out_dtype) for _ in grads],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(tiles_k, tiles_n, meta.num_visits),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map)] + [pl.BlockSpec((tm, tn), grad_map) for _ in grads]
            + [pl.BlockSpec((tm,), scale_map) for _ in scales],
            out_specs=[pl.BlockSpec((None, tk, tn), out_map) for _ in grads],
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32) for _ in grads],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=_vmem_limit(vmem_estimate, interpret)),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k_dim * n_dim * num_grads,
            bytes_accessed=lhs.size * lhs.dtype.itemsize * tiles_n
            + sum(g.size * g.dtype.itemsize for g in grads) * tiles_k + 4 * m * len(scales) * tiles_k * tiles_n
            + num_grads * num_groups * k_dim * n_dim * out_bytes,
            transcendentals=0),
        interpret=interpret,
    )
    return list(call(meta.group_starts, meta.group_ends, meta.visit_group, meta.visit_tile, lhs, *grads, *scales))


# ------------------------------------------------------------------------------------------ gmm / tgmm

_GMM_PLAN = MatmulPlan(products=((0, 0, 0),), num_accumulators=1, epilogue=identity_epilogue)
_GMM_TRANSPOSED_PLAN = dataclasses.replace(_GMM_PLAN, transpose_rhs=True)


def _weighted_epilogue(accumulators, row_inputs, row_scales):
    del row_inputs
    (acc,), (weight,) = accumulators, row_scales
    return (acc * weight,)


def _weighted_input_grad_epilogue(accumulators, row_inputs, row_scales):
    """acc = grad @ rhs.T (unweighted) -> (d lhs = weight * acc, d weight's part of this n tile =
    sum(lhs * acc) over the tile's columns)."""
    (acc,), (lhs,), (weight,) = accumulators, row_inputs, row_scales
    return acc * weight, jnp.sum(lhs * acc, axis=1, keepdims=True)


_WEIGHTED_PLAN = dataclasses.replace(_GMM_PLAN, epilogue=_weighted_epilogue)
_WEIGHTED_INPUT_GRAD_PLAN = MatmulPlan(products=((0, 0, 0),), num_accumulators=1, transpose_rhs=True,
                                       epilogue=_weighted_input_grad_epilogue, row_outputs=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm_aligned(lhs, rhs, row_weight, group_sizes, tiling, interpret):
    """lhs [m, k] @ rhs[g] per group, times row_weight [m] float32 when it is not None."""
    weighted = row_weight is not None
    (out,) = grouped_matmul_call([lhs], [rhs], [], group_sizes, plan=_WEIGHTED_PLAN if weighted else _GMM_PLAN,
                                 out_dtypes=[lhs.dtype], tiling=tiling, interpret=interpret,
                                 row_scales=[row_weight] if weighted else [])
    return out


def _gmm_aligned_fwd(lhs, rhs, row_weight, group_sizes, tiling, interpret):
    return _gmm_aligned(lhs, rhs, row_weight, group_sizes, tiling, interpret), (lhs, rhs, row_weight, group_sizes)


def _gmm_aligned_bwd(tiling, interpret, residuals, grad_out):
    lhs, rhs, row_weight, group_sizes = residuals
    tm, tk, tn = tiling
    grad_out = grad_out.astype(lhs.dtype)
    # d lhs = grad_out @ rhs[g].T: the same engine with rhs read transposed (contract over n).
    if row_weight is None:
        (grad_lhs,) = grouped_matmul_call([grad_out], [rhs], [], group_sizes, plan=_GMM_TRANSPOSED_PLAN,
                                          out_dtypes=[lhs.dtype], tiling=(tm, tn, tk), interpret=interpret)
        grad_weight = None
    else:  # the weight applied, and its gradient taken, in the epilogue (lhs read as a row input)
        grad_lhs, grad_weight = grouped_matmul_call(
            [grad_out], [rhs], [lhs], group_sizes, plan=_WEIGHTED_INPUT_GRAD_PLAN, out_dtypes=[lhs.dtype],
            tiling=(tm, tn, tk), interpret=interpret, row_scales=[row_weight])
        grad_weight = jnp.sum(grad_weight, axis=0)  # [k tiles, m] -> [m]
    (grad_rhs,) = grouped_transposed_call(lhs, [grad_out], group_sizes, out_dtype=rhs.dtype,
                                          tiling=tiling, interpret=interpret, row_scale=row_weight)
    return grad_lhs, grad_rhs, grad_weight, None


_gmm_aligned.defvjp(_gmm_aligned_fwd, _gmm_aligned_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, row_weight: jax.Array | None = None,
        tiling: Sequence[int] | None = None, interpret: bool | None = None) -> jax.Array:
    """Grouped matmul: out[rows of g] = lhs[rows of g] @ rhs[g]; lhs [m, k], rhs [G, k, n] -> [m, n].

    Rows are sorted by group (group g owns the next group_sizes[g] rows). Rows past sum(group_sizes) give
    0; sizes that overrun m are clipped. Output dtype = lhs dtype (f32 accumulation). row_weight [m]
    (float32): each row's result times its weight, applied to the f32 accumulator before the output is
    rounded (the MoE combine's router weight). Differentiable in lhs, rhs and row_weight.
    tiling=(tm, tk, tn), default per TPU generation (DEFAULT_TILING).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"gmm expects lhs [m, k] and rhs [G, k, n]; got {lhs.shape} and {rhs.shape}")
    check_dtype("lhs", lhs)
    check_dtype("rhs", rhs)
    check_group_sizes(group_sizes, rhs.shape[0])
    m, k = lhs.shape
    n = rhs.shape[2]
    if row_weight is not None and row_weight.shape != (m,):
        raise ValueError(f"row_weight must have shape ({m},) (one weight per row of lhs); got {row_weight.shape}")
    if m == 0:
        return jnp.zeros((0, n), lhs.dtype)
    tm, tk, tn = effective_tiling(m, k, n, tiling)
    mp, kp, np_ = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    weight = None if row_weight is None else pad_to(row_weight.astype(jnp.float32), (mp,))
    out = _gmm_aligned(pad_to(lhs.astype(dtype), (mp, kp)), pad_to(rhs.astype(dtype), (rhs.shape[0], kp, np_)),
                       weight, group_sizes, (tm, tk, tn), pallas_interpret(interpret))
    return out[:m, :n].astype(lhs.dtype)


def tgmm(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *, tiling: Sequence[int] | None = None,
         interpret: bool | None = None) -> jax.Array:
    """Per-group lhs.T @ grad: lhs [m, k], grad [m, n] -> [G, k, n] (the weight gradient of gmm).

    Empty groups give zeros; rows past sum(group_sizes) are ignored. Output dtype = lhs dtype.
    """
    if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"tgmm expects lhs [m, k] and grad [m, n]; got {lhs.shape} and {grad.shape}")
    check_dtype("lhs", lhs)
    check_dtype("grad", grad)
    if group_sizes.ndim != 1 or group_sizes.shape[0] == 0:
        raise ValueError(f"group_sizes must have shape [G] with G >= 1; got {group_sizes.shape}")
    check_group_sizes(group_sizes, group_sizes.shape[0])
    (m, k), n = lhs.shape, grad.shape[1]
    num_groups = group_sizes.shape[0]
    if m == 0:
        return jnp.zeros((num_groups, k, n), lhs.dtype)
    tm, tk, tn = effective_tiling(m, k, n, tiling)
    mp, kp, np_ = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    dtype = jnp.promote_types(lhs.dtype, grad.dtype)
    (out,) = grouped_transposed_call(pad_to(lhs.astype(dtype), (mp, kp)), [pad_to(grad.astype(dtype), (mp, np_))],
                                     group_sizes, out_dtype=lhs.dtype, tiling=(tm, tk, tn),
                                     interpret=pallas_interpret(interpret))
    return out[:, :k, :n]

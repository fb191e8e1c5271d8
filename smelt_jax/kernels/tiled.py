"""The `tiled` expert backend: a dropless grouped matmul in plain XLA that does only the routed work.

    tiled_expert_ffn(x_sorted [m, d], w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d],
                     group_sizes [E], *, tile, capacity) -> [m, d]

Each expert's rows (already contiguous: rows are sorted by expert) are padded up to a multiple of the
row tile, so every tile of `tile` rows belongs to one expert:

1. layout: padded group e starts at row `tile * (tiles before e)`; slot p of the padded buffer holds
   sorted row `start_e + (p - padded_start_e)` when that is inside group e, else zeros;
2. x_tiles [n_tiles, tile, d] = the rows gathered into that layout; tile_expert [n_tiles] = its expert;
3. per-tile weights [n_tiles, d, f] gathered from [E, d, f]; batched einsums over tiles, SwiGLU;
4. the output rows gathered back from the padded layout (padding rows give 0).

n_tiles is static: sum_e ceil(g_e / tile) <= floor((m + E * (tile - 1)) / tile) since sum_e g_e <= m,
and, with a caller bound C >= every g_e, also <= E * ceil(C / tile). FLOPs are those of the routed rows
plus at most tile - 1 padding rows per expert (capacity: E * C rows; dense: E * m rows).

Plain autodiff: the row gathers transpose to scatter-adds and the weight gather to a per-expert sum.
A custom_vjp that made every transpose a gather (the row maps are injective) and summed weight
gradients with a sorted `segment_sum` measured the same (51.9 vs 51.4 ms, fwd+bwd at the issue-17
shape), so it is not kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from smelt_jax.kernels.rows import swiglu

DEFAULT_ROW_TILE = 128  # measured on CPU at the issue-17 configuration (docs/kernels.md)
SMALL_ROW_TILE = 64  # many experts with few rows each: less padding (up to E * (tile - 1) rows)


def default_tile(m: int, n_experts: int) -> int:
    """The row tile for m rows over n_experts: 128 when an expert averages at least 128 rows, else 64.

    Measured on CPU, forward + backward, m = 4096 (docs/kernels.md): 64 is fastest or within 10% of the
    fastest at every micro-suite shape (16-136 experts), 128 at 16 experts of width 256-320.
    """
    return DEFAULT_ROW_TILE if m >= DEFAULT_ROW_TILE * n_experts else SMALL_ROW_TILE


def tile_count(m: int, n_experts: int, tile: int, capacity: int | None = None) -> int:
    """Static upper bound on sum_e ceil(g_e / tile), given sum_e g_e <= m and g_e <= capacity."""
    bound = (m + n_experts * (tile - 1)) // tile
    if capacity is not None:
        bound = min(bound, n_experts * -(-capacity // tile))
    return max(bound, 1)


def row_tile(m: int, tile: int = DEFAULT_ROW_TILE) -> int:
    """The row tile used for m rows: `tile`, or m rounded up to 8 when smaller."""
    return max(8, min(tile, -(-m // 8) * 8))


def tiled_layout(group_sizes: jax.Array, m: int, tile: int, n_tiles: int):
    """Where every row goes.

    Returns (source [n_tiles * tile] int32: the sorted row each padded slot reads, m for empty slots;
    target [m] int32: the padded slot of each sorted row, n_tiles * tile for padding rows;
    tile_expert [n_tiles] int32: the expert of each tile, sorted, clipped to E - 1 for unused tiles).
    """
    n_experts = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    tiles_per_expert = (sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_expert)
    padded_starts = (tile_ends - tiles_per_expert) * tile
    starts = jnp.cumsum(sizes) - sizes
    tile_expert = jnp.searchsorted(tile_ends, jnp.arange(n_tiles, dtype=jnp.int32), side="right")
    tile_expert = jnp.minimum(tile_expert, n_experts - 1).astype(jnp.int32)
    slot = jnp.arange(n_tiles * tile, dtype=jnp.int32)
    slot_expert = jnp.repeat(tile_expert, tile, total_repeat_length=n_tiles * tile)
    offset = slot - padded_starts[slot_expert]
    in_group = (offset >= 0) & (offset < sizes[slot_expert]) & (slot < tile_ends[-1] * tile)
    source = jnp.where(in_group, starts[slot_expert] + offset, m)
    row = jnp.arange(m, dtype=jnp.int32)
    row_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"), n_experts - 1)
    valid = row < jnp.sum(sizes)
    target = jnp.where(valid, padded_starts[row_expert] + row - starts[row_expert], n_tiles * tile)
    return source.astype(jnp.int32), target.astype(jnp.int32), tile_expert


def tiled_expert_ffn(x, w_gate, w_up, w_down, group_sizes, *, tile: int | None = None,
                     capacity: int | None = None) -> jax.Array:
    """SwiGLU of each sorted row with its expert's weights, over expert-pure row tiles.

    x [m, d]; w_gate, w_up [E, d, f]; w_down [E, f, d] (x's dtype); group_sizes [E] int32; capacity:
    optional static bound on every group size (tightens the tile count); tile: rows per tile (None:
    `default_tile`). Returns [m, d], padding rows 0.
    """
    m, d_model = x.shape
    n_experts = w_gate.shape[0]
    tile = row_tile(m, tile or default_tile(m, n_experts))
    n_tiles = tile_count(m, n_experts, tile, capacity)
    source, target, tile_expert = tiled_layout(group_sizes, m, tile, n_tiles)
    x_tiles = jnp.take(x, source, axis=0, mode="fill", fill_value=0).reshape(n_tiles, tile, d_model)
    per_tile = [jnp.take(w, tile_expert, axis=0) for w in (w_gate, w_up, w_down)]  # [n_tiles, ...]
    gate = jnp.einsum("tmd,tdf->tmf", x_tiles, per_tile[0], preferred_element_type=jnp.float32)
    up = jnp.einsum("tmd,tdf->tmf", x_tiles, per_tile[1], preferred_element_type=jnp.float32)
    out = jnp.einsum("tmf,tfd->tmd", swiglu(gate, up, x.dtype), per_tile[2],
                     preferred_element_type=jnp.float32)
    out = out.astype(x.dtype).reshape(n_tiles * tile, d_model)
    return jnp.take(out, target, axis=0, mode="fill", fill_value=0)

"""One pass of the expert-parallel exchange, per device inside the MoE shard_map (`expert_exchange`).

Per device: T_l tokens, k copies each (R = T_l * k; copy j of token t is r = t * k + j), E_l experts of
the E = n * E_l (n = size of the `expert` axis); expert e lives on device e // E_l.

`send_layout` sorts the device's copies by expert (stable): the copies for destination j form block j of
the sorted order (`Layout.order`), itself grouped by local expert. A pass moves rows [first, first + W)
of every block: `pass_source` says which copy sits in each of its n * W sent rows and `pass_cell` which
row each copy sits in; `pass_core` exchanges the [n, W, d] rows, runs the experts and brings
the outputs back in the same [n, W, d] layout. All row movements are gathers both ways
(`model/row_gather.py`); the only scatter is the int32 inverse of the sort (`Layout.rank`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from smelt_jax.kernels.backend import EXPERT_AXIS
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.model.dispatch import argsort_small_keys, inverse_permutation
from smelt_jax.model.row_gather import permute_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
    """The sorted layout of one device's R copies (all int32).

    order [R]: the copy at each sorted position (copies not sent last); rank [R]: the sorted position of
    each copy (the inverse); dest [R]: the copy's destination device, n when not sent; slot [R]: its row
    in its destination's block; counts [n, E_l]: rows per (destination, local expert); fill [n]: rows per
    block; block_start [n]: the block's first sorted position."""

    order: jax.Array
    rank: jax.Array
    dest: jax.Array
    slot: jax.Array
    counts: jax.Array
    fill: jax.Array
    block_start: jax.Array


def send_layout(ids_local: jax.Array, kept_local: jax.Array, experts_local: int, n: int) -> Layout:
    """ids_local / kept_local [T_l, k] -> the Layout. Blocks are in expert order, then token order."""
    ids = ids_local.reshape(-1).astype(jnp.int32)
    kept = kept_local.reshape(-1)
    n_keys = n * experts_local  # global expert = destination * E_l + local expert; n_keys: not sent
    key = jnp.where(kept, ids, n_keys)
    order = argsort_small_keys(key, n_keys + 1)
    rank = inverse_permutation(order)
    # Rows per key from the sorted keys' boundaries (a binary search, not a scatter-add bincount).
    bounds = jnp.searchsorted(jnp.take(key, order), jnp.arange(n_keys + 1, dtype=jnp.int32))
    counts = jnp.diff(bounds).astype(jnp.int32).reshape(n, experts_local)
    fill = jnp.sum(counts, axis=1)
    block_start = (jnp.cumsum(fill) - fill).astype(jnp.int32)
    dest = jnp.where(kept, ids // experts_local, n)
    slot = rank - jnp.take(block_start, jnp.minimum(dest, n - 1))
    return Layout(order, rank, dest, slot, counts, fill, block_start)


def pass_source(lay: Layout, first, width: int) -> jax.Array:
    """Rows [first, first + width) of every block -> source [n * width]: the copy in each sent row, R for
    an empty one (int work proportional to the pass's rows)."""
    total = lay.order.shape[0]
    s = jnp.arange(width, dtype=jnp.int32)[None, :]
    position = lay.block_start[:, None] + first + s  # [n, width] sorted positions
    filled = first + s < lay.fill[:, None]
    return jnp.where(filled, jnp.take(lay.order, jnp.minimum(position, total - 1)), total).reshape(-1)


def pass_cell(lay: Layout, first, width: int, top_k: int) -> jax.Array:
    """cell [T_l, k]: each copy's row among the pass's n * width sent rows, n * width when not in it."""
    n = lay.fill.shape[0]
    row = lay.slot - first
    in_pass = (lay.dest < n) & (row >= 0) & (row < width)
    return jnp.where(in_pass, lay.dest * width + row, n * width).reshape(-1, top_k)


def pass_counts(counts: jax.Array, first, width: int) -> jax.Array:
    """counts [n, E_l] of whole blocks -> the rows of each (block, expert) inside rows [first,
    first + width) of the block, [n, E_l] int32."""
    ends = jnp.cumsum(counts, axis=1)
    starts = ends - counts
    return (jnp.clip(ends - first, 0, width) - jnp.clip(starts - first, 0, width)).astype(jnp.int32)


def receiver_positions(recv_counts: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """recv_counts [n sources, E_l] of blocks of `width` rows -> (position [n * width] int32: the row's
    place in expert order (experts in order, sources in order within one, rows in order), n * width for
    empty rows; group_sizes [E_l] int32)."""
    n, experts_local = recv_counts.shape
    ends = jnp.cumsum(recv_counts, axis=1)  # [n, E_l] within each block
    r = jnp.arange(width, dtype=jnp.int32)
    expert = jnp.sum(r[None, :, None] >= ends[:, None, :], axis=2)  # [n, width]; E_l for empty rows
    e = jnp.minimum(expert, experts_local - 1)
    group_sizes = jnp.sum(recv_counts, axis=0)
    group_start = jnp.cumsum(group_sizes) - group_sizes  # [E_l]
    before = jnp.cumsum(recv_counts, axis=0) - recv_counts  # [n, E_l] rows of earlier sources
    within = r[None, :] - jnp.take_along_axis(ends - recv_counts, e, axis=1)
    position = jnp.take(group_start, e) + jnp.take_along_axis(before, e, axis=1) + within
    return jnp.where(expert < experts_local, position, n * width).reshape(-1), group_sizes


def receiver_sources(recv_counts: jax.Array, width: int) -> jax.Array:
    """The inverse of `receiver_positions`, by arithmetic (no scatter): source [n * width] int32, the
    received row (source device * width + row) at each place in expert order, n * width past the last."""
    n, experts_local = recv_counts.shape
    m = n * width
    p = jnp.arange(m, dtype=jnp.int32)
    group_end = jnp.cumsum(jnp.sum(recv_counts, axis=0))  # [E_l]
    expert = jnp.sum(p[:, None] >= group_end[None, :], axis=1)  # [m]; E_l past the last row
    e = jnp.minimum(expert, experts_local - 1)
    q = p - (jnp.take(group_end, e) - jnp.take(jnp.sum(recv_counts, axis=0), e))  # place within e
    source_end = jnp.cumsum(recv_counts, axis=0)  # [n, E_l]: rows of e from sources <= i
    column = jnp.take(source_end.T, e, axis=0)  # [m, n]
    device = jnp.minimum(jnp.sum(q[:, None] >= column, axis=1), n - 1)
    before = jnp.take_along_axis(column, device[:, None], axis=1)[:, 0] - recv_counts[device, e]
    expert_start = (jnp.cumsum(recv_counts, axis=1) - recv_counts)[device, e]  # e's first row in block
    source = device * width + expert_start + q - before
    return jnp.where(expert < experts_local, source, m)


def ragged_block_args(send_counts: jax.Array, recv_counts: jax.Array, slots: int, my_index: jax.Array):
    """`ragged_all_to_all` arguments for buffers laid out as n blocks of `slots` rows, each holding a
    filled prefix: my block j (rows [j * slots, j * slots + send_counts[j])) goes to device j, where it
    lands in block `my_index`; I receive recv_counts[i] rows from device i into my block i.

    Returns (input_offsets, send_sizes, output_offsets, recv_sizes), each [n] int32."""
    n = send_counts.shape[0]
    input_offsets = jnp.arange(n, dtype=jnp.int32) * slots
    output_offsets = jnp.full((n,), my_index * slots, jnp.int32)
    return input_offsets, send_counts.astype(jnp.int32), output_offsets, recv_counts.astype(jnp.int32)


def exchange_blocks(blocks: jax.Array, counts: jax.Array, recv_counts: jax.Array, *,
                    ragged: bool) -> jax.Array:
    """Block j of `blocks` [n, slots, d] to device j over `expert`; returns [n, slots, d] with block i
    from device i. Only the first counts[j] rows of block j are meaningful (counts [n] int32; recv_counts
    [n]: what arrives from each device). Padded: `all_to_all` of everything. Ragged: only the filled
    rows travel; the rest of the result is 0."""
    if not ragged:
        return jax.lax.all_to_all(blocks, EXPERT_AXIS, 0, 0)
    n, slots = blocks.shape[:2]
    args = ragged_block_args(counts, recv_counts, slots, jax.lax.axis_index(EXPERT_AXIS))
    flat = blocks.reshape(n * slots, *blocks.shape[2:])
    out = jax.lax.ragged_all_to_all(flat, jnp.zeros_like(flat), *args, axis_name=EXPERT_AXIS)
    return out.reshape(blocks.shape)


def pass_core(send_x, w_gate, w_up, w_down, send_counts, *, tokens_local: int, impl: str,
              ragged: bool) -> jax.Array:
    """send_x [n, W, d] (block j for device j), weights [E_l, ...], send_counts [n, E_l] (the rows of
    each block per local expert) -> the expert outputs of the same rows, [n, W, d] (0 in empty rows)."""
    n, width, d = send_x.shape
    recv_counts = jax.lax.all_to_all(send_counts, EXPERT_AXIS, 0, 0, tiled=True)  # [n sources, E_l]
    send_fill, recv_fill = jnp.sum(send_counts, axis=1), jnp.sum(recv_counts, axis=1)
    recv_x = exchange_blocks(send_x, send_fill, recv_fill, ragged=ragged).reshape(n * width, d)
    position, group_sizes = receiver_positions(recv_counts, width)
    source = receiver_sources(recv_counts, width)
    x_sorted = permute_rows(recv_x, source, position)
    # One token sends at most one copy to an expert: an expert gets at most n * min(T_l, W) rows.
    y_sorted = expert_ffn(x_sorted, w_gate, w_up, w_down, group_sizes, impl=impl,
                          capacity=n * min(tokens_local, width))
    y_recv = permute_rows(y_sorted, position, source)
    return exchange_blocks(y_recv.reshape(n, width, d), recv_fill, send_fill, ragged=ragged)

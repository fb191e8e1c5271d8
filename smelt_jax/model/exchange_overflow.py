"""The expert exchange's overflow passes: copies past the first pass's C rows per block, never dropped.

    overflow_outputs(x [T_l, d], weights [T_l, k] f32, w_gate, w_up, w_down, lay, n_passes, first, width,
                     pass_kw) -> [T_l, d] f32: sum_j weights[t, j] * (output of copy t * k + j) over the
                     copies in rows >= first of their block (the weighted top-k sum of the overflow copies)

Passes q = 0 .. n_passes - 1 move rows [first + q * width, first + (q + 1) * width) of every block
(`exchange_pass.pass_core`, the same exchange as the first pass; pass_kw: its keyword arguments as a
tuple of (name, value) pairs, hashable for the custom VJP). The work of a pass scales with its
rows, not with the device's R = T_l * k copies: its sent rows are one gather of n * width token rows, and
its outputs are written (n dynamic-update-slices of width rows) into a buffer in the sender's sorted
order [R + width, d]; the weighted sum over the copies, a gather by the inverse of the sort, runs once
after the loop. With n_passes = 0 (the normal case with enough slack) nothing but the trip count is
computed: loop, buffers and sum sit in a `lax.cond`.

A custom VJP (a while loop of data-dependent length is not reverse-differentiable by JAX): the backward
loops over the same passes, recomputing each pass's forward under `jax.vjp`; the cotangents of the sent
rows and of the router weights are written into sorted-order buffers the same way and gathered back by
the inverse once. No scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from smelt_jax.model.exchange_pass import Layout, pass_core, pass_counts, pass_source
from smelt_jax.model.row_gather import combine_weighted, copy_sum, take_rows


def _write_blocks(buf: jax.Array, rows: jax.Array, starts: jax.Array, valid: jax.Array) -> jax.Array:
    """buf [B, ...] with the first valid[j] rows of rows[j] ([n, W, ...]) written from row starts[j].
    Needs starts[j] + valid[j] <= B - W + valid[j] wherever valid[j] > 0 (no clamping then)."""
    n, width = rows.shape[:2]
    s = jnp.arange(width).reshape(width, *(1,) * (rows.ndim - 2))
    for j in range(n):
        start = jnp.clip(starts[j], 0, buf.shape[0] - width)
        old = jax.lax.dynamic_slice_in_dim(buf, start, width)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(s < valid[j], rows[j], old), start, 0)
    return buf


def _sorted_cell(lay: Layout, first: int, top_k: int, size: int) -> jax.Array:
    """[T_l, k]: each overflow copy's row in the sorted-order buffer (its rank), `size` for the others."""
    n = lay.fill.shape[0]
    over = (lay.dest < n) & (lay.slot >= first)
    return jnp.where(over, lay.rank, size).reshape(-1, top_k)


def _pass(x, w_gate, w_up, w_down, lay, first, width, pass_kw):
    """(source [n * W], sent rows [n, W, d], the pass as a function of (sent rows, weights))."""
    n = lay.fill.shape[0]
    top_k = lay.order.shape[0] // x.shape[0]
    source = pass_source(lay, first, width)
    send = take_rows(x, source // top_k).reshape(n, width, x.shape[1])
    counts = pass_counts(lay.counts, first, width)
    return source, send, lambda s, g, u, d: pass_core(s, g, u, d, counts, **dict(pass_kw))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def overflow_outputs(x, weights, w_gate, w_up, w_down, lay, n_passes, first, width, pass_kw):
    return _forward(x, weights, w_gate, w_up, w_down, lay, n_passes, first, width, pass_kw)


def _forward(x, weights, w_gate, w_up, w_down, lay, n_passes, first, width, pass_kw):
    total, top_k = lay.order.shape[0], weights.shape[1]

    def run():
        def body(q, ys):
            start = first + q * width
            _, send, core = _pass(x, w_gate, w_up, w_down, lay, start, width, pass_kw)
            return _write_blocks(ys, core(send, w_gate, w_up, w_down), lay.block_start + start,
                                 lay.fill - start)
        ys = jax.lax.fori_loop(0, n_passes, body, jnp.zeros((total + width, x.shape[1]), x.dtype))
        return combine_weighted(ys, weights, _sorted_cell(lay, first, top_k, total + width))

    return jax.lax.cond(n_passes > 0, run, lambda: jnp.zeros(x.shape, jnp.float32))


def _fwd(x, weights, w_gate, w_up, w_down, lay, n_passes, first, width, pass_kw):
    out = _forward(x, weights, w_gate, w_up, w_down, lay, n_passes, first, width, pass_kw)
    return out, (x, weights, w_gate, w_up, w_down, lay, n_passes)


def _bwd(first, width, pass_kw, res, g):
    x, weights, w_gate, w_up, w_down, lay, n_passes = res
    total, top_k = lay.order.shape[0], weights.shape[1]
    experts = (w_gate, w_up, w_down)
    w_flat = weights.reshape(-1)  # [R]

    def run():
        def body(q, carry):
            dxs, dws, dexperts = carry
            start = first + q * width
            source, send, core = _pass(x, w_gate, w_up, w_down, lay, start, width, pass_kw)
            y, vjp = jax.vjp(core, send, *experts)
            g_rows = take_rows(g, source // top_k)  # [n * W, d] f32
            w_rows = take_rows(w_flat, source)
            dsend, *dnew = vjp((w_rows[:, None] * g_rows).astype(y.dtype).reshape(y.shape))
            dw_rows = jnp.sum(g_rows * y.reshape(g_rows.shape).astype(jnp.float32), axis=1)
            starts, valid = lay.block_start + start, lay.fill - start
            dxs = _write_blocks(dxs, dsend, starts, valid)
            dws = _write_blocks(dws, dw_rows.reshape(send.shape[:2]), starts, valid)
            return dxs, dws, tuple(a + b for a, b in zip(dexperts, dnew))

        init = (jnp.zeros((total + width, x.shape[1]), x.dtype), jnp.zeros((total + width,), jnp.float32),
                tuple(jnp.zeros_like(w) for w in experts))
        dxs, dws, dexperts = jax.lax.fori_loop(0, n_passes, body, init)
        cell = _sorted_cell(lay, first, top_k, total + width)
        dx = copy_sum(lambda j: take_rows(dxs, cell[:, j]), top_k, x.dtype)
        return (dx, take_rows(dws, cell.reshape(-1)).reshape(cell.shape), *dexperts)

    def nothing():
        return (jnp.zeros_like(x), jnp.zeros_like(weights), *(jnp.zeros_like(w) for w in experts))

    grads = jax.lax.cond(n_passes > 0, run, nothing)
    return (*grads, None, None)


overflow_outputs.defvjp(_fwd, _bwd)

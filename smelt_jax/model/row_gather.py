"""Row permutations of the expert exchange as gathers both ways (custom VJPs; no scatter-add).

A gather `out[i] = x[index[i]]` differentiates, by JAX's own rules, into a scatter-add of the cotangent
into a zeroed buffer shaped like x. When `index` is a (partial) permutation whose inverse is known, the
transpose is a gather by the inverse instead. The three movements of the expert-parallel MoE layer
(`model/expert_exchange.py`), per device (T_l tokens, k copies each, R = T_l * k copies; a pass moves
n blocks of W rows, so its buffers hold M = n * W rows):

- `permute_rows(x [m, d], index [p], inverse [m]) -> [p, d]`: out[i] = x[index[i]], 0 where index[i] >= m.
  Backward: dx[j] = g[inverse[j]], 0 where inverse[j] >= p. The receiver's reorder into expert order and
  back.
- `gather_sent_rows(x [T_l, d], source [M], cell [T_l, k]) -> [M, d]`: the sent rows, one gather of the
  token rows: out[i] = x[source[i] // k] (source: the copy in row i, R for an empty row). Backward:
  dx[t] = sum_j g[cell[t, j]] (cell: the row holding copy t * k + j, M when it is not in this buffer),
  k gathers summed in float32.
- `combine_rows(y [M, d], weights [T_l, k] f32, cell, source) -> [T_l, d] f32`: the weighted top-k sum
  fused with the return gather: out[t] = sum_j weights[t, j] * y[cell[t, j]], accumulated in float32
  one copy at a time (no [T_l, k, d] array). Saves y in its own dtype (the compute dtype's rows).
  Backward: dy[i] = weights[source[i]] * g[source[i] // k] (a gather), dweights[t, j] = <g[t], y[cell]>.

`cell` and `source` must describe the same placement: source[cell[t, j]] = t * k + j for every copy in
the buffer, and cell[source[i] // k, source[i] % k] = i for every filled row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] along axis 0, 0 for out-of-range indices."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def take_rows_clamped(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] along axis 0, the last row for indices past the end: one gather, no mask (a filled gather
    is a gather and a select, a second pass over the rows on TPU). For rows whose value is discarded."""
    return jnp.take(x, index, axis=0, mode="clip")


@jax.custom_vjp
def permute_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    return take_rows(x, index)


def _permute_fwd(x, index, inverse):
    return take_rows(x, index), (index, inverse)


def _permute_bwd(res, g):
    index, inverse = res
    return take_rows(g, inverse), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def copy_sum(rows_of_copy, top_k: int, dtype) -> jax.Array:
    """sum_j rows_of_copy(j) [T_l, d] in float32, one copy at a time, cast to dtype."""
    total = rows_of_copy(0).astype(jnp.float32)
    for j in range(1, top_k):
        total = total + rows_of_copy(j).astype(jnp.float32)
    return total.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_sent_rows(x: jax.Array, source: jax.Array, cell: jax.Array, top_k: int) -> jax.Array:
    return take_rows(x, source // top_k)


def _sent_fwd(x, source, cell, top_k):
    return take_rows(x, source // top_k), cell


def _sent_bwd(top_k, res, g):
    cell = res  # g has x's dtype
    return copy_sum(lambda j: take_rows(g, cell[:, j]), top_k, g.dtype), None, None


gather_sent_rows.defvjp(_sent_fwd, _sent_bwd)


def combine_weighted(y, weights, cell):
    """sum_j weights[:, j] * y[cell[:, j]] -> [T_l, d] float32, one copy at a time."""
    top_k = cell.shape[1]
    total = jnp.zeros((cell.shape[0], y.shape[1]), jnp.float32)
    for j in range(top_k):
        total = total + weights[:, j, None] * take_rows(y, cell[:, j]).astype(jnp.float32)
    return total


@jax.custom_vjp
def combine_rows(y: jax.Array, weights: jax.Array, cell: jax.Array, source: jax.Array) -> jax.Array:
    return combine_weighted(y, weights, cell)


def _combine_fwd(y, weights, cell, source):
    return combine_weighted(y, weights, cell), (y, weights, cell, source)


def _combine_bwd(res, g):
    y, weights, cell, source = res
    top_k = cell.shape[1]
    w_row = take_rows(weights.reshape(-1), source)  # [M]; 0 for empty rows
    dy = (w_row[:, None] * take_rows(g, source // top_k)).astype(y.dtype)
    dweights = jnp.stack([jnp.sum(g * take_rows(y, cell[:, j]).astype(jnp.float32), axis=1)
                          for j in range(top_k)], axis=1)
    return dy, dweights, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)

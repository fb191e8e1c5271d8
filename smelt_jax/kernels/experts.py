"""Expert SwiGLU over rows sorted by expert, behind one call with interchangeable backends.

`expert_ffn(x_sorted, w_gate, w_up, w_down, group_sizes)` computes, for row i of expert e,
`(silu(x_i @ Wg[e]) * (x_i @ Wu[e])) @ Wd[e]`. Rows are sorted by expert; `group_sizes[e]` counts the
rows of expert e; rows past `sum(group_sizes)` are padding and come out as 0. With `row_weight` [m]
(float32, the router's weight of each row's copy) row i comes out times row_weight[i]: the `pallas`
backend applies it in the down-projection kernel's epilogue and takes its gradient in that kernel's
backward (no array of weighted rows in HBM); the others multiply the rows after, in float32.

Precision, the same in every backend: matmuls accumulate in float32, the SwiGLU product is taken in
float32 and cast to the input dtype before the down projection, the output has the input dtype.

Backends (`impl`; which one `auto` means is decided by `smelt_jax.kernels.backend.choose_expert_backend`):
- `dense`: every expert on every row, then masked. The reference; E times the needed FLOPs.
- `ragged_dot`: `jax.lax.ragged_dot`. Native grouped matmul on GPU; on CPU it materialises a dense
  [groups, m, k] operand (slow).
- `megablox`: JAX's Pallas TPU grouped matmul (`interpret=True` off TPU); m is padded to the row tile.
- `capacity`: scatter rows into [E, C, d] buffers, batched einsum, gather back. C = `capacity`
  (default m, the worst case, so nothing is dropped).
- `tiled`: a loop over the experts, each walking its own rows in 256-row chunks and then one chunk per set
  bit of the rest rounded up to 8 (128 / 64 / 32 / 16 / 8), gate and up as one product
  (`smelt_jax.kernels.tiled`): only the routed rows (each expert's rounded up to 8). CPU default.
- `pallas`: the project's own Mosaic kernels (`smelt_jax.kernels.pallas_ffn.pallas_expert_ffn`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from smelt_jax.kernels.backend import choose_expert_backend, pallas_interpret
from smelt_jax.kernels.rows import mask_rows, row_expert_ids, swiglu
from smelt_jax.kernels.tiled import tiled_expert_ffn

MEGABLOX_ROW_TILE = 128
MEGABLOX_COL_TILE = 128


def _dense(x, w_gate, w_up, w_down, group_sizes):
    n_experts = w_gate.shape[0]
    expert_of_row = row_expert_ids(group_sizes, x.shape[0])
    gate = jnp.einsum("md,edf->emf", x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("md,edf->emf", x, w_up, preferred_element_type=jnp.float32)
    hidden = swiglu(gate, up, x.dtype)
    out = jnp.einsum("emf,efd->emd", hidden, w_down, preferred_element_type=jnp.float32)
    mask = expert_of_row[None, :] == jnp.arange(n_experts)[:, None]  # [E, m]
    return jnp.sum(jnp.where(mask[..., None], out, 0.0), axis=0).astype(x.dtype)


def _ragged_dot(x, w_gate, w_up, w_down, group_sizes):
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    mm = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes,
                           preferred_element_type=jnp.float32)
    hidden = swiglu(mm(x, w_gate), mm(x, w_up), x.dtype)
    return mask_rows(mm(hidden, w_down), valid).astype(x.dtype)


def _megablox(x, w_gate, w_up, w_down, group_sizes, *, interpret: bool | None = None):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    interpret = pallas_interpret(interpret)
    m, d_model = x.shape
    ffn = w_gate.shape[-1]
    row_tile = min(MEGABLOX_ROW_TILE, -(-m // 8) * 8)
    padded_m = -(-m // row_tile) * row_tile
    x_pad = jnp.pad(x, ((0, padded_m - m), (0, 0)))
    valid = jnp.arange(padded_m) < jnp.sum(group_sizes)

    def grouped(lhs, rhs, k, n):
        tiling = (row_tile, min(MEGABLOX_COL_TILE, k), min(MEGABLOX_COL_TILE, n))
        # Mask on the way in too: gmm leaves padding rows uninitialised, and its backward would
        # otherwise carry that garbage into the gradient of the padding rows.
        out = gmm(mask_rows(lhs, valid), rhs, group_sizes, preferred_element_type=jnp.float32,
                  tiling=tiling, interpret=interpret)
        return mask_rows(out, valid)

    hidden = swiglu(grouped(x_pad, w_gate, d_model, ffn), grouped(x_pad, w_up, d_model, ffn),
                    x.dtype)
    return grouped(hidden, w_down, ffn, d_model)[:m].astype(x.dtype)


def _capacity(x, w_gate, w_up, w_down, group_sizes, *, capacity: int):
    m, d_model = x.shape
    n_experts = w_gate.shape[0]
    expert_of_row = row_expert_ids(group_sizes, m)
    starts = jnp.cumsum(group_sizes) - group_sizes
    slot = jnp.arange(m, dtype=jnp.int32) - jnp.take(starts, jnp.minimum(expert_of_row, n_experts - 1))
    # Padding rows and rows past the capacity get an out-of-range expert and are dropped.
    kept = (expert_of_row < n_experts) & (slot < capacity)
    target_expert = jnp.where(kept, expert_of_row, n_experts)
    buffer = jnp.zeros((n_experts, capacity, d_model), x.dtype)
    buffer = buffer.at[target_expert, slot].set(x, mode="drop")
    gate = jnp.einsum("ecd,edf->ecf", buffer, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("ecd,edf->ecf", buffer, w_up, preferred_element_type=jnp.float32)
    out = jnp.einsum("ecf,efd->ecd", swiglu(gate, up, x.dtype), w_down,
                     preferred_element_type=jnp.float32)
    rows = out.at[target_expert, slot].get(mode="fill", fill_value=0.0)
    return rows.astype(x.dtype)


def _pallas(x, w_gate, w_up, w_down, group_sizes, row_weight):
    # Imported on use: the Pallas TPU modules are slow to import and only this backend needs them.
    from smelt_jax.kernels.pallas_ffn import pallas_expert_ffn

    return pallas_expert_ffn(x, w_gate, w_up, w_down, group_sizes, row_weight=row_weight)


@jax.custom_vjp
def _weighted(y, row_weight):
    return (y.astype(jnp.float32) * row_weight[:, None]).astype(y.dtype)


def _weighted_fwd(y, row_weight):
    return _weighted(y, row_weight), (y, row_weight)  # y saved in its own dtype, not as float32 rows


def _weighted_bwd(residuals, g):
    y, row_weight = residuals
    g = g.astype(jnp.float32)
    return (g * row_weight[:, None]).astype(y.dtype), jnp.sum(g * y.astype(jnp.float32), axis=1)


_weighted.defvjp(_weighted_fwd, _weighted_bwd)


def _weigh_rows(y, row_weight):
    """y [m, d] times row_weight [m] (float32), in float32 and rounded to y's dtype (y itself when
    row_weight is None); the backward saves y in its own dtype and computes in float32."""
    return y if row_weight is None else _weighted(y, row_weight.astype(jnp.float32))


def _check(x, w_gate, w_up, w_down, group_sizes):
    if x.ndim != 2:
        raise ValueError(f"x_sorted must be [m, d_model], got shape {x.shape}")
    n_experts, d_model, ffn = w_gate.shape
    if w_up.shape != w_gate.shape or w_down.shape != (n_experts, ffn, d_model):
        raise ValueError(f"expert weights disagree: gate {w_gate.shape}, up {w_up.shape}, "
                         f"down {w_down.shape} (want [E, d, f], [E, d, f], [E, f, d])")
    if x.shape[1] != d_model:
        raise ValueError(f"x_sorted width {x.shape[1]} != expert d_model {d_model}")
    if group_sizes.shape != (n_experts,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be int [{n_experts}], got {group_sizes.dtype}"
                         f"{list(group_sizes.shape)}")


def expert_ffn(x_sorted: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               group_sizes: jax.Array, *, impl: str = "auto", capacity: int | None = None,
               row_weight: jax.Array | None = None) -> jax.Array:
    """SwiGLU of each row with its expert's weights.

    Args:
      x_sorted: [m, d_model] rows sorted by expert; rows past sum(group_sizes) are padding.
      w_gate, w_up: [E, d_model, ffn]; w_down: [E, ffn, d_model].
      group_sizes: [E] int32, rows per expert.
      impl: a backend name or 'auto' (`choose_expert_backend` with no mesh: the caller, e.g. the MoE
        layer, has already resolved it for its mesh).
      capacity: static bound on every group size that the caller guarantees; the `capacity`
        backend sizes its [E, C, d] buffers with it (None: m, always safe). Other backends ignore it.
      row_weight: [m] float32 or None; each row's output times its weight (differentiable).
    Returns:
      [m, d_model] in x_sorted's dtype; padding rows are 0.
    """
    _check(x_sorted, w_gate, w_up, w_down, group_sizes)
    if row_weight is not None and row_weight.shape != x_sorted.shape[:1]:
        raise ValueError(f"row_weight must be [{x_sorted.shape[0]}] (one per row), got {list(row_weight.shape)}")
    group_sizes = group_sizes.astype(jnp.int32)
    weights = [w.astype(x_sorted.dtype) for w in (w_gate, w_up, w_down)]
    backend = choose_expert_backend(impl)
    bound = None if capacity is None else min(int(capacity), x_sorted.shape[0])
    if bound is not None and bound <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if backend == "pallas":
        return _pallas(x_sorted, *weights, group_sizes, row_weight)
    if backend == "dense":
        y = _dense(x_sorted, *weights, group_sizes)
    elif backend == "ragged_dot":
        y = _ragged_dot(x_sorted, *weights, group_sizes)
    elif backend == "megablox":
        y = _megablox(x_sorted, *weights, group_sizes)
    elif backend == "capacity":
        y = _capacity(x_sorted, *weights, group_sizes, capacity=bound or x_sorted.shape[0])
    else:
        y = tiled_expert_ffn(x_sorted, *weights, group_sizes)
    return _weigh_rows(y, row_weight)

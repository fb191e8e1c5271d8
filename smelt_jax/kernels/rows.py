"""Helpers shared by the expert backends: which expert owns each sorted row, the SwiGLU product, and
zeroing padding rows. Rows are sorted by expert; `group_sizes[e]` counts the rows of expert e."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_expert_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """Expert of each sorted row, [m] int32; padding rows get E (one past the last expert)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right").astype(jnp.int32)


def swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in float32, cast to the compute dtype for the down projection."""
    gate = gate.astype(jnp.float32)
    return (jax.nn.silu(gate) * up.astype(jnp.float32)).astype(dtype)


def mask_rows(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Zero the rows where valid [m] is False (`where`, not a product: backends may leave NaN there)."""
    return jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))

"""Rotary position embedding (rotate-half layout: channel i pairs with channel i + head_dim/2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotation angles, each [batch, seq, head_dim // 2] float32.

    positions: [batch, seq] int; in packed rows they restart at 0 for every document.
    """
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [batch, seq, heads, head_dim] by angles [batch, seq, head_dim // 2]."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)

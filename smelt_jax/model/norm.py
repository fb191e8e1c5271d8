"""RMSNorm: x / rms(x) * scale, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.parallel.sharding import param


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """[..., d] -> [..., d] in x's dtype; statistics in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Learned per-channel scale, initialised to 1 (the identity at init)."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = param(jnp.ones((dim,), param_dtype), ("embed",))

    @jax.named_scope("norm")  # names the ops for profiles (benchmarks/bench_ops.py)
    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)

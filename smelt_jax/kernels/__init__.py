"""Compute kernels behind one call each: `expert_ffn` runs every expert's SwiGLU on its rows."""

from smelt_jax.kernels.experts import EXPERT_BACKENDS, expert_ffn, resolve_impl

__all__ = ["EXPERT_BACKENDS", "expert_ffn", "resolve_impl"]

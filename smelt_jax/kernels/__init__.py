"""Compute kernels behind one call each: `expert_ffn` runs every expert's SwiGLU on its rows, with the
backend chosen by `choose_expert_backend` (`smelt_jax.kernels.backend`, the only place that decides).

The names below load on first use, so `smelt_jax.design.config` can import `kernels.backend` (the list of
backend names) without importing JAX."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EXPERT_BACKENDS": "smelt_jax.kernels.backend",
    "EXPERT_IMPLS": "smelt_jax.kernels.backend",
    "choose_expert_backend": "smelt_jax.kernels.backend",
    "expert_ffn": "smelt_jax.kernels.experts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'smelt_jax.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

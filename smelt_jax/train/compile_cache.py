"""The persistent XLA compilation cache, switched on by callers (the `smelt train` entry point, a
benchmark), never inside the trainer: it is global JAX configuration, and a test run must choose its
own folder."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from smelt_jax import storage


def enable_compilation_cache(folder: str | None = None) -> str:
    """Persist compiled programs across processes in `folder` (default $SMELT_XLA_CACHE, else
    data_cache/xla): the decay branches and resumed runs of a sweep recompile the same train step.
    Returns the folder."""
    from smelt_jax.data.corpus import default_data_dir
    folder = folder or os.environ.get("SMELT_XLA_CACHE") or str(default_data_dir() / "xla")
    if not storage.is_gcs(folder):  # a gs:// cache is written by jax itself (through etils.epath)
        Path(folder).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder

"""The persistent XLA compilation cache, switched on by callers (the `smelt train` entry point, a
benchmark), never inside the trainer: it is global JAX configuration, and a test run must choose its
own folder."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from smelt_jax.platform import storage


def default_cache_dir() -> Path:
    """The user's cache folder for compiled programs: $XDG_CACHE_HOME/smelt_jax/xla (XDG_CACHE_HOME
    defaulting to ~/.cache), never inside the installed package or the checkout."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "smelt_jax" / "xla"


def enable_compilation_cache(folder: str | None = None) -> str:
    """Persist compiled programs across processes in `folder` (default $SMELT_XLA_CACHE, else
    `default_cache_dir()`): the decay branches and resumed runs of a sweep recompile the same train step.
    Returns the folder."""
    folder = folder or os.environ.get("SMELT_XLA_CACHE") or str(default_cache_dir())
    if not storage.is_gcs(folder):  # a gs:// cache is written by jax itself (through etils.epath)
        Path(folder).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder

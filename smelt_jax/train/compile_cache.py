"""The persistent XLA compilation cache, switched on by callers (the `smelt train` entry point, a
benchmark), never inside the trainer: it is global JAX configuration, and a test run must choose its
own folder."""

from __future__ import annotations

from pathlib import Path

import jax

from smelt_jax.platform import env, storage


def default_cache_dir() -> Path:
    """The user's cache folder for compiled programs: $XDG_CACHE_HOME/smelt_jax/xla (XDG_CACHE_HOME
    defaulting to ~/.cache; a relative one is ignored, as the XDG spec says: `platform.env`), never
    inside the installed package or the checkout."""
    return env.xdg_cache_home() / "smelt_jax" / "xla"


def enable_compilation_cache(folder: str | None = None) -> str:
    """Persist compiled programs across processes in `folder` (default $SMELT_XLA_CACHE, else
    `default_cache_dir()`): the decay branches and resumed runs of a sweep recompile the same train step.
    Returns the folder."""
    folder = folder or env.xla_cache_dir()
    if not storage.is_gcs(folder):  # a gs:// cache is written by jax itself (through etils.epath)
        Path(folder).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder

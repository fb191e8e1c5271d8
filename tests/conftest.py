"""Test set-up: 8 fake CPU devices (before JAX initialises) and float32 matmuls at full precision."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `smelt train` processes the tests start switch the XLA cache on: one temporary folder per test run,
# never the repository's data_cache/xla (the trainer itself sets no global JAX configuration).
os.environ.setdefault("SMELT_XLA_CACHE", tempfile.mkdtemp(prefix="smelt-xla-tests-"))

import experiments  # noqa: E402,F401 — fills the library's suite registry (smelt_jax.suites), as the CLI does

from smelt_jax.train.compile_cache import enable_compilation_cache  # noqa: E402

# In-process trainers reuse the compiles of earlier tests through the same per-run folder.
enable_compilation_cache(os.environ["SMELT_XLA_CACHE"])

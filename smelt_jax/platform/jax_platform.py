"""Which JAX platform a process uses when nobody said: the one rule, for the CLI and the notebooks."""

from __future__ import annotations

import os
from pathlib import Path

from smelt_jax.platform import env

ACCELERATOR_FILES = ("accel*", "vfio", "nvidia[0-9]*")  # /dev entries of a TPU or an NVIDIA GPU


def pin_cpu_without_accelerator(dev: Path = Path("/dev")) -> None:
    """On a machine with no accelerator device files, pin JAX to the CPU so that an installed libtpu
    (used here only for ahead-of-time TPU compilation) does not try, and fail noisily, to find a TPU.
    An explicit JAX_PLATFORMS always wins (read through `platform.env`: an empty one counts as unset)."""
    if env.jax_platforms() is not None:
        return
    if any(any(dev.glob(pattern)) for pattern in ACCELERATOR_FILES):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"

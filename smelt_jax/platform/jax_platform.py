"""Which JAX platform a process uses when nobody said: the one rule, for the CLI and the notebooks."""

from __future__ import annotations

import os
from pathlib import Path


def pin_cpu_without_accelerator(dev: Path = Path("/dev")) -> None:
    """On a machine with no accelerator device files, pin JAX to the CPU so that an installed libtpu
    (used here only for ahead-of-time TPU compilation) does not try, and fail noisily, to find a TPU.
    An explicit JAX_PLATFORMS always wins."""
    if "JAX_PLATFORMS" in os.environ:
        return
    if any(dev.glob("accel*")) or (dev / "vfio").exists() or any(dev.glob("nvidia[0-9]*")):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"

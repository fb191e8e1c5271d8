"""Peak FLOP/s of this machine's devices, the denominator of the trainer's MFU."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from smelt_jax.platform import hardware


def peak_flops_per_device() -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from): the device kind's published bf16
    peak (`smelt_jax.platform.hardware`), else a measured 1024^2 float32 matmul rate."""
    kind = jax.devices()[0].device_kind
    known = hardware.peak_flops_for_device_kind(kind)
    if known is not None:
        return known
    a = jnp.ones((1024, 1024), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * 1024 ** 3 / float(np.median(times)), f"measured 1024^2 f32 matmul on {kind}"

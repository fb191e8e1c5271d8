"""Ahead-of-time compilation for TPU topologies on a machine without a TPU.

With `libtpu` installed, JAX builds compile-only TPU devices for a named topology
(`jax.experimental.topologies.get_topology_desc`); programs traced inside `jax.set_mesh(mesh)` over those
devices are compiled by the real TPU compiler (XLA:TPU and Mosaic for Pallas kernels), so HBM and VMEM
overflows surface here as errors. Nothing is executed.

    available, reason = libtpu_status()
    topo = tpu_topology("v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2), ("data", "model"))
    compiled, summary = compile_for_tpu(step_fn, abstract_args, mesh, in_shardings=..., out_shardings=...)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from smelt_jax.compile.program_flops import program_flops
from smelt_jax.platform.errors import SmeltError, UsageError


class TpuCompileError(RuntimeError):
    """The TPU compiler rejected a program (any reason other than running out of memory)."""


class TpuOutOfMemory(SmeltError, TpuCompileError):
    """The program does not fit: HBM (`RESOURCE_EXHAUSTED`) or a Pallas kernel's VMEM blocks."""


class LibTpuUnavailable(SmeltError, RuntimeError):
    """libtpu cannot be loaded, so no TPU topology can be built on this machine."""


_OOM_MARKERS = ("resource_exhausted", "exceeds available hbm", "out of memory", "vmem", "scoped memory")


@dataclasses.dataclass(frozen=True)
class CompileSummary:
    """What the TPU compiler reports for one compiled program (all byte and flop counts per device)."""

    topology: str
    num_devices: int
    compile_seconds: float
    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    peak_bytes: int | None
    flops: float | None  # XLA's count: a `while` (scan) body counted once
    bytes_accessed: float | None
    optimal_seconds: float | None
    # Whole program, all devices, loops x trip count, by primitive kind (`compile.program_flops`).
    program_flops: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.cache
def libtpu_status() -> tuple[bool, str]:
    """(available, reason): whether a TPU topology can be built here, and why not if it cannot.

    Builds the smallest v5e topology once (a few seconds on first call; cached).
    """
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # quiets libtpu's metadata lookups
    # libtpu takes /tmp/libtpu_lockfile to guard a real chip; compile-only use shares no chip, and several
    # processes on this machine compile at once, so let each load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401  (the wheel that `jax[tpu]` installs)
    except ImportError as err:
        return False, f"libtpu is not installed ({err}); install it with `make install-tpu`"
    try:
        from jax.experimental import topologies

        topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    except Exception as err:  # noqa: BLE001 - any failure here means "cannot compile for TPU"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return False, f"libtpu is installed but a TPU topology cannot be built: {first_line}"
    return True, "libtpu loaded; TPU topologies can be compiled for"


@functools.cache
def tpu_topology(name: str, **kwargs: Any):
    """The compile-only TPU topology `name` ('v5e:2x2', 'v5p:2x2x1', 'v6e:2x2', ...); `.devices` lists them.

    Extra keyword arguments go to `get_topology_desc` (e.g. `chip_config_name="megacore_dense"` for v4,
    `num_slices=2`). Raises LibTpuUnavailable when libtpu cannot be loaded.
    """
    available, reason = libtpu_status()
    if not available:
        raise LibTpuUnavailable(reason)
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs)


def topology_mesh(name: str, mesh_shape: Sequence[int], axis_names: Sequence[str]) -> jax.sharding.Mesh:
    """A Mesh of shape `mesh_shape` over the devices of topology `name` (sizes must multiply out)."""
    import numpy as np

    devices = np.array(tpu_topology(name).devices)
    if int(np.prod(mesh_shape)) != devices.size:
        raise UsageError(f"mesh shape {tuple(mesh_shape)} needs {int(np.prod(mesh_shape))} devices; "
                         f"topology {name} has {devices.size}")
    return jax.sharding.Mesh(devices.reshape(tuple(mesh_shape)), tuple(axis_names))


def _first_number(value: Any) -> float | None:
    # cost_analysis() returns a dict in recent JAX, a list of dicts (one per program) in older ones.
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value


def compile_for_tpu(
    fn: Callable[..., Any],
    abstract_args: Sequence[Any],
    mesh: jax.sharding.Mesh,
    in_shardings: Any = None,
    out_shardings: Any = None,
    *,
    static_argnums: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    compiler_options: dict[str, str] | None = None,
) -> tuple[Any, CompileSummary]:
    """Compile `fn(*abstract_args)` for the TPU devices of `mesh`; returns (compiled, summary).

    `abstract_args` are `jax.ShapeDtypeStruct`s (with or without shardings) or pytrees of them. Tracing
    happens inside `jax.set_mesh(mesh)`, so Pallas lowerings see the TPU device kind, not the host CPU.
    `compiler_options`: XLA options for this compile (platform/xla_options.py). Raises TpuOutOfMemory
    for HBM or VMEM overflows and TpuCompileError for other compiler errors.
    """
    jit_kwargs: dict[str, Any] = {"static_argnums": tuple(static_argnums), "donate_argnums": tuple(donate_argnums)}
    if compiler_options:
        jit_kwargs["compiler_options"] = dict(compiler_options)
    if in_shardings is not None:
        jit_kwargs["in_shardings"] = in_shardings
    if out_shardings is not None:
        jit_kwargs["out_shardings"] = out_shardings
    platform = mesh.devices.flat[0].platform
    if platform != "tpu":
        raise ValueError(f"compile_for_tpu needs a mesh of TPU devices; got platform {platform!r}")
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            traced = jax.jit(fn, **jit_kwargs).trace(*abstract_args)
            compiled = traced.lower().compile()
    except Exception as err:
        message = str(err)
        lowered = message.lower()
        if any(marker in lowered for marker in _OOM_MARKERS):
            raise TpuOutOfMemory(message) from err
        if type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError") or "mosaic" in lowered:
            raise TpuCompileError(message) from err
        raise
    seconds = time.perf_counter() - start

    memory = compiled.memory_analysis()
    cost = _first_number(compiled.cost_analysis()) or {}

    def memory_field(name: str) -> int | None:
        return None if memory is None else int(getattr(memory, name, 0) or 0)

    def cost_field(name: str) -> float | None:
        value = cost.get(name)
        return None if value is None else float(value)

    summary = CompileSummary(
        topology=str(getattr(mesh.devices.flat[0], "device_kind", "tpu")),
        num_devices=int(mesh.devices.size),
        compile_seconds=seconds,
        argument_bytes=memory_field("argument_size_in_bytes"),
        output_bytes=memory_field("output_size_in_bytes"),
        temp_bytes=memory_field("temp_size_in_bytes"),
        peak_bytes=memory_field("peak_memory_in_bytes"),
        flops=cost_field("flops"),
        bytes_accessed=cost_field("bytes accessed"),
        optimal_seconds=cost_field("optimal_seconds"),
        program_flops=program_flops(traced.jaxpr).by_kind,
    )
    return compiled, summary

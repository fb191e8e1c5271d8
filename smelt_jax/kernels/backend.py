"""The one place that decides which expert backend runs: `choose_expert_backend`.

Every caller asks this function: `ModelConfig` validates `expert_impl` against `EXPERT_IMPLS`, the MoE
layer and `expert_ffn` resolve through it, and the ahead-of-time compile report asks it for a TPU
platform. The module imports nothing heavy at import time (the config imports it), and nothing from
`smelt_jax.model`.

Rules:
- `auto` picks by platform: TPU -> `pallas` (the project's Mosaic kernels), GPU -> `ragged_dot`, anything
  else (CPU) -> `tiled` (the dropless tiled grouped matmul; measured in docs/kernels.md).
- Mosaic kernels (`pallas`, `megablox`) cannot be partitioned by GSPMD ("Mosaic kernels cannot be
  automatically partitioned"). On a mesh of more than one device they only run inside the
  expert-parallel exchange, which the MoE layer takes when the mesh's `expert` axis is larger than 1 (each
  device then runs the kernel on its own experts). On any other multi-device mesh they become
  `ragged_dot`, XLA's partitionable grouped matmul.
"""

from __future__ import annotations

EXPERT_BACKENDS = ("dense", "ragged_dot", "megablox", "capacity", "pallas", "tiled")
EXPERT_IMPLS = ("auto",) + EXPERT_BACKENDS  # valid `ModelConfig.expert_impl` values
AUTO_BACKEND = {"tpu": "pallas", "gpu": "ragged_dot", "cpu": "tiled"}
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
MOSAIC_BACKENDS = ("pallas", "megablox")
GSPMD_BACKEND = "ragged_dot"
EXPERT_AXIS = "expert"  # the mesh axis experts are sharded over (smelt_jax.sharding.MESH_AXES)


def _axis_size(mesh, axis: str) -> int:
    return int(dict(mesh.shape).get(axis, 1))


def expert_axis_size(mesh) -> int:
    """Size of the mesh's `expert` axis; 1 without a mesh (None or empty)."""
    if mesh is None or getattr(mesh, "empty", False):
        return 1
    return _axis_size(mesh, EXPERT_AXIS)


def choose_expert_backend(requested: str, platform: str | None = None, mesh=None) -> str:
    """The backend that runs for `requested` (a name in EXPERT_IMPLS).

    platform: 'cpu', 'gpu' ('cuda', 'rocm'), 'tpu'; None = JAX's default backend. Only `auto` reads it.
    mesh: the mesh the layer is traced under (a Mesh, an AbstractMesh, or None / empty for none). With
      more than one device and an `expert` axis of size 1, Mosaic backends become GSPMD_BACKEND.
    """
    if requested not in EXPERT_IMPLS:
        raise ValueError(f"expert impl {requested!r} not in {EXPERT_IMPLS}")
    backend = requested
    if requested == "auto":
        if platform is None:
            import jax

            platform = jax.default_backend()
        platform = _PLATFORM_ALIASES.get(platform, platform)
        backend = AUTO_BACKEND.get(platform, AUTO_BACKEND["cpu"])
    if backend in MOSAIC_BACKENDS and _gspmd_partitioned(mesh):
        return GSPMD_BACKEND
    return backend


def _gspmd_partitioned(mesh) -> bool:
    """True when the expert computation would be split by GSPMD: a mesh of more than one device whose
    `expert` axis is 1 (with an expert axis the layer runs the kernel per device in a shard_map)."""
    if mesh is None or getattr(mesh, "empty", False):
        return False
    return int(mesh.size) > 1 and expert_axis_size(mesh) == 1

"""TPU slices: which slice a run gets and what that slice looks like to GKE and to gcloud.

A run uses `run.parallelism.tpu_type` when it is set (filled from compile reports); otherwise the
default for its scale below. The defaults are a first guess sized by parameter count, not measured.
"""

from __future__ import annotations

import dataclasses

from smelt_jax.descriptors import RunSpec

# scale -> TPU type when the run's parallelism does not name one (docs/sweeps.md).
DEFAULT_TPU_TYPE_BY_SCALE = {
    "100m": "v5p-16", "200m": "v5p-16", "600m": "v5p-64", "1.6b": "v5p-128",
    # CPU-sized suites (micro, smoke) never need more than the smallest slice.
    "xs": "v5p-8", "s": "v5p-8", "m": "v5p-8", "l": "v5p-8",
}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice: `v5p-16` = 16 TensorCores = 8 chips on 2 hosts of 4 chips, topology 2x2x2."""

    tpu_type: str
    gke_accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    topology: str         # node label cloud.google.com/gke-tpu-topology
    chips: int
    chips_per_host: int
    runtime_version: str  # TPU VM software version for `gcloud compute tpus`

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host


def _v5p(cores: int, topology: str) -> TpuSlice:
    # v5p names count TensorCores (2 per chip); 4 chips per host.
    return TpuSlice(f"v5p-{cores}", "tpu-v5p-slice", topology, cores // 2, 4, "v2-alpha-tpuv5")


def _v6e(chips: int, topology: str) -> TpuSlice:
    # v6e names count chips; multi-host slices have 4 chips per host, v6e-8 is one 8-chip host.
    per_host = 8 if chips == 8 else 4
    return TpuSlice(f"v6e-{chips}", "tpu-v6e-slice", topology, chips, per_host, "v2-alpha-tpuv6e")


TPU_SLICES = {s.tpu_type: s for s in (
    _v5p(8, "2x2x1"), _v5p(16, "2x2x2"), _v5p(32, "2x2x4"), _v5p(64, "2x4x4"),
    _v5p(128, "4x4x4"), _v5p(256, "4x4x8"), _v5p(512, "4x8x8"),
    _v6e(8, "2x4"), _v6e(16, "4x4"), _v6e(32, "4x8"), _v6e(64, "8x8"), _v6e(256, "16x16"),
)}


def tpu_type_for(run: RunSpec) -> str:
    """The run's own TPU type when set, else its scale's default."""
    if run.parallelism.tpu_type:
        return run.parallelism.tpu_type
    if run.scale not in DEFAULT_TPU_TYPE_BY_SCALE:
        raise ValueError(f"run {run.id}: no tpu_type in its parallelism and no default for scale "
                         f"{run.scale!r} (known: {sorted(DEFAULT_TPU_TYPE_BY_SCALE)})")
    return DEFAULT_TPU_TYPE_BY_SCALE[run.scale]


def tpu_slice(tpu_type: str) -> TpuSlice:
    if tpu_type not in TPU_SLICES:
        raise ValueError(f"unknown TPU type {tpu_type!r}; known: {', '.join(TPU_SLICES)}")
    return TPU_SLICES[tpu_type]

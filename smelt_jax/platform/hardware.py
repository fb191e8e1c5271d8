"""Hardware facts, in one table: chips (HBM size and bandwidth, dense bf16 peak FLOP/s, ICI bandwidth,
cores per chip, hosts), TPU slice names and their torus shapes. The trainer's MFU, the compile report and the sweep
backends all read them here; nothing else states a chip number.

    parse_slice("v5p-128")  -> Slice: 64 chips on 16 hosts, torus 4x4x4 ('v5p:4x4x4' for the compiler)
    peak_flops_for_device_kind("TPU v5 lite") -> (197e12, "TPU v5 lite bf16 data sheet")

Sources: the Cloud TPU system-architecture pages per generation (HBM, bf16 peak, "Interchip
Interconnect BW" 2400/1600/4800/3584 Gbps; v5p's page also gives it as 1200 GB/s bidirectional, egress
per chip is what a collective's sends share; the chip's links are spread evenly over its torus axes,
two per axis, so one axis carries egress / torus_dims), HBM bandwidth from the same pages and the
generations' spec sheets (v4 1,200 GB/s, v5e 819 GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s), the GKE TPU
pages (node labels, topologies, 4 chips per host on multi-host slices) and the vendors' data sheets for the
GPUs (dense bf16, no sparsity; HBM size and bandwidth of the H100 SXM5 and H200 SXM, 3.35 and 4.8 TB/s).
"""

from __future__ import annotations

import dataclasses
import re

from smelt_jax.platform.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip. TPU generations also carry what naming and placing a slice needs."""

    name: str
    peak_flops: float                 # dense bf16 FLOP/s per chip
    hbm_bytes: int | None = None
    ici_bytes_per_second: float | None = None  # inter-chip interconnect egress per chip
    hbm_bytes_per_second: float | None = None  # HBM bandwidth per chip (spec sheet)
    cores_per_chip: int = 1           # slice names of v4 and v5p count TensorCores (2 per chip)
    torus_dims: int = 0               # 3: 3D torus (v4, v5p); 2: 2D grid (v5e, v6e); 0: not a TPU
    single_host_chips: int = 4        # the largest slice that is one host (8 for v5e/v6e)
    gke_accelerator: str = ""         # node label cloud.google.com/gke-tpu-accelerator
    runtime_version: str = ""         # TPU VM software version for `gcloud compute tpus`


TPU_CHIPS = {
    "v4": Chip("v4", peak_flops=275e12, hbm_bytes=32 * 2**30, ici_bytes_per_second=2400e9 / 8,
               hbm_bytes_per_second=1200e9, cores_per_chip=2, torus_dims=3, gke_accelerator="tpu-v4-podslice",
               runtime_version="tpu-ubuntu2204-base"),
    "v5e": Chip("v5e", peak_flops=197e12, hbm_bytes=16 * 2**30, ici_bytes_per_second=1600e9 / 8,
                hbm_bytes_per_second=819e9, torus_dims=2, single_host_chips=8, gke_accelerator="tpu-v5-lite-podslice",
                runtime_version="v2-alpha-tpuv5-lite"),
    "v5p": Chip("v5p", peak_flops=459e12, hbm_bytes=95 * 2**30, ici_bytes_per_second=4800e9 / 8,
                hbm_bytes_per_second=2765e9, cores_per_chip=2, torus_dims=3, gke_accelerator="tpu-v5p-slice",
                runtime_version="v2-alpha-tpuv5"),
    "v6e": Chip("v6e", peak_flops=918e12, hbm_bytes=32 * 2**30, ici_bytes_per_second=3584e9 / 8,
                hbm_bytes_per_second=1640e9, torus_dims=2, single_host_chips=8, gke_accelerator="tpu-v6e-slice",
                runtime_version="v2-alpha-tpuv6e"),
}
GPU_CHIPS = {
    "H100": Chip("H100", peak_flops=989e12, hbm_bytes=80 * 10**9, hbm_bytes_per_second=3.35e12),  # SXM5
    "H200": Chip("H200", peak_flops=989e12, hbm_bytes=141 * 10**9, hbm_bytes_per_second=4.8e12),
    "A100": Chip("A100", peak_flops=312e12),
}

# jax `device_kind` prefixes -> chip, matched in this order (so "TPU v5 lite" before "TPU v5").
DEVICE_KINDS = (
    ("TPU v4", TPU_CHIPS["v4"]), ("TPU v5 lite", TPU_CHIPS["v5e"]), ("TPU v5e", TPU_CHIPS["v5e"]),
    ("TPU v5p", TPU_CHIPS["v5p"]), ("TPU v5", TPU_CHIPS["v5p"]), ("TPU v6 lite", TPU_CHIPS["v6e"]),
    ("TPU v6e", TPU_CHIPS["v6e"]), ("NVIDIA H100", GPU_CHIPS["H100"]),
    ("NVIDIA H200", GPU_CHIPS["H200"]), ("NVIDIA A100", GPU_CHIPS["A100"]),
)

# Chips -> physical shape, for the 3D-torus generations (v4, v5p) and the 2D ones (v5e, v6e).
TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8"}
GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def chip_for_device_kind(kind: str) -> tuple[str, Chip] | None:
    """(the matched prefix, the chip) for a jax `device_kind`, or None for a device not in the table
    (e.g. a CPU)."""
    for prefix, chip in DEVICE_KINDS:
        if kind.startswith(prefix):
            return prefix, chip
    return None


def peak_flops_for_device_kind(kind: str) -> tuple[float, str] | None:
    """(dense bf16 peak FLOP/s of one device, where the number comes from) for a jax `device_kind`,
    or None for a device not in the table (e.g. a CPU)."""
    found = chip_for_device_kind(kind)
    return None if found is None else (found[1].peak_flops, f"{found[0]} bf16 data sheet")


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: 'v5p-128' = 128 TensorCores = 64 chips on 16 hosts of 4, shape 4x4x4.

    v4 and v5p names count TensorCores (2 per chip), v5e ('v5e-N' or 'v5litepod-N') and v6e count chips.
    """

    name: str        # as written: the TPU type given to xpk, GKE and gcloud
    generation: str  # key of TPU_CHIPS
    chips: int
    shape: str       # physical shape, e.g. '4x4x4': the GKE node label cloud.google.com/gke-tpu-topology

    @property
    def chip(self) -> Chip:
        return TPU_CHIPS[self.generation]

    @property
    def topology_desc(self) -> str:
        """The compiler's topology name (`jax.experimental.topologies.get_topology_desc`): 'v5p:4x4x4'."""
        return f"{self.generation}:{self.shape}"

    @property
    def chips_per_host(self) -> int:
        """Chips of one host: the whole slice up to a single host's size, else 4."""
        return self.chips if self.chips <= self.chip.single_host_chips else 4

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes

    @property
    def peak_flops(self) -> float:
        return self.chip.peak_flops

    @property
    def ici_bytes_per_second(self) -> float:
        return self.chip.ici_bytes_per_second

    @property
    def hbm_bytes_per_second(self) -> float:
        return self.chip.hbm_bytes_per_second

    @property
    def ici_bytes_per_second_per_axis(self) -> float:
        """ICI egress of one chip along one torus axis (both directions): egress / torus_dims."""
        return self.chip.ici_bytes_per_second / self.chip.torus_dims

    def ici_axes_spanned(self, group_size: int) -> int:
        """Torus axes a collective over `group_size` chips uses at least: the fewest physical axes (largest
        first) whose chips multiply to the group size or more, e.g. 8 chips of 4x4x4 -> 2 axes, 64 -> 3.
        The mesh-to-torus mapping is not read from the program, so this is the most favourable case."""
        dims = sorted((int(d) for d in self.shape.split("x")), reverse=True)
        chips, axes = 1, 0
        for dim in dims:
            if chips >= group_size:
                break
            chips, axes = chips * dim, axes + 1
        return max(axes, 1)

    def ici_bytes_per_second_for_group(self, group_size: int) -> float:
        """Egress one chip has for a collective over `group_size` chips: the axes it spans x one axis's."""
        return self.ici_axes_spanned(group_size) * self.ici_bytes_per_second_per_axis

    @property
    def gke_accelerator(self) -> str:
        return self.chip.gke_accelerator

    @property
    def runtime_version(self) -> str:
        return self.chip.runtime_version


def parse_slice(name: str) -> Slice:
    """'v5p-128' -> Slice(generation 'v5p', 64 chips, shape '4x4x4'); a clear error for any other name."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
    if not match:
        raise UsageError(f"TPU slice {name!r}: want e.g. v5p-128, v5e-256, v6e-64, v4-32")
    generation = "v5e" if match.group(1) == "v5litepod" else match.group(1)
    chip = TPU_CHIPS[generation]
    count = int(match.group(2))
    chips = count // chip.cores_per_chip
    table = TORUS_3D if chip.torus_dims == 3 else GRID_2D
    if count % chip.cores_per_chip or chips not in table:
        raise UsageError(f"TPU slice {name!r}: {count / chip.cores_per_chip:g} chips is not a known "
                         f"{generation} shape ({sorted(table)})")
    return Slice(name, generation, chips, table[chips])


def slice_names(generation: str) -> list[str]:
    """Every slice name of a generation this table knows, smallest first ('v5p-8', 'v5p-16', ...)."""
    chip = TPU_CHIPS[generation]
    table = TORUS_3D if chip.torus_dims == 3 else GRID_2D
    return [f"{generation}-{chips * chip.cores_per_chip}" for chips in sorted(table)]

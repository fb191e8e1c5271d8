"""The one hardware table (smelt_jax.platform.hardware): slice names, chip counts, hosts and torus shapes agree
with each other, and the numbers the trainer, the compile report and the sweep backends read are pinned."""

import math

import pytest

from smelt_jax.platform import hardware as hw


@pytest.mark.parametrize("generation", sorted(hw.TPU_CHIPS))
def test_every_slice_name_is_consistent(generation):
    chip = hw.TPU_CHIPS[generation]
    names = hw.slice_names(generation)
    assert names
    for name in names:
        s = hw.parse_slice(name)
        assert s.name == name and s.generation == generation and s.chip is chip
        assert int(name.split("-")[1]) == s.chips * chip.cores_per_chip  # v4/v5p count cores
        dims = [int(d) for d in s.shape.split("x")]
        assert len(dims) == chip.torus_dims and math.prod(dims) == s.chips
        assert s.hosts * s.chips_per_host == s.chips and s.hosts >= 1
        assert s.chips_per_host == s.chips or s.chips_per_host == 4
        assert s.topology_desc == f"{generation}:{s.shape}"
        assert (s.hbm_bytes, s.peak_flops, s.ici_bytes_per_second) == (
            chip.hbm_bytes, chip.peak_flops, chip.ici_bytes_per_second)
        assert s.gke_accelerator.startswith("tpu-") and s.runtime_version


def test_slices_the_suites_use():
    """What the sweep backends and the compile report agreed on before they shared this table."""
    expected = {  # name: (chips, hosts, chips per host, GKE topology)
        "v5p-8": (4, 1, 4, "2x2x1"), "v5p-16": (8, 2, 4, "2x2x2"), "v5p-32": (16, 4, 4, "2x2x4"),
        "v5p-64": (32, 8, 4, "2x4x4"), "v5p-128": (64, 16, 4, "4x4x4"),
        "v5p-256": (128, 32, 4, "4x4x8"), "v5p-512": (256, 64, 4, "4x8x8"),
        "v6e-8": (8, 1, 8, "2x4"), "v6e-16": (16, 4, 4, "4x4"), "v6e-32": (32, 8, 4, "4x8"),
        "v6e-64": (64, 16, 4, "8x8"), "v6e-256": (256, 64, 4, "16x16"),
        "v5e-256": (256, 64, 4, "16x16"), "v5litepod-4": (4, 1, 4, "2x2"), "v4-32": (16, 4, 4, "2x2x4"),
    }
    for name, (chips, hosts, per_host, shape) in expected.items():
        s = hw.parse_slice(name)
        assert (s.chips, s.hosts, s.chips_per_host, s.shape) == (chips, hosts, per_host, shape), name
    v5p, v6e = hw.parse_slice("v5p-128"), hw.parse_slice("v6e-16")
    assert (v5p.gke_accelerator, v5p.runtime_version) == ("tpu-v5p-slice", "v2-alpha-tpuv5")
    assert (v6e.gke_accelerator, v6e.runtime_version) == ("tpu-v6e-slice", "v2-alpha-tpuv6e")
    assert v5p.hbm_bytes == 95 * 2**30 and v5p.ici_bytes_per_second == 600e9  # 4800 Gbps / 8


@pytest.mark.parametrize("name, match", [("v5p128", "want e.g."), ("v5p-6", "not a known"),
                                         ("v5p-9", "not a known"), ("v7-8", "want e.g.")])
def test_bad_slice_names_are_clear_errors(name, match):
    with pytest.raises(ValueError, match=match):
        hw.parse_slice(name)


def test_peak_flops_by_device_kind():
    # the trainer's former PEAK_FLOPS table, value for value
    former = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12, "NVIDIA H100": 989e12,
              "NVIDIA H200": 989e12, "NVIDIA A100": 312e12}
    for kind, peak in former.items():
        assert hw.peak_flops_for_device_kind(kind) == (peak, f"{kind} bf16 data sheet")
    assert hw.peak_flops_for_device_kind("TPU v5 lite")[0] == hw.TPU_CHIPS["v5e"].peak_flops
    assert hw.peak_flops_for_device_kind("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert hw.peak_flops_for_device_kind("cpu") is None
    # every TPU chip is reachable from a device kind, and carries the same peak as its slices
    assert {chip.name for _, chip in hw.DEVICE_KINDS} >= set(hw.TPU_CHIPS)


def test_hbm_bandwidth_and_ici_per_torus_axis():
    # spec sheets: v5e 819 GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s
    assert {g: hw.TPU_CHIPS[g].hbm_bytes_per_second for g in ("v5e", "v5p", "v6e")} == {
        "v5e": 819e9, "v5p": 2765e9, "v6e": 1640e9}
    v5p = hw.parse_slice("v5p-128")  # 4x4x4
    assert v5p.hbm_bytes_per_second == 2765e9
    assert v5p.ici_bytes_per_second_per_axis == pytest.approx(600e9 / 3)
    assert [v5p.ici_axes_spanned(g) for g in (1, 2, 4, 8, 16, 17, 64)] == [1, 1, 1, 2, 2, 3, 3]
    assert v5p.ici_bytes_per_second_for_group(64) == pytest.approx(v5p.ici_bytes_per_second)
    v5e = hw.parse_slice("v5e-256")  # 16x16, 2 axes
    assert [v5e.ici_axes_spanned(g) for g in (16, 17, 256)] == [1, 2, 2]
    assert v5e.ici_bytes_per_second_for_group(256) == pytest.approx(v5e.ici_bytes_per_second)

"""Tile sizes of the Pallas grouped matmuls (`gmm.py`, `swiglu.py`): per TPU generation, fitted to a
problem's shape, and the VMEM a one-block tiling needs; the input checks and padding both kernels share.
Split from gmm.py (issue 52): choosing tiles is one decision, running the kernels another."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

Tiling = tuple[int, int, int]

# Row tiles are multiples of 16 (bf16 packs 16 rows per vreg); k and n tiles multiples of 128 (lanes).
ROW_ALIGN = 16
LANE_ALIGN = 128

# Default (tm, tk, tn) per TPU generation; see docs/kernels.md for the VMEM arithmetic behind them.
DEFAULT_TILING: dict[str, Tiling] = {
    "v5e": (512, 512, 512),
    "v5p": (512, 512, 512),
    "v6e": (512, 1024, 1024),
    "other": (512, 512, 512),
}

# The widest k or n (lanes) the default tiling keeps as ONE block, per TPU generation: the whole model
# width d (and the expert width f) in one block needs no zero-pad / slice copies around the kernels (a
# block equal to the full dimension need not be a multiple of 128), and with k in one block the weight
# block index (group, 0, n tile) stays the same over a group's consecutive row tiles, so the pipeline
# fetches each group's weights once per n tile instead of once per row tile. 2560 covers every smelt16
# width (d <= 2520, f <= 768); the fused SwiGLU kernel's VMEM at tm 512 and smelt16's widest (d 2304,
# f 768; bf16, double buffered, two f32 accumulators) is ~23 MiB (`one_block_vmem_bytes`), its weight
# gradient kernel's ~33 MiB, under 3/4 of the VMEM per core (v5p 64 MiB, v5e / v6e 128 MiB); checked by
# Mosaic compiles for v5p (tests/test_kernel_tiles.py). 'other' (v4, unknown chips) keeps 1024.
ONE_BLOCK_LANES: dict[str, int] = {"v5e": 2560, "v5p": 2560, "v6e": 2560, "other": 1024}

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# --------------------------------------------------------------------------------------------- helpers


def tpu_generation() -> str | None:
    """'v5e' / 'v5p' / 'v6e' / 'other' for the TPU being traced for (real or AOT mesh), None off TPU."""
    if not pltpu.is_tpu_device():
        return None
    kind = pltpu.get_tpu_info().chip_version
    return {pltpu.ChipVersion.TPU_V5E: "v5e", pltpu.ChipVersion.TPU_V5P: "v5p",
            pltpu.ChipVersion.TPU_V6E: "v6e"}.get(kind, "other")


def default_tiling() -> Tiling:
    """The default (tm, tk, tn) for the TPU being traced for (DEFAULT_TILING['other'] off TPU)."""
    return DEFAULT_TILING[tpu_generation() or "other"]


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _validate_tiling(tiling: Sequence[int]) -> Tiling:
    if len(tiling) != 3 or any(int(t) <= 0 for t in tiling):
        raise ValueError(f"tiling must be three positive ints (tm, tk, tn); got {tiling!r}")
    tm, tk, tn = (int(t) for t in tiling)
    if tm % ROW_ALIGN:
        raise ValueError(f"row tile tm={tm} must be a multiple of {ROW_ALIGN}")
    if tk % LANE_ALIGN or tn % LANE_ALIGN:
        raise ValueError(f"tiles tk={tk}, tn={tn} must be multiples of {LANE_ALIGN}")
    return tm, tk, tn


def fit_row_tile(m: int, tm: int) -> int:
    """Row tile actually used: tm, shrunk (to a multiple of ROW_ALIGN) when there are fewer rows."""
    return min(tm, round_up(max(m, 1), ROW_ALIGN))


def fit_lane_tile(dim: int, tile: int, one_block: int = 0) -> int:
    """Tile actually used along k or n: the whole dimension when it fits in one tile or is at most
    `one_block` lanes; otherwise the multiple of LANE_ALIGN up to `tile` that pads `dim` least (the
    largest such tile on a tie).

    Operands are zero-padded to a multiple of the tile and the padding is computed like real work:
    d_model 672 with 512-wide tiles pads to 1024 (x1.52), with 384-wide ones to 768 (x1.14); as one
    block (one_block >= 672) it is not padded at all."""
    if dim <= max(tile, one_block):
        return dim
    candidates = range(LANE_ALIGN, tile + 1, LANE_ALIGN)  # tile is a validated multiple
    return min(candidates, key=lambda t: (round_up(dim, t), -t))


def pad_to(x: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Zero-pad x at the end of each axis up to `shape` (no copy when already that shape)."""
    widths = [(0, int(s) - d) for d, s in zip(x.shape, shape)]
    if any(w[1] < 0 for w in widths):
        raise ValueError(f"cannot pad {x.shape} down to {tuple(shape)}")
    return x if all(w[1] == 0 for w in widths) else jnp.pad(x, widths)


def check_group_sizes(group_sizes: jax.Array, num_groups: int) -> None:
    if group_sizes.ndim != 1 or group_sizes.shape[0] != num_groups:
        raise ValueError(f"group_sizes must have shape [{num_groups}]; got {group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32; got {group_sizes.dtype}")


def check_dtype(name: str, x: jax.Array) -> None:
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16; got {x.dtype}")


def effective_tiling(m: int, k: int, n: int, tiling: Sequence[int] | None,
                     generation: str | None = None) -> Tiling:
    """(tm, tk, tn) after defaults and fitting to the problem (see fit_row_tile / fit_lane_tile).

    tiling None: the defaults of `generation` ('v5e', 'v5p', 'v6e', 'other'; None = the TPU being traced
    for), with k and n up to ONE_BLOCK_LANES[generation] as one block each. An explicit tiling is
    fitted without that widening."""
    if tiling is None:
        generation = generation or tpu_generation() or "other"
        one_block = ONE_BLOCK_LANES.get(generation, ONE_BLOCK_LANES["other"])
        tm, tk, tn = DEFAULT_TILING.get(generation, DEFAULT_TILING["other"])
        return fit_row_tile(m, tm), fit_lane_tile(k, tk, one_block), fit_lane_tile(n, tn, one_block)
    tm, tk, tn = _validate_tiling(tiling)
    return fit_row_tile(m, tm), fit_lane_tile(k, tk), fit_lane_tile(n, tn)


def one_block_vmem_bytes(tm: int, k: int, n: int, itemsize: int = 2) -> int:
    """VMEM the fused SwiGLU kernel (the largest of the expert kernels) holds with k and n in one block
    each: x [tm, k] and two weights [k, n] double buffered, output [tm, n] double buffered, and two f32
    accumulators [tm, n] (the estimate `grouped_matmul_call` sizes its scoped VMEM limit from)."""
    return 2 * (tm * k + 2 * k * n + tm * n) * itemsize + 2 * 4 * tm * n

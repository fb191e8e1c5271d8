"""Bytes an HLO shape occupies in HBM, read from its TPU layout: tile padding charged, on-chip buffers free.

    hbm_shape_bytes("f32[5,100]{1,0:T(8,128)}") -> 8 * 128 * 4 = 4096.0   (padded to whole tiles)
    hbm_shape_bytes("f32[128,256]{1,0:T(8,128)S(1)}") -> 0.0             (memory space 1: VMEM)
    hbm_shape_bytes("(bf16[2,3]{1,0}, s32[])") -> 16.0                   (no tiles: dense; tuples summed)

A TPU layout `{minor_to_major:T(a,b)(c,d)...S(m)}` stores the array's dimensions in physical order
(major to minor: `minor_to_major` reversed) and cuts the last len(T) physical dimensions into tiles of
the first tile's size, padding each to a multiple of it (f32 T(8,128): 8 sublanes x 128 lanes; bf16
T(16,128) or T(8,128)(2,1)). Later tiles subdivide the first tile and add no padding here (their sizes
divide it in the layouts the TPU compiler writes). Memory space S(1) is the TPU core's vector memory
(VMEM): such a buffer never touches HBM. Any other memory space but 0 (HBM) is counted as on-chip too
(SMEM and semaphores are S(2)+); a shape without a layout is dense.
"""

from __future__ import annotations

import math
import re

from smelt_jax.compile.hlo_module import DTYPE_BYTES

_ARRAY_WITH_LAYOUT = re.compile(
    r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\](\{[^{}]*\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def _padded_elements(dims: list[int], layout: str) -> int:
    """Elements stored for an array of `dims` under `layout` ("{1,0:T(8,128)}"), tile padding included."""
    body = layout[1:-1]
    order, _, attributes = body.partition(":")
    minor_to_major = [int(v) for v in order.split(",") if v.strip().isdigit()]
    tile = _TILE.search(attributes)
    if tile is None or len(minor_to_major) != len(dims):
        return math.prod(dims)
    physical = [dims[i] for i in reversed(minor_to_major)]  # major -> minor
    sizes = [int(v) for v in tile.group(1).split(",")]
    for offset, size in enumerate(reversed(sizes), start=1):  # the tile's last size is the minor-most
        if offset <= len(physical) and size > 0:
            physical[-offset] = -(-physical[-offset] // size) * size
    return math.prod(physical)


def memory_space(layout: str | None) -> int:
    """The layout's memory space (0: HBM, 1: VMEM, ...); 0 without a layout or an `S(n)`."""
    found = _MEMORY_SPACE.search(layout or "")
    return int(found.group(1)) if found else 0


def hbm_shape_bytes(shape: str) -> float:
    """HBM bytes of every array in an HLO shape string: tile-padded, on-chip arrays 0, tuples summed."""
    total = 0.0
    for dtype, dims, layout in _ARRAY_WITH_LAYOUT.findall(shape):
        if memory_space(layout):
            continue
        sizes = [int(d) for d in dims.split(",") if d]
        elements = _padded_elements(sizes, layout) if layout else math.prod(sizes)
        total += DTYPE_BYTES[dtype] * elements
    return total


def is_on_chip(shape: str) -> bool:
    """Whether every array of `shape` lives outside HBM (at least one array, all in a memory space > 0)."""
    layouts = [layout for _, _, layout in _ARRAY_WITH_LAYOUT.findall(shape)]
    return bool(layouts) and all(memory_space(layout) for layout in layouts)

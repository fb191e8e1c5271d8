"""The `tiled` expert backend before -> after issue 28 at the matched micro pairs' shapes (docs/kernels.md,
"The `tiled` backend (CPU default)").

    python -m benchmarks.run tiles

Forward + backward (gradients of x and the three weights) at m = 4,096 routed rows (8 x 256 tokens, top-2),
float32, for both members of micro-m-s95 and micro-l-s97 and at the peer benchmark's shape (16 experts).
Group sizes: a multinomial draw over Dirichlet(4) expert shares (seed 0; each draw's max/mean load is in
the table). "before" is the
previous design, kept here only to be timed: each expert padded to a 64/128-row tile with the static tile
count floor((m + E(tile - 1)) / tile), per-tile weights gathered [n_tiles, d, f], batched einsums, plain
autodiff. "after" is `kernels.tiled.tiled_expert_ffn`. Rounds interleave the two; medians of ROUNDS.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_info import cpu_line
from smelt_jax.kernels.rows import swiglu
from smelt_jax.kernels.tiled import computed_rows, padded_rows, tiled_expert_ffn

ROWS = 4096
TOKENS = 2048  # the MoE layer's bound on any group (a token picks distinct experts)
PAIRS = {  # run -> (d_model, n_experts, expert_ffn), from experiments/micro.py
    "micro-m-s95 Baseline": (192, 48, 256), "micro-m-s95 SMELT": (160, 80, 184),
    "micro-l-s97 Baseline": (240, 80, 320), "micro-l-s97 SMELT": (192, 132, 244),
    "issue-17 / peer benchmark shape": (256, 16, 256),
}
ROUNDS = 5


def _before_tile(m: int, n_experts: int) -> int:
    return 128 if m >= 128 * n_experts else 64


def _before_tiles(m: int, n_experts: int, tile: int) -> int:
    return max(1, min((m + n_experts * (tile - 1)) // tile, n_experts * -(-TOKENS // tile)))


def _before(x, w_gate, w_up, w_down, group_sizes):
    """The padded-tile design this issue replaced (kernels/tiled.py at 6393baf), for timing only."""
    m, d = x.shape
    n_experts = w_gate.shape[0]
    tile = _before_tile(m, n_experts)
    n_tiles = _before_tiles(m, n_experts, tile)
    tiles_per_expert = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_expert)
    padded_starts = (tile_ends - tiles_per_expert) * tile
    starts = jnp.cumsum(group_sizes) - group_sizes
    tile_expert = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(n_tiles), side="right"), n_experts - 1)
    slot = jnp.arange(n_tiles * tile)
    slot_expert = jnp.repeat(tile_expert, tile, total_repeat_length=n_tiles * tile)
    offset = slot - padded_starts[slot_expert]
    in_group = (offset >= 0) & (offset < group_sizes[slot_expert]) & (slot < tile_ends[-1] * tile)
    source = jnp.where(in_group, starts[slot_expert] + offset, m)
    row = jnp.arange(m)
    row_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right"), n_experts - 1)
    target = jnp.where(row < jnp.sum(group_sizes), padded_starts[row_expert] + row - starts[row_expert],
                       n_tiles * tile)
    x_tiles = jnp.take(x, source, axis=0, mode="fill", fill_value=0).reshape(n_tiles, tile, d)
    wg, wu, wd = (jnp.take(w, tile_expert, axis=0) for w in (w_gate, w_up, w_down))
    gate = jnp.einsum("tmd,tdf->tmf", x_tiles, wg, preferred_element_type=jnp.float32)
    up = jnp.einsum("tmd,tdf->tmf", x_tiles, wu, preferred_element_type=jnp.float32)
    out = jnp.einsum("tmf,tfd->tmd", swiglu(gate, up, x.dtype), wd, preferred_element_type=jnp.float32)
    return jnp.take(out.reshape(n_tiles * tile, d), target, axis=0, mode="fill", fill_value=0)


def _sizes(n_experts: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.multinomial(ROWS, rng.dirichlet(np.full(n_experts, 4.0))).astype(np.int32)


def _timed(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run() -> str:
    cases = []
    for name, (d, n_experts, f) in PAIRS.items():
        keys = jax.random.split(jax.random.key(0), 4)
        args = (jax.random.normal(keys[0], (ROWS, d)), 0.05 * jax.random.normal(keys[1], (n_experts, d, f)),
                0.05 * jax.random.normal(keys[2], (n_experts, d, f)),
                0.05 * jax.random.normal(keys[3], (n_experts, f, d)))
        sizes = _sizes(n_experts)
        fns = [jax.jit(jax.grad(lambda *a, impl=impl, g=jnp.asarray(sizes): jnp.sum(impl(*a, g) ** 2),
                                argnums=(0, 1, 2, 3))) for impl in (_before, tiled_expert_ffn)]
        for fn in fns:
            jax.block_until_ready(fn(*args))  # compile
        cases.append((name, d, n_experts, f, sizes, fns, args, [[], []]))
    for _ in range(ROUNDS):
        for *_, fns, args, times in cases:
            for fn, out in zip(fns, times):
                out.append(_timed(fn, args))
    lines = ["## `tiled` before -> after issue 28 at the matched micro pairs (fwd + bwd, float32)", "",
             f"{cpu_line()}; jax {jax.__version__}. m = {ROWS:,} routed rows; medians of {ROUNDS} interleaved "
             "rounds after one compiling call.", "",
             "| run | d, E, f | max/mean load | rows computed before (x routed) | after (x routed) | "
             "bound after | ms before | ms after | speed-up |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, d, n_experts, f, sizes, _, _, (before, after) in cases:
        tile = _before_tile(ROWS, n_experts)
        rows_before = _before_tiles(ROWS, n_experts, tile) * tile
        ms_before, ms_after = 1e3 * np.median(before), 1e3 * np.median(after)
        lines.append(f"| {name} | {d}, {n_experts}, {f} | {sizes.max() / sizes.mean():.2f} | "
                     f"{rows_before:,} ({rows_before / ROWS:.2f}x, tile {tile}) | "
                     f"{computed_rows(sizes):,} ({computed_rows(sizes) / ROWS:.3f}x) | "
                     f"{padded_rows(ROWS, n_experts) / ROWS:.3f}x | {ms_before:,.0f} | {ms_after:,.0f} | "
                     f"{ms_before / ms_after:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

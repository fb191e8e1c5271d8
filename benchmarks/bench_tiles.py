"""Row tile of the `tiled` expert backend at the micro suite's shapes (docs/kernels.md, "Many experts").

    python -m benchmarks.run tiles

Forward + backward (gradients of x and the three weights) of `tiled_expert_ffn` for tiles 16-128 and of
the dropless `capacity` backend, m = 4,096 routed rows (8 x 256 tokens, top-2) split over the experts
with Zipf-skewed sizes, float32; medians of 5 after one compile-and-run, all in one process.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.kernels.tiled import default_tile, tiled_expert_ffn

ROWS = 4096
SHAPES = ((64, 124, 124), (96, 70, 200), (160, 136, 180), (192, 48, 256), (240, 16, 320))  # d, E, f
TILES = (16, 32, 64, 128)
REPS = 5


def _zipf_sizes(n_experts: int, m: int) -> jax.Array:
    p = 1.0 / np.arange(1, n_experts + 1)
    sizes = np.floor(p / p.sum() * m).astype(np.int32)
    sizes[0] += m - sizes.sum()
    return jnp.asarray(sizes)


def _median_ms(fn, args) -> float:
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3)))
    jax.block_until_ready(grad(*args))
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        jax.block_until_ready(grad(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def run() -> str:
    lines = ["## `tiled` row tile at micro shapes (fwd + bwd, ms)", "",
             "| d, E, f | " + " | ".join(f"tile {t}" for t in TILES) + " | capacity (C = T) | default |",
             "|---|" + "---:|" * (len(TILES) + 2)]
    for d, n_experts, f in SHAPES:
        keys = jax.random.split(jax.random.key(0), 4)
        args = (jax.random.normal(keys[0], (ROWS, d)),
                0.05 * jax.random.normal(keys[1], (n_experts, d, f)),
                0.05 * jax.random.normal(keys[2], (n_experts, d, f)),
                0.05 * jax.random.normal(keys[3], (n_experts, f, d)))
        sizes = _zipf_sizes(n_experts, ROWS)
        cells = [_median_ms(lambda *a, t=t, g=sizes: tiled_expert_ffn(*a, g, tile=t, capacity=ROWS), args)
                 for t in TILES]
        cells.append(_median_ms(lambda *a, g=sizes: expert_ffn(*a, g, impl="capacity", capacity=ROWS), args))
        lines.append(f"| {d}, {n_experts}, {f} | " + " | ".join(f"{c:,.0f}" for c in cells)
                     + f" | {default_tile(ROWS, n_experts)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

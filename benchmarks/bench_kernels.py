"""Pallas expert kernels: CPU interpret-mode timings (correctness only) and TPU compile-time cost analysis.

`run()` returns a markdown table. The CPU rows time the kernels in Pallas *interpret* mode, which emulates
the grid step by step: these numbers say nothing about TPU speed and are reported only to show the
kernels run and agree with the references. The TPU rows (when libtpu is installed) come from ahead-of-time
Mosaic compilation for one chip of each topology: compile seconds and the compiler's cost analysis; the
kernels were never run on TPU hardware.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

TOKENS, D_MODEL, D_FF, EXPERTS = 1024, 256, 128, 8
TILING = (256, 256, 128)
REPEATS = 3


def _inputs(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (TOKENS, D_MODEL), dtype)
    w_gate = jax.random.normal(keys[1], (EXPERTS, D_MODEL, D_FF), dtype) / np.sqrt(D_MODEL)
    w_up = jax.random.normal(keys[2], (EXPERTS, D_MODEL, D_FF), dtype) / np.sqrt(D_MODEL)
    w_down = jax.random.normal(keys[3], (EXPERTS, D_FF, D_MODEL), dtype) / np.sqrt(D_FF)
    sizes = np.random.default_rng(0).multinomial(TOKENS, np.ones(EXPERTS) / EXPERTS).astype(np.int32)
    return x, w_gate, w_up, w_down, jnp.asarray(sizes)


def _median_seconds(fn, *args):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_rows():
    from smelt_jax.kernels.pallas_ffn import pallas_expert_ffn

    x, w_gate, w_up, w_down, sizes = _inputs()

    def ragged(x, w_gate, w_up, w_down, sizes):
        hidden = jax.nn.silu(jax.lax.ragged_dot(x, w_gate, sizes)) * jax.lax.ragged_dot(x, w_up, sizes)
        return jax.lax.ragged_dot(hidden, w_down, sizes)

    def pallas(x, w_gate, w_up, w_down, sizes):
        return pallas_expert_ffn(x, w_gate, w_up, w_down, sizes, interpret=True, tiling=TILING)

    def fwd_bwd(ffn):
        return jax.jit(jax.grad(lambda *w: jnp.sum(ffn(*w, sizes) ** 2), (0, 1, 2, 3)))

    ref = jax.jit(ragged)(x, w_gate, w_up, w_down, sizes)
    err = float(jnp.max(jnp.abs(jax.jit(pallas)(x, w_gate, w_up, w_down, sizes) - ref)))
    rows = []
    for name, ffn in (("jax.lax.ragged_dot (XLA:CPU)", ragged), ("pallas_expert_ffn (interpret)", pallas)):
        forward = _median_seconds(jax.jit(ffn), x, w_gate, w_up, w_down, sizes)
        backward = _median_seconds(fwd_bwd(ffn), x, w_gate, w_up, w_down)
        rows.append((name, forward, backward))
    base_f, base_b = rows[0][1], rows[0][2]
    lines = [(f"CPU, f32, {TOKENS} rows, d {D_MODEL}, ffn {D_FF}, {EXPERTS} experts, tiles {TILING}; "
              f"median of {REPEATS}. **Interpret mode is for correctness only, not a speed measurement.** "
              f"Max |pallas - ragged_dot| = {err:.1e}."), "",
             "| path | forward s | fwd+bwd s | forward / ragged_dot | fwd+bwd / ragged_dot |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {f:.3f} | {b:.3f} | {f / base_f:.2f} | {b / base_b:.2f} |" for n, f, b in rows]
    return lines


def _tpu_rows():
    from smelt_jax import aot
    from smelt_jax.kernels.pallas_ffn import pallas_expert_ffn

    available, reason = aot.libtpu_status()
    if not available:
        return [f"TPU ahead-of-time compilation skipped: {reason}"]
    shapes = (8192, 1024, 512, 8)  # tokens, d, ffn, experts: bf16, default tiles of each generation
    tokens, d, f, experts = shapes
    args = [jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16), jax.ShapeDtypeStruct((experts, d, f), jnp.bfloat16),
            jax.ShapeDtypeStruct((experts, d, f), jnp.bfloat16), jax.ShapeDtypeStruct((experts, f, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((experts,), jnp.int32)]

    def forward(*a):
        return pallas_expert_ffn(*a)

    def backward(x, w_gate, w_up, w_down, sizes):
        return jax.grad(lambda *w: jnp.sum(pallas_expert_ffn(*w, sizes).astype(jnp.float32)), (0, 1, 2, 3))(
            x, w_gate, w_up, w_down)

    lines = [(f"TPU (Mosaic, compiled ahead of time on this CPU for one chip; never run on hardware), bf16, "
              f"{tokens} rows, d {d}, ffn {f}, {experts} experts, default tiles. Flops are the kernels' own "
              f"cost estimates; optimal s is XLA's lower bound from those estimates."), "",
             "| topology | pass | compile s | flops (G) | optimal s (us) | peak HBM (MiB) |", "|---|---|---|---|---|---|"]
    for topology in ("v5e:2x2", "v5p:2x2x1", "v6e:2x2"):
        mesh = jax.sharding.Mesh(np.array(aot.tpu_topology(topology).devices[:1]), ("x",))
        for name, fn in (("forward", forward), ("fwd+bwd", backward)):
            _, summary = aot.compile_for_tpu(fn, args, mesh)
            # XLA reports a negative optimal_seconds when it has no estimate (seen on v5e and v6e).
            known = summary.optimal_seconds is not None and summary.optimal_seconds >= 0
            optimal = f"{summary.optimal_seconds * 1e6:.0f}" if known else "n/a"
            peak = "n/a" if summary.peak_bytes is None else f"{summary.peak_bytes / 2**20:.0f}"
            lines.append(f"| {topology} | {name} | {summary.compile_seconds:.2f} | {(summary.flops or 0) / 1e9:.1f}"
                         f" | {optimal} | {peak} |")
    return lines


def run() -> str:
    return "\n".join(["## Pallas expert kernels", "", *_cpu_rows(), "", *_tpu_rows(), ""])


if __name__ == "__main__":
    print(run())

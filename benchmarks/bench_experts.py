"""Forward + backward of one MoE layer per expert backend on this machine's CPU, and the dropless CPU
backends side by side at the issue-17 shape.

Reports medians of tokens/s and achieved GFLOP/s, where the FLOPs are the *useful* ones (router plus
top_k SwiGLU experts per token, x3 for forward + backward); backends that compute more (dense: every
expert; capacity: worst-case buffers) show it as a lower rate. The last column compares with a
2048^2 float32 matmul measured in the same run.

`dropless_table()`: `expert_ffn` forward + backward (gradients of x and the three weights) at
d_model 256, 16 experts top-2, expert width 256, 8 x 256 tokens, float32: `capacity` with C = T (the
old CPU default, dropless) against `tiled`, medians of DROPLESS_REPEATS, one
process, interleaved rounds so that load on the shared machine hits every backend alike.

    .venv/bin/python -m benchmarks.bench_experts             # both tables
    .venv/bin/python -m benchmarks.bench_experts dropless    # the side-by-side table only
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels.backend import EXPERT_BACKENDS, choose_expert_backend
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.kernels.tiled import tiled_expert_ffn
from smelt_jax.model.moe import MoE

SIZES = {
    # name: (tokens, d_model, expert_ffn, n_experts, top_k)
    "micro": (512, 64, 32, 8, 2),
    "small": (2048, 256, 128, 16, 4),
}
REPEATS = 3


def _median_seconds(fn, *args, repeats: int = REPEATS) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(n: int = 2048) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    seconds = _median_seconds(jax.jit(lambda x, y: x @ y), a, a, repeats=5)
    return 2 * n ** 3 / seconds / 1e9


def moe_train_seconds(impl: str, tokens: int, d_model: int, ffn: int, n_experts: int,
                      top_k: int) -> float:
    cfg = ModelConfig(vocab=16, d_model=d_model, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                      n_experts=n_experts, top_k=top_k, expert_ffn=ffn, expert_impl=impl)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, tokens, d_model), jnp.float32)
    mask = jnp.ones((1, tokens), bool)

    @nnx.jit
    def step(moe, x):
        def loss(moe, x):
            y, stats = moe(x, mask)
            return jnp.mean(jnp.square(y)) + stats["load_balance_loss"]
        return nnx.grad(loss, argnums=(0, 1))(moe, x)

    return _median_seconds(step, moe, x)


def useful_train_flops(tokens: int, d_model: int, ffn: int, n_experts: int, top_k: int) -> float:
    forward = 2 * tokens * (d_model * n_experts + top_k * 3 * d_model * ffn)
    return 3 * forward


def backends() -> list[str]:
    return list(EXPERT_BACKENDS)


# The issue-17 configuration: tokens (8 x 256), d_model, expert width, experts, top-k.
DROPLESS_SHAPE = (8 * 256, 256, 256, 16, 2)
DROPLESS_REPEATS = 7


def _routed_group_sizes(tokens: int, n_experts: int, top_k: int, seed: int = 0) -> jax.Array:
    """Group sizes of a random top-k routing (each token picks k distinct experts)."""
    logits = jax.random.normal(jax.random.key(seed), (tokens, n_experts))
    ids = jax.lax.top_k(logits, top_k)[1].reshape(-1)
    return jnp.bincount(ids, length=n_experts).astype(jnp.int32)


def dropless_steps() -> dict[str, tuple]:
    """name -> (jitted fwd+bwd of the expert FFN, its arguments) at DROPLESS_SHAPE."""
    tokens, d_model, ffn, n_experts, top_k = DROPLESS_SHAPE
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens * top_k, d_model), jnp.float32)
    w_gate = jax.random.normal(keys[1], (n_experts, d_model, ffn)) / d_model ** 0.5
    w_up = jax.random.normal(keys[2], (n_experts, d_model, ffn)) / d_model ** 0.5
    w_down = jax.random.normal(keys[3], (n_experts, ffn, d_model)) / ffn ** 0.5
    sizes = _routed_group_sizes(tokens, n_experts, top_k)

    def step(ffn_call):
        loss = lambda *w: jnp.sum(jnp.square(ffn_call(*w, sizes)))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    # The MoE layer's bound: no expert gets more than T rows (dropless).
    steps = {"capacity (C = T)": step(lambda *a: expert_ffn(*a, impl="capacity", capacity=tokens))}
    steps["tiled"] = step(tiled_expert_ffn)
    return {name: (fn, (x, w_gate, w_up, w_down)) for name, fn in steps.items()}


def dropless_table(repeats: int = DROPLESS_REPEATS) -> str:
    tokens, d_model, ffn, n_experts, top_k = DROPLESS_SHAPE
    steps = dropless_steps()
    for fn, args in steps.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved: every round times each backend once
        for name, (fn, args) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    flops = 3 * 2 * tokens * top_k * 3 * d_model * ffn  # routed expert FLOPs, fwd + bwd
    base = medians["capacity (C = T)"]
    lines = [f"Dropless expert FFN fwd+bwd on CPU ({jax.devices()[0].device_kind}, jax {jax.__version__}): "
             f"{tokens} tokens x top-{top_k} of {n_experts} experts, d_model {d_model}, width {ffn}, "
             f"float32; medians of {repeats} interleaved rounds. `auto` on CPU = "
             f"{choose_expert_backend('auto', 'cpu')}.", "",
             "| backend | ms | routed GFLOP/s | speed-up over capacity |", "|---|---:|---:|---:|"]
    for name, seconds in medians.items():
        lines.append(f"| {name} | {1e3 * seconds:.1f} | {flops / seconds / 1e9:.1f} "
                     f"| {base / seconds:.2f}x |")
    return "\n".join(lines)


def run() -> str:
    peak = matmul_gflops()
    header = (f"CPU: {jax.devices()[0].device_kind}, jax {jax.__version__}; 2048^2 fp32 matmul "
              f"{peak:.0f} GFLOP/s (median of 5). MoE layer fwd+bwd, fp32, medians of {REPEATS}.")
    columns = ("| size | tokens x d x ffn, E/top-k | backend | ms | tokens/s | useful GFLOP/s "
               "| vs matmul | vs capacity (time) |")
    lines = [header, "", columns, "|---|---|---|---:|---:|---:|---:|---:|"]
    for size, shape in SIZES.items():
        tokens, d_model, ffn, n_experts, top_k = shape
        flops = useful_train_flops(*shape)
        seconds = {impl: moe_train_seconds(impl, *shape) for impl in backends()}
        for impl, s in seconds.items():
            lines.append(
                f"| {size} | {tokens} x {d_model} x {ffn}, {n_experts}/{top_k} | {impl} "
                f"| {1e3 * s:.1f} | {tokens / s:,.0f} | {flops / s / 1e9:.1f} "
                f"| {flops / s / 1e9 / peak:.3f} | {s / seconds['capacity']:.2f}x |")
    return "\n".join(lines) + "\n\n" + dropless_table()


if __name__ == "__main__":
    print(dropless_table() if sys.argv[1:] == ["dropless"] else run())

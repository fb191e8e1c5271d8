"""Forward + backward of one MoE layer per expert backend on this machine's CPU.

Reports medians of tokens/s and achieved GFLOP/s, where the FLOPs are the *useful* ones (router plus
top_k SwiGLU experts per token, x3 for forward + backward); backends that compute more (dense: every
expert; capacity: worst-case buffers) show it as a lower rate. The last column compares with a
2048^2 float32 matmul measured in the same run.

    .venv/bin/python -m benchmarks.bench_experts
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.config import ModelConfig
from smelt_jax.kernels.experts import EXPERT_BACKENDS, _pallas_kernel
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
    return [b for b in EXPERT_BACKENDS if b != "pallas" or _pallas_kernel() is not None]


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
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())

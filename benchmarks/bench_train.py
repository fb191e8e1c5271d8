"""Trainer throughput on micro configurations vs the input pipeline feeding it.

Times the jitted train step (compile excluded; medians over steps) of the micro suite's `xs` and
`s` S~95% pair, with real batches from the embedded corpus, and the pipeline's `batch_at` for the
same batch shape. Reports tokens/s, achieved FLOP/s (budget FLOPs per token x tokens/s), MFU
against the measured CPU matmul peak, and how many times faster the pipeline is than the trainer.
"""

from __future__ import annotations

import statistics
import time

STEPS = 8
PAIRS = (("xs", "s95"), ("s", "s95"))


def run() -> str:
    import jax
    import jax.numpy as jnp

    import experiments
    from smelt_jax.design import budget as budget_lib
    from smelt_jax.data.corpus import open_dataset
    from smelt_jax.data.pipeline import TrainPipeline
    from smelt_jax.train.state import init_params
    from smelt_jax.train.step import make_train_step, optimizer
    from smelt_jax.train.mfu import peak_flops_per_device

    corpus = open_dataset(None)
    peak, peak_source = peak_flops_per_device()
    rows = []
    for run_spec in experiments.load_suite("micro"):
        if (run_spec.scale, run_spec.sparsity_label) not in PAIRS:
            continue
        sched, cfg = run_spec.schedule, run_spec.model
        pipeline = TrainPipeline.from_schedule(corpus, sched)
        graphdef, params = init_params(cfg, 0)
        tx = optimizer(sched)
        opt_state = tx.init(params)
        step = jax.jit(make_train_step(graphdef, cfg, tx), donate_argnums=(0, 1))
        batches = [pipeline.batch_at(i) for i in range(STEPS + 1)]
        started = time.perf_counter()
        params, opt_state, m = step(params, opt_state, batches[0], jnp.float32(1e-3))
        jax.block_until_ready(m["loss"])
        compile_s = time.perf_counter() - started
        times = []
        for batch in batches[1:]:
            started = time.perf_counter()
            params, opt_state, m = step(params, opt_state, batch, jnp.float32(1e-3))
            jax.block_until_ready(m["loss"])
            times.append(time.perf_counter() - started)
        data_times = []
        for i in range(STEPS):
            started = time.perf_counter()
            pipeline.batch_at(1000 + i)
            data_times.append(time.perf_counter() - started)
        tokens = sched.tokens_per_step
        train_tps = tokens / statistics.median(times)
        data_tps = tokens / statistics.median(data_times)
        flops = budget_lib.train_flops_per_token(cfg) * train_tps
        rows.append(f"| {run_spec.scale} {run_spec.sparsity_label} {run_spec.arch} | "
                    f"{sched.batch_size}x{sched.seq_len} | {compile_s:.1f} | {train_tps:,.0f} | "
                    f"{flops / 1e9:.2f} | {flops / peak:.1%} | {data_tps:,.0f} | "
                    f"{data_tps / train_tps:,.0f}x |")
    return ("## Trainer vs input pipeline (micro configs, CPU, f32)\n\n"
            f"MFU against {peak / 1e9:.0f} GFLOP/s ({peak_source}); FLOPs from the budget "
            "(6N + attention at 400 keys). Median of "
            f"{STEPS} steps after the first (compile) step.\n\n"
            "| run | batch | compile s | train tokens/s | GFLOP/s | MFU | pipeline tokens/s "
            "| pipeline / train |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    print(run())

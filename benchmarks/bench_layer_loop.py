"""The CPU's layer loop (kernels/backend.py `choose_layer_loop`): the same train step with its layer stacks
run as a `lax.scan` and as a Python loop (`unrolled`), timed in interleaved rounds in one process, for
the issue-17 step and the micro-m-s95 SMELT member (9 executed layers, 80 experts).

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.run layer_loop
"""

from __future__ import annotations

import os
import statistics
import time

ROUNDS = int(os.environ.get("SMELT_BENCH_LOOP_ROUNDS", "11"))
LOOPS = ("scan", "unrolled")


def _cases():
    """(name, cfg, graphdef, params, tx, opt_state, batch) of the two timed steps."""
    import jax

    from benchmarks.bench_peer import _synthetic_batch, matched_pair_specs
    from benchmarks.bench_step_parts import issue_step_inputs
    from smelt_jax.design.config import Schedule
    from smelt_jax.train.state import init_params
    from smelt_jax.train.step import optimizer

    yield ("issue-17 step", *issue_step_inputs())
    spec = next(s for s in matched_pair_specs() if s.arch == "smelt")  # micro-m-s95 comes first
    cfg = spec.model
    sched = Schedule(batch_size=spec.schedule.batch_size, seq_len=cfg.seq_len, stable_steps=1,
                     fork_steps=(1,), decay_steps=1, warmup_steps=0, peak_lr=1e-3)
    graphdef, params = init_params(cfg, 0)
    tx = optimizer(sched)
    batch = jax.device_put(_synthetic_batch(sched.batch_size, cfg.seq_len, cfg.vocab))
    yield (f"{spec.suite}-{spec.scale}-{spec.sparsity_label} SMELT step", cfg, graphdef, params, tx, tx.init(params),
           batch)


def _with_loop(graphdef, params, loop: str):
    from flax import nnx
    model = nnx.merge(graphdef, params)
    model.layer_loop = loop
    return nnx.split(model)[0]


def run() -> str:
    import jax
    import jax.numpy as jnp

    from benchmarks.cpu_info import cpu_line
    from smelt_jax.train.step import make_train_step

    lines = [cpu_line() + f"; jax {jax.__version__}; {ROUNDS} interleaved rounds.", "",
             "| step | executed layers | experts | first call s (scan / unrolled) | scan ms (median) "
             "| unrolled ms (median) | unrolled / scan, median of paired rounds | rounds faster unrolled |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    lr = jnp.float32(1e-3)
    for name, cfg, graphdef, params, tx, opt, batch in _cases():
        steps, first, times = {}, {}, {loop: [] for loop in LOOPS}
        for loop in LOOPS:
            steps[loop] = jax.jit(make_train_step(_with_loop(graphdef, params, loop), cfg, tx))
            started = time.perf_counter()
            jax.block_until_ready(steps[loop](params, opt, batch, lr))
            first[loop] = time.perf_counter() - started
        for _ in range(ROUNDS):
            for loop in LOOPS:
                started = time.perf_counter()
                jax.block_until_ready(steps[loop](params, opt, batch, lr))
                times[loop].append(time.perf_counter() - started)
        ratios = [u / s for s, u in zip(times["scan"], times["unrolled"])]
        lines.append(f"| {name} | {cfg.executed_layers} | {cfg.n_experts} | {first['scan']:.1f} / "
                     f"{first['unrolled']:.1f} | {statistics.median(times['scan']) * 1e3:,.0f} | "
                     f"{statistics.median(times['unrolled']) * 1e3:,.0f} | {statistics.median(ratios):.3f} | "
                     f"{sum(r < 1 for r in ratios)} of {ROUNDS} |")
    return "## The CPU's layer loop: scan against a Python loop (`benchmarks/bench_layer_loop.py`)\n\n" + \
        "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

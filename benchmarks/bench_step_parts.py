"""Where the issue-17 train step's time goes on CPU: each part timed alone, forward and forward + backward
(docs/performance.md, "Where the step's time goes"). Medians of 9 after one compiling call.

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.bench_step_parts
"""

from __future__ import annotations

import statistics
import time


def _median_ms(fn, *args, n: int = 9) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def issue_step_inputs():
    """(cfg, graphdef, params, tx, opt_state, batch) of the issue-17 train step, expert_impl auto."""
    import jax

    from benchmarks.bench_peer import BATCH, _synthetic_batch, issue_config
    from smelt_jax.design.config import Schedule
    from smelt_jax.train.state import init_params
    from smelt_jax.train.step import optimizer

    cfg = issue_config(expert_impl="auto")
    sched = Schedule(batch_size=BATCH, seq_len=cfg.seq_len, stable_steps=1, fork_steps=(1,), decay_steps=1,
                     warmup_steps=0, peak_lr=1e-3)
    graphdef, params = init_params(cfg, 0)
    tx = optimizer(sched)
    batch = jax.device_put(_synthetic_batch(BATCH, cfg.seq_len, cfg.vocab))
    return cfg, graphdef, params, tx, tx.init(params), batch


def run() -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.bench_peer import BATCH
    from benchmarks.cpu_info import cpu_line
    from smelt_jax.kernels.tiled import tiled_expert_ffn
    from smelt_jax.model.attention import Attention
    from smelt_jax.model.moe import MoE
    from smelt_jax.model.rope import rope_angles
    from smelt_jax.model.loss import cross_entropy, unembed_cross_entropy
    from smelt_jax.train.step import loss_fn, make_train_step

    cfg, graphdef, params, tx, opt, batch = issue_step_inputs()
    rows = []
    step = jax.jit(make_train_step(graphdef, cfg, tx))
    rows.append(("train step", _median_ms(lambda p, o: step(p, o, batch, jnp.float32(1e-3))[2]["loss"],
                                          params, opt)))
    loss = lambda p: loss_fn(p, graphdef, cfg, batch)[0]  # noqa: E731
    rows.append(("loss forward", _median_ms(jax.jit(loss), params)))
    grad = jax.jit(jax.grad(loss))
    rows.append(("loss forward + backward", _median_ms(grad, params)))
    rows.append(("optimizer update", _median_ms(jax.jit(tx.update), grad(params), opt, params)))

    b, s, d = BATCH, cfg.seq_len, cfg.d_model
    x = jax.random.normal(jax.random.PRNGKey(0), (b, s, d))
    seg = jnp.ones((b, s), jnp.int32)
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(s), (b, s)), cfg.head_dim, cfg.rope_theta)
    attn_def, attn = nnx.split(Attention(cfg, rngs=nnx.Rngs(0)))
    attn_loss = lambda st, x: jnp.sum(nnx.merge(attn_def, st)(x, cos, sin, seg)[0] ** 2)  # noqa: E731
    moe_def, moe = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    moe_loss = lambda st, x: jnp.sum(nnx.merge(moe_def, st)(x, seg > 0)[0] ** 2)  # noqa: E731
    for name, f, state in (("attention layer", attn_loss, attn), ("MoE layer", moe_loss, moe)):
        rows.append((f"{name} forward", _median_ms(jax.jit(f), state, x)))
        rows.append((f"{name} forward + backward", _median_ms(jax.jit(jax.grad(f, argnums=(0, 1))), state, x)))

    m, f_, e = b * s * cfg.top_k, cfg.expert_ffn, cfg.n_experts
    xs = jax.random.normal(jax.random.PRNGKey(1), (m, d))
    w = [jax.random.normal(jax.random.PRNGKey(i), shape) * 0.05
         for i, shape in enumerate(((e, d, f_), (e, d, f_), (e, f_, d)))]
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(m, [1 / e] * e), jnp.int32)
    ffn = lambda x, *w: jnp.sum(tiled_expert_ffn(x, *w, sizes) ** 2)  # noqa: E731
    rows.append(("tiled expert FFN forward", _median_ms(jax.jit(ffn), xs, *w)))
    rows.append(("tiled expert FFN forward + backward",
                 _median_ms(jax.jit(jax.grad(ffn, argnums=(0, 1, 2, 3))), xs, *w)))

    h = jax.random.normal(jax.random.PRNGKey(2), (b, s, d))
    un = jax.random.normal(jax.random.PRNGKey(3), (d, cfg.vocab)) * 0.05
    targets, mask = batch["targets"], batch["loss_mask"]
    forms = {"einsum bsd,dv->bsv (the model's)": lambda h, u: jnp.einsum(
                 "bsd,dv->bsv", h, u, preferred_element_type=jnp.float32),
             "dot on [b*s, d]": lambda h, u: jnp.dot(
                 h.reshape(-1, d), u, preferred_element_type=jnp.float32).reshape(b, s, -1)}
    for name, logits in forms.items():
        ce = lambda h, u, logits=logits: cross_entropy(logits(h, u), targets, mask)[0]  # noqa: E731
        rows.append((f"unembedding + cross-entropy forward + backward, unfused, {name}",
                     _median_ms(jax.jit(jax.grad(ce, argnums=(0, 1))), h, un)))
    for form in ("einsum", "matmul"):
        for chunk in (None, 64):
            fused = lambda h, u, f=form, c=chunk: unembed_cross_entropy(  # noqa: E731
                h, u, targets, mask, chunk=c, form=f)[0]
            label = "one chunk (the default here)" if chunk is None else f"chunks of {chunk} positions"
            rows.append((f"unembedding + cross-entropy forward + backward, fused (model/loss.py), {form}, "
                         f"{label}", _median_ms(jax.jit(jax.grad(fused, argnums=(0, 1))), h, un)))
    lines = [cpu_line() + f"; jax {jax.__version__}.", "",
             "| part (issue-17 shapes, alone) | ms (median of 9) |", "|---|---:|"]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

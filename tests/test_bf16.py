"""bfloat16 compute (`ModelConfig.compute_dtype="bfloat16"`, the smelt16 setting): parameters, gradients
and optimizer state stay float32; the router, the softmax statistics (attention and router), the norms'
statistics and the loss are float32; the matmuls run in bfloat16. The slow check trains a micro model
in both dtypes and compares the loss curves (tolerance and measured numbers: docs/performance.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.train.state import init_params
from smelt_jax.train.step import loss_fn, make_train_step, optimizer

MICRO = ModelConfig(vocab=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                    n_experts=8, top_k=2, expert_ffn=64, loop_start=1, loop_length=1, loop_repeats=2,
                    seq_len=64, expert_impl="capacity")
SCHEDULE = Schedule(batch_size=8, seq_len=64, stable_steps=150, fork_steps=(150,), decay_steps=1,
                    warmup_steps=10, peak_lr=3e-3)
# Statistics whose precision matters: every exp / log / rsqrt (softmaxes, logsumexps, norms).
FLOAT32_ONLY = ("exp", "exp2", "log", "log1p", "rsqrt")


def _batch(step: int, batch_size: int = SCHEDULE.batch_size, seq: int = SCHEDULE.seq_len):
    """A learnable stream: documents of an affine recurrence t' = (a t + c) mod V (a, c per document),
    packed 2-3 documents per row, fresh documents every step."""
    rng = np.random.default_rng(step)
    tokens = np.zeros((batch_size, seq + 1), np.int32)
    segments = np.zeros((batch_size, seq + 1), np.int32)
    positions = np.zeros((batch_size, seq + 1), np.int32)
    for row in range(batch_size):
        cuts = np.sort(rng.choice(np.arange(8, seq - 8), size=rng.integers(1, 3), replace=False))
        for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, seq + 1])):
            a, c = rng.choice([3, 5, 7]), rng.integers(MICRO.vocab)
            t = rng.integers(MICRO.vocab)
            for i in range(start, end):
                tokens[row, i], t = t, (a * t + c) % MICRO.vocab
            segments[row, start:end] = doc + 1
            positions[row, start:end] = np.arange(end - start)
    same_doc = segments[:, 1:] == segments[:, :-1]
    return {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "segment_ids": jnp.asarray(segments[:, :-1]), "positions": jnp.asarray(positions[:, :-1]),
            "loss_mask": jnp.asarray(same_doc.astype(np.float32))}


def _primitives(jaxpr, found=None):
    """{primitive name: set of input dtypes}, through every sub-jaxpr."""
    found = {} if found is None else found
    for eqn in jaxpr.eqns:
        dtypes = {str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")}
        found.setdefault(eqn.primitive.name, set()).update(dtypes)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, found)
    return found


def test_bf16_matmuls_with_float32_statistics_loss_and_gradients():
    cfg = MICRO.replace(compute_dtype="bfloat16")
    graphdef, params = init_params(cfg, 0)
    batch = _batch(0)

    def loss(params):
        return loss_fn(params, graphdef, cfg, batch)[0]

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params)
    found = _primitives(jaxpr.jaxpr)
    assert "bfloat16" in found["dot_general"]  # the matmuls run in the compute dtype
    for name in FLOAT32_ONLY:
        assert found.get(name, {"float32"}) == {"float32"}, (name, found.get(name))
    assert {"exp", "log", "rsqrt"} <= set(found)  # the check above saw the softmaxes, loss and norms
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert value.dtype == jnp.float32 and np.isfinite(float(value))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    opt_state = optimizer(SCHEDULE).init(params)
    assert {leaf.dtype for leaf in jax.tree.leaves(opt_state) if leaf.ndim} == {jnp.dtype(jnp.float32)}


def test_the_smelt16_suite_computes_in_bf16():
    import experiments

    runs = experiments.load_suite("smelt16")
    assert {r.model.compute_dtype for r in runs} == {"bfloat16"}
    assert {r.model.param_dtype for r in runs} == {"float32"}
    assert {r.control.compute_dtype for r in runs} == {"bfloat16"}


def _loss_curve(compute_dtype: str, steps: int) -> np.ndarray:
    cfg = MICRO.replace(compute_dtype=compute_dtype)
    graphdef, params = init_params(cfg, 0)
    tx = optimizer(SCHEDULE)
    opt_state = tx.init(params)
    step_fn = jax.jit(make_train_step(graphdef, cfg, tx))
    losses = []
    for step in range(steps):
        lr = SCHEDULE.peak_lr * min(1.0, (step + 1) / SCHEDULE.warmup_steps)
        params, opt_state, metrics = step_fn(params, opt_state, _batch(step), jnp.float32(lr))
        losses.append(float(metrics["ce"]))
    return np.asarray(losses)


def _smooth(curve: np.ndarray, window: int = 10) -> np.ndarray:
    return np.convolve(curve, np.ones(window) / window, mode="valid")


# The stated tolerance (docs/performance.md): the 10-step moving averages of the cross-entropy of a
# bf16 and a float32 run from the same initialisation and data differ by at most this many nats.
SMOOTHED_TOLERANCE = 0.05


@pytest.mark.slow
def test_bf16_loss_curve_tracks_float32():
    steps = SCHEDULE.stable_steps
    f32, bf16 = _loss_curve("float32", steps), _loss_curve("bfloat16", steps)
    diff = np.abs(_smooth(bf16) - _smooth(f32))
    print(f"f32 {f32[0]:.4f} -> {f32[-10:].mean():.4f}, bf16 {bf16[0]:.4f} -> {bf16[-10:].mean():.4f}, "
          f"max |smoothed diff| {diff.max():.4f} nats at step {diff.argmax()}, final {diff[-1]:.4f}")
    assert f32[-10:].mean() < f32[:10].mean() - 1.0  # the runs learn: the comparison is not vacuous
    assert diff.max() < SMOOTHED_TOLERANCE

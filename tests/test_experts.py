"""Every expert backend against the dense reference: forward and gradients, edge-case group sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels import expert_ffn, resolve_impl
from smelt_jax.kernels import experts as experts_module

N_EXPERTS, D_MODEL, FFN = 5, 24, 40
ROWS = 37  # not a multiple of any tile (megablox pads to 8 / 128)
BACKENDS = ["ragged_dot", "megablox", "capacity"]
if experts_module._pallas_kernel() is not None:
    BACKENDS.append("pallas")

GROUPS = {
    "random_with_empty_expert_and_padding": [9, 0, 11, 4, 8],  # sum 32 < 37: 5 padding rows
    "all_on_one_expert": [0, 0, ROWS, 0, 0],
    "no_padding": [7, 8, 6, 9, 7],
    "all_padding": [0, 0, 0, 0, 0],
}
TOLERANCE = {jnp.float32: {"rtol": 1e-5, "atol": 1e-5}, jnp.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


def _inputs(dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (ROWS, D_MODEL), jnp.float32)
    w_gate = jax.random.normal(keys[1], (N_EXPERTS, D_MODEL, FFN)) / np.sqrt(D_MODEL)
    w_up = jax.random.normal(keys[2], (N_EXPERTS, D_MODEL, FFN)) / np.sqrt(D_MODEL)
    w_down = jax.random.normal(keys[3], (N_EXPERTS, FFN, D_MODEL)) / np.sqrt(FFN)
    cotangent = jax.random.normal(keys[4], (ROWS, D_MODEL))
    return [a.astype(dtype) for a in (x, w_gate, w_up, w_down)], cotangent


@functools.cache
def _jitted_value_and_grads(impl):
    """One compilation per backend and dtype: group sizes are a traced argument."""
    def loss(x, wg, wu, wd, group_sizes, cotangent):
        out = expert_ffn(x, wg, wu, wd, group_sizes, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _value_and_grads(impl, arrays, group_sizes, cotangent):
    (_, out), grads = _jitted_value_and_grads(impl)(*arrays, group_sizes, cotangent)
    return out, grads


def _naive(x, w_gate, w_up, w_down, group_sizes):
    """Row-by-row loop in float64: the definition of the semantics."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    row = 0
    for expert, size in enumerate(group_sizes):
        for i in range(row, row + size):
            gate, up = x[i] @ w_gate[expert], x[i] @ w_up[expert]
            out[i] = (gate / (1 + np.exp(-gate)) * up) @ w_down[expert]
        row += size
    return out


@pytest.mark.parametrize("groups", list(GROUPS))
def test_dense_reference_matches_row_by_row_definition(groups):
    arrays, _ = _inputs(jnp.float32)
    sizes = GROUPS[groups]
    out = expert_ffn(*arrays, jnp.array(sizes, jnp.int32), impl="dense")
    np.testing.assert_allclose(np.asarray(out), _naive(*arrays, sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sum(sizes):] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", BACKENDS)
def test_backend_matches_dense_forward_and_gradients(impl, dtype):
    tol = TOLERANCE[dtype]
    for seed, (case, sizes) in enumerate(GROUPS.items()):
        arrays, cotangent = _inputs(dtype, seed=seed)
        group_sizes = jnp.array(sizes, jnp.int32)
        want_out, want_grads = _value_and_grads("dense", arrays, group_sizes, cotangent)
        got_out, got_grads = _value_and_grads(impl, arrays, group_sizes, cotangent)
        assert got_out.dtype == dtype and got_out.shape == (ROWS, D_MODEL)
        np.testing.assert_allclose(np.asarray(got_out, np.float32),
                                   np.asarray(want_out, np.float32), err_msg=case, **tol)
        assert np.all(np.asarray(got_out, np.float32)[sum(sizes):] == 0), case
        for name, got, want in zip(("x", "w_gate", "w_up", "w_down"), got_grads, want_grads):
            assert np.all(np.isfinite(np.asarray(got, np.float32))), (case, name)
            scale = max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
            np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                                       np.asarray(want, np.float32) / scale,
                                       err_msg=f"{case}: d{name}", **tol)


def test_capacity_backend_with_tight_bound_matches_dense():
    """A caller-given capacity equal to the largest group is exact (the MoE layer's bound)."""
    arrays, _ = _inputs(jnp.float32)
    sizes = jnp.array(GROUPS["random_with_empty_expert_and_padding"], jnp.int32)
    got = expert_ffn(*arrays, sizes, impl="capacity", capacity=11)
    want = expert_ffn(*arrays, sizes, impl="dense")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_auto_picks_by_platform():
    assert resolve_impl("auto", "cpu") == "capacity"
    assert resolve_impl("auto", "gpu") == "ragged_dot"
    assert resolve_impl("auto", "tpu") in ("pallas", "megablox")
    assert resolve_impl("dense", "tpu") == "dense"
    with pytest.raises(ValueError, match="expert impl"):
        resolve_impl("nope")


def test_pallas_is_wired_lazily():
    arrays, _ = _inputs(jnp.float32)
    sizes = jnp.array(GROUPS["no_padding"], jnp.int32)
    if experts_module._pallas_kernel() is None:
        with pytest.raises(ImportError, match="pallas_expert_ffn"):
            expert_ffn(*arrays, sizes, impl="pallas")
    else:
        np.testing.assert_allclose(np.asarray(expert_ffn(*arrays, sizes, impl="pallas")),
                                   np.asarray(expert_ffn(*arrays, sizes, impl="dense")),
                                   rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_rejected():
    (x, wg, wu, wd), _ = _inputs(jnp.float32)
    sizes = jnp.array(GROUPS["no_padding"], jnp.int32)
    with pytest.raises(ValueError, match="d_model"):
        expert_ffn(x[:, :5], wg, wu, wd, sizes, impl="dense")
    with pytest.raises(ValueError, match="disagree"):
        expert_ffn(x, wg, wu, wd[:, :3], sizes, impl="dense")
    with pytest.raises(ValueError, match="group_sizes"):
        expert_ffn(x, wg, wu, wd, sizes[:3], impl="dense")

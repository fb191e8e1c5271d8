"""The remat policies keep splash attention's residuals (named in kernels/splash.py), so the backward pass
of a rematerialised layer does not run the attention forward kernel again; read from the jaxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels import splash
from smelt_jax.model.layer import REMAT_POLICIES

B, S, HEADS, KV, HD = 2, 256, 2, 1, 128


def _pallas_calls(jaxpr, out):
    """Names of every pallas_call in `jaxpr` and its sub-jaxprs, in order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(str(eqn.params["name"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _pallas_calls(inner, out)
    return out


def _layer(x, w_q, w_kv, w_o, segments):  # x [b, s, d]: projections (dots), splash, output projection
    q = jnp.einsum("bsd,dhk->bshk", x, w_q)
    kv = jnp.einsum("bsd,dhk->bshk", x, w_kv)
    out = splash.splash_attention(q, kv, kv, segments, interpret=True)
    return jnp.einsum("bshk,hkd->bsd", out, w_o)


def _inputs():
    rng = np.random.default_rng(0)
    d = 64
    x = jnp.asarray(rng.normal(size=(B, S, d)), jnp.float32)
    w_q = jnp.asarray(rng.normal(size=(d, HEADS, HD)) / 8, jnp.float32)
    w_kv = jnp.asarray(rng.normal(size=(d, KV, HD)) / 8, jnp.float32)
    w_o = jnp.asarray(rng.normal(size=(HEADS, HD, d)) / 8, jnp.float32)
    segments = np.ones((B, S), np.int32)
    segments[0, 100:] = 2
    return x, w_q, w_kv, w_o, jnp.asarray(segments)


def _grad_fn(policy):
    layer = _layer if policy == "no remat" else jax.checkpoint(_layer, policy=policy)
    return jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 1, 2, 3))


def _forward_kernels(policy) -> int:
    names = _pallas_calls(jax.make_jaxpr(_grad_fn(policy))(*_inputs()).jaxpr, [])
    assert sum(n.startswith("splash_mha_dkv") for n in names) == 1  # the fused backward, once
    return sum(n.startswith("splash_mha_fwd") for n in names)


@pytest.mark.parametrize("remat", ["dots", "dots_no_batch"])
def test_the_dots_policies_keep_splash_residuals(remat):
    assert _forward_kernels(REMAT_POLICIES[remat]) == 1
    # checkpoint_dots alone sees a Pallas call, not a dot: the forward kernel runs again
    assert _forward_kernels(jax.checkpoint_policies.checkpoint_dots) == 2
    assert _forward_kernels(None) == 2  # 'full' remat recomputes everything, by design


def test_named_residuals_leave_the_gradients_unchanged():
    args = _inputs()
    want = _grad_fn("no remat")(*args)
    got = _grad_fn(REMAT_POLICIES["dots"])(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)

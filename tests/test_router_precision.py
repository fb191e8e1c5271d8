"""The router's logits GEMM on bf16 inputs with float32 accumulation (issue 50 item 6;
`model.router.router_logits`) against the float32 GEMM it replaces on TPU and GPU: the same experts chosen
except where the k-th and (k+1)-th logits lie within the inputs' rounding of each other, weights and
auxiliary losses to bf16 rounding, gradients to bf16 tolerance; float32 on CPU (CPU training unchanged)
and the low-precision form when traced for a TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.model.router import Router, route, router_logits

T, D, E, K = 512, 96, 32, 4


def _inputs(seed=0, ties=False):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)  # the hidden states arrive in the compute dtype
    w = rng.normal(size=(D, E)) * 0.1
    if ties:  # two experts with the same column: exact ties in both forms
        w[:, 5] = w[:, 4]
    mask = jnp.asarray(np.arange(T) < T - 17)  # a padded tail
    return x, jnp.asarray(w, jnp.float32), mask


def _routing(x, w, mask, float32_inputs):
    return route(router_logits(x, w, float32_inputs=float32_inputs), K, mask)


@pytest.mark.parametrize("ties", [False, True])
def test_bf16_routing_decisions_equal_float32_outside_the_rounding_band(ties):
    x, w, mask = _inputs(ties=ties)
    low = router_logits(x, w, float32_inputs=False)
    high = router_logits(x, w, float32_inputs=True)
    assert low.dtype == high.dtype == jnp.float32
    # |logit error| <= sum_d |x_d| |w_d e| 2^-8 (the weight's rounding to bf16; x is bf16 already, the
    # products and sums are float32)
    error = jnp.abs(low - high)
    assert float(jnp.max(error - (jnp.abs(x.astype(jnp.float32)) @ jnp.abs(w)) * 2.0 ** -8)) <= 1e-6
    # A token whose k-th and (k+1)-th float32 logits are further apart than twice its largest logit
    # error must choose the same experts (no logit moved by more than that): the near-tie band.
    ordered = jnp.sort(high, axis=-1)[:, ::-1]
    gap = ordered[:, K - 1] - ordered[:, K]
    clear = np.asarray(gap > 2 * jnp.max(error, axis=-1))
    assert clear.mean() > 0.9  # the band is narrow: most tokens are decided
    got, want = _routing(x, w, mask, False), _routing(x, w, mask, True)
    same = np.all(np.sort(np.asarray(got.expert_ids), -1) == np.sort(np.asarray(want.expert_ids), -1), -1)
    assert np.all(same[clear])
    both = same & clear
    np.testing.assert_allclose(np.asarray(got.weights)[both], np.asarray(want.weights)[both], atol=2e-2)
    np.testing.assert_allclose(float(got.load_balance_loss), float(want.load_balance_loss), rtol=2e-2)
    np.testing.assert_allclose(float(got.z_loss), float(want.z_loss), rtol=2e-2)


def test_bf16_router_gradients_match_float32_to_bf16_tolerance():
    x, w, mask = _inputs(seed=1)
    probe = jnp.asarray(np.random.default_rng(2).normal(size=(T, E)), jnp.float32)

    def loss(x, w, float32_inputs):  # through every float32 path: softmax, renormalised weights, both losses
        logits = router_logits(x, w, float32_inputs=float32_inputs)
        r = route(logits, K, mask)
        return (jnp.sum(jax.nn.softmax(logits) * probe) + jnp.sum(r.weights ** 2) + r.load_balance_loss
                + r.z_loss)

    got = jax.grad(loss, (0, 1))(x, w, False)
    want = jax.grad(loss, (0, 1))(x, w, True)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for name, g, g_ref in zip(("dx", "dw"), got, want):
        g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
        assert np.abs(g_ref).max() > 0
        # relative to the gradient's scale: bf16 inputs (2^-8) and the bf16 cotangent of the GEMMs
        np.testing.assert_allclose(g, g_ref, atol=3e-2 * np.abs(g_ref).max(), err_msg=name)
        assert np.linalg.norm(g - g_ref) <= 2e-2 * np.linalg.norm(g_ref), name


def test_float32_hidden_states_take_the_float32_gemm_either_way():
    x, w, _ = _inputs()
    x32 = x.astype(jnp.float32)
    want = jnp.einsum("td,de->te", x32, w)
    for float32_inputs in (None, False, True):
        np.testing.assert_array_equal(np.asarray(router_logits(x32, w, float32_inputs=float32_inputs)),
                                      np.asarray(want))


def test_the_cpu_keeps_float32_inputs_and_a_tpu_trace_gets_bf16():
    cfg = ModelConfig(vocab=64, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, n_experts=E,
                      top_k=K, expert_ffn=16)
    router = Router(cfg, rngs=nnx.Rngs(0))
    x, _, mask = _inputs()
    logits, _ = router(x, mask)  # on CPU: today's float32 GEMM, bit for bit
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(
        jnp.einsum("td,de->te", x.astype(jnp.float32), router.weight[...].astype(jnp.float32))))

    def dot_input_dtypes(jaxpr):
        return [tuple(v.aval.dtype for v in e.invars) for e in jaxpr.eqns if e.primitive.name == "dot_general"]

    from smelt_jax.compile import aot
    from smelt_jax.parallel.sharding import MESH_AXES

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    devices = aot.tpu_topology("v5p:2x2x1").devices[:1]
    mesh = jax.sharding.Mesh(np.array(devices).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    weight = router.weight[...]
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda x, w: jax.grad(
            lambda x, w: jnp.sum(router_logits(x, w) ** 2), (0, 1))(x, w))(x, weight)
    found = [d for e in jaxpr.jaxpr.eqns for sub in [e.params.get("call_jaxpr"), e.params.get("fun_jaxpr"),
                                                     e.params.get("jaxpr")] if sub is not None
             for d in dot_input_dtypes(getattr(sub, "jaxpr", sub))] + dot_input_dtypes(jaxpr.jaxpr)
    assert len(found) == 3 and all(d == (jnp.bfloat16, jnp.bfloat16) for d in found), found

"""Router and MoE layer against per-token loops: top-k, renormalised weights, capacity drops, losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.model.dispatch import argsort_small_keys, expert_capacity, inverse_permutation
from smelt_jax.model.moe import MoE
from smelt_jax.model.router import route

CFG = ModelConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  n_experts=4, top_k=2, expert_ffn=12, seq_len=8, expert_impl="dense")


def test_uniform_router_gives_unit_balance_loss_and_log_e_squared_z_loss():
    logits = jnp.zeros((10, 8))
    routing = route(logits, top_k=2, token_mask=jnp.ones(10, bool))
    np.testing.assert_allclose(float(routing.load_balance_loss), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(routing.z_loss), np.log(8.0) ** 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(routing.weights.sum(-1)), 1.0, rtol=1e-6)


def test_router_losses_ignore_padding_tokens():
    logits = jax.random.normal(jax.random.key(0), (12, 8))
    mask = jnp.arange(12) < 7
    masked = route(logits, 3, mask)
    real_only = route(logits[:7], 3, jnp.ones(7, bool))
    np.testing.assert_allclose(float(masked.load_balance_loss), float(real_only.load_balance_loss),
                               rtol=1e-6)
    np.testing.assert_allclose(float(masked.z_loss), float(real_only.z_loss), rtol=1e-6)
    # Collapsed routing (every token to one expert's pair) is penalised above balance.
    collapsed = route(jnp.tile(jnp.array([[9.0, 9.0, 0, 0, 0, 0, 0, 0]]), (12, 1)), 2, mask)
    assert float(collapsed.load_balance_loss) > 3.0


def _naive_moe(moe: MoE, x: np.ndarray, capacity: int | None):
    """Per-token loop: softmax, top-k, renormalise, keep an expert's first `capacity` tokens."""
    w_router = np.asarray(moe.router.weight[...], np.float64)
    w_gate, w_up, w_down = (np.asarray(w[...], np.float64) for w in (moe.w_gate, moe.w_up,
                                                                     moe.w_down))
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(tokens)
    used = np.zeros(CFG.n_experts, int)
    dropped = 0
    for t, token in enumerate(tokens):
        logits = token @ w_router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:CFG.top_k]
        weights = probs[chosen] / probs[chosen].sum()
        for e, w in zip(chosen, weights):
            if capacity is not None and used[e] >= capacity:
                dropped += 1
                continue
            used[e] += 1
            gate, up = token @ w_gate[e], token @ w_up[e]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out.reshape(x.shape), dropped / (len(tokens) * CFG.top_k)


def _check_against_naive(cfg):
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model))
    y, stats = moe(x, jnp.ones((2, 8), bool))
    want, dropped = _naive_moe(moe, np.asarray(x), expert_capacity(cfg, 16))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(stats["dropped_fraction"]), dropped, atol=1e-6)
    assert stats["counts"].shape == (cfg.n_experts,) and float(stats["counts"].sum()) == 32
    return dropped


def test_dropless_moe_equals_per_token_loop():
    assert _check_against_naive(CFG) == 0


def test_capacity_drops_the_latest_tokens_of_a_full_expert():
    cfg = CFG.replace(capacity_factor=0.5, expert_impl="capacity")
    assert expert_capacity(cfg, 16) == 4
    assert _check_against_naive(cfg) > 0  # the case really drops something


@pytest.mark.parametrize("n,n_keys,seed", [(8192, 74, 0), (77, 3, 1), (1, 1, 2), (64, 1, 3), (500, 501, 4)])
def test_argsort_small_keys_is_the_stable_argsort_and_its_inverse_the_positions(n, n_keys, seed):
    keys = jnp.asarray(np.random.default_rng(seed).integers(0, n_keys, n), jnp.int32)
    order = jax.jit(argsort_small_keys, static_argnums=1)(keys, n_keys)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(np.asarray(keys), kind="stable"))
    position = jax.jit(inverse_permutation)(order)
    np.testing.assert_array_equal(np.asarray(position), np.argsort(np.asarray(order)))


def test_argsort_small_keys_falls_back_to_the_stable_sort_where_packing_overflows_int32():
    n_keys = 2**31 // 5 + 1  # key * 5 + index passes 2**31 - 1 for the largest key at index 4
    keys = jnp.asarray([1, 0, n_keys - 1, 0, n_keys - 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(argsort_small_keys(keys, n_keys)), [1, 3, 0, 2, 4])

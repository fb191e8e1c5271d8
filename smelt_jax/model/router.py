"""Token-choice softmax router: top-k experts, weights renormalised over the chosen k.

Auxiliary losses (returned unweighted; the trainer multiplies by the config's weights):
- Switch load balance (Fedus et al. 2021, extended to top-k): E * sum_e f_e * P_e, with f_e the
  fraction of the T*k assignments that go to expert e and P_e the mean router probability of e.
  It is 1 under perfectly uniform routing.
- Router z-loss (ST-MoE, Zoph et al. 2022): mean over tokens of logsumexp(logits)^2.
Both average over real tokens only (segment id > 0). Router math runs in float32: the logits GEMM
accumulates in float32 and the softmax, top-k, weights and losses are float32. Its inputs are the hidden
states in the compute dtype and the weight cast to it (`router_logits`; bf16 on TPU and GPU: no float32
copy of the [T, d] tokens is written, and the MXU runs at its bf16 rate) except on CPU, where both are
cast to float32 as before (CPU training unchanged).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels.backend import _traced_platform
from smelt_jax.model.attention import INIT_STD, truncated_normal
from smelt_jax.parallel.sharding import current_mesh, param


@dataclasses.dataclass(frozen=True)
class Routing:
    """expert_ids [T, k] int32, weights [T, k] float32 (rows sum to 1), losses as scalars."""

    expert_ids: jax.Array
    weights: jax.Array
    load_balance_loss: jax.Array
    z_loss: jax.Array


def _masked_mean(values: jax.Array, token_mask: jax.Array) -> jax.Array:
    """Mean over tokens of values [T, ...] where token_mask [T]; 0 when no token is real."""
    weights = token_mask.astype(jnp.float32)
    weights = weights.reshape(weights.shape + (1,) * (values.ndim - 1))
    return jnp.sum(values * weights, axis=0) / jnp.maximum(jnp.sum(token_mask), 1)


def router_logits(x: jax.Array, weight: jax.Array, *, float32_inputs: bool | None = None) -> jax.Array:
    """x [T, d] @ weight [d, E] -> logits [T, E] float32, accumulated in float32.

    float32_inputs: cast x and the weight to float32 first (the CPU's form, autodiffed); False multiplies
    in x's dtype, the weight cast to it (`_low_precision_logits`: its backward's two GEMMs take the
    logits' gradient in x's dtype too, so no GEMM of the router runs on float32 inputs). None = True
    only when the traced platform is the CPU (`kernels.backend`: the mesh's devices, so an ahead-of-time
    TPU compile on this CPU gets the low-precision form). With float32 x both forms are the same GEMM.
    """
    if float32_inputs is None:
        float32_inputs = _traced_platform(None, current_mesh()) == "cpu"
    if float32_inputs or x.dtype == jnp.float32:
        return jnp.einsum("td,de->te", x.astype(jnp.float32), weight.astype(jnp.float32))
    return _low_precision_logits(x, weight)


@jax.custom_vjp
def _low_precision_logits(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [T, d] @ weight.astype(x.dtype) [d, E] with float32 accumulation -> float32 [T, E]. Backward:
    g = d logits cast to x's dtype; dx = g W^T in x's dtype, dW = x^T g in float32 (both accumulated in
    float32): the products of a bf16 GEMM, as every other weight's gradient in the model."""
    return jnp.einsum("td,de->te", x, weight.astype(x.dtype), preferred_element_type=jnp.float32)


def _low_precision_fwd(x, weight):
    return _low_precision_logits(x, weight), (x, weight)


def _low_precision_bwd(residuals, d_logits):
    x, weight = residuals
    g = d_logits.astype(x.dtype)
    # dx written in x's dtype (the MXU accumulates in float32 inside): no float32 [T, d] buffer
    dx = jnp.einsum("te,de->td", g, weight.astype(x.dtype), preferred_element_type=x.dtype)
    dw = jnp.einsum("td,te->de", x, g, preferred_element_type=jnp.float32)
    return dx, dw.astype(weight.dtype)


_low_precision_logits.defvjp(_low_precision_fwd, _low_precision_bwd)


@jax.checkpoint
def _chosen_probs(probs: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """probs [T, E], expert_ids [T, k] -> the chosen probabilities [T, k], by a one-hot product: the same
    values as top_k's, and a gradient that is a product too (top_k's is a scatter-add into [T, E]).
    Checkpointed: the backward rebuilds the one-hot [T, k, E] from the ids instead of keeping it (a
    float32 [T, k, E] per layer, 151 MB at 100M's 16,384 tokens per device and 288 experts)."""
    chosen = jax.nn.one_hot(expert_ids, probs.shape[-1], dtype=probs.dtype)
    return jnp.sum(chosen * probs[:, None, :], axis=-1)


def route(logits: jax.Array, top_k: int, token_mask: jax.Array) -> Routing:
    """logits [T, E] float32, token_mask [T] bool (False = padding)."""
    n_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, expert_ids = jax.lax.top_k(probs, top_k)
    top_probs = _chosen_probs(probs, expert_ids)
    weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    assigned = jnp.sum(jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32), axis=1)  # [T, E]
    fraction_assigned = _masked_mean(assigned, token_mask) / top_k
    mean_prob = _masked_mean(probs, token_mask)
    load_balance = n_experts * jnp.sum(fraction_assigned * mean_prob)
    z_loss = _masked_mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), token_mask)
    return Routing(expert_ids.astype(jnp.int32), weights, load_balance, z_loss)


def expert_load_stats(counts: jax.Array, routed_rows: jax.Array, kept_rows: jax.Array
                      ) -> dict[str, jax.Array]:
    """Load of one layer.

    counts [E]: rows of real tokens routed to each expert; routed_rows / kept_rows: all rows
    (padding included, it occupies capacity too) before and after the capacity drop.
    max_over_mean: the busiest expert's rows over the mean (1 = balanced);
    dropped_fraction: rows past an expert's capacity over all rows (0 when dropless).
    """
    counts = counts.astype(jnp.float32)
    return {
        "counts": counts,
        "max_over_mean": jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1e-9),
        "dropped_fraction": 1.0 - kept_rows.astype(jnp.float32) / jnp.maximum(routed_rows, 1),
    }


class Router(nnx.Module):
    """Linear router [d_model, n_experts], no bias."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.top_k = cfg.top_k
        self.weight = param(
            truncated_normal(rngs, (cfg.d_model, cfg.n_experts), INIT_STD, jnp.dtype(cfg.param_dtype)),
            ("embed", "router_experts"))

    @jax.named_scope("router")  # names the ops for profiles (benchmarks/bench_ops.py)
    def __call__(self, x: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, Routing]:
        """x [T, d] -> (logits [T, E] float32, Routing)."""
        logits = router_logits(x, self.weight[...])
        return logits, route(logits, self.top_k, token_mask)

"""The MoE layer: route, sort token copies by expert, run the experts behind one call, unsort, combine.

Dropless by default. With `capacity_factor` set, an expert keeps its first
C = ceil(capacity_factor * T * top_k / E) rows in token order; the rest are moved past the last
group (padding, output 0), so every backend sees the same sorted layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.config import ModelConfig
from smelt_jax.kernels import expert_ffn, resolve_impl
from smelt_jax.model.attention import INIT_STD, truncated_normal
from smelt_jax.model.router import Router, expert_load_stats
from smelt_jax.sharding import mesh_is_set, param


def expert_capacity(cfg: ModelConfig, tokens: int) -> int | None:
    """Rows an expert keeps: None when dropless."""
    if cfg.capacity_factor is None:
        return None
    return max(1, math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts))


def dispatch_order(expert_ids: jax.Array, n_experts: int, capacity: int | None):
    """Sort the T*k token copies by expert.

    expert_ids [T, k]. Returns (order [T*k]: flat copy index of each sorted row, group_sizes [E]
    int32, counts [E]: rows routed per expert before any drop). Rows past an expert's capacity are
    sent after every group. The sort is stable, so within an expert earlier tokens come first.
    """
    flat = expert_ids.reshape(-1)
    counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    if capacity is None:
        return jnp.argsort(flat, stable=True), counts, counts
    first_order = jnp.argsort(flat, stable=True)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[first_order]]
    rank = jnp.zeros_like(rank_sorted).at[first_order].set(rank_sorted)
    key = jnp.where(rank < capacity, flat, n_experts)
    return jnp.argsort(key, stable=True), jnp.minimum(counts, capacity), counts


class MoE(nnx.Module):
    """Softmax top-k router and n_experts SwiGLU experts."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_ffn
        dtype = jnp.dtype(cfg.param_dtype)
        self.router = Router(cfg, rngs=rngs)
        self.w_gate = param(truncated_normal(rngs, (e, d, f), INIT_STD, dtype),
                            ("experts", "embed", "mlp"))
        self.w_up = param(truncated_normal(rngs, (e, d, f), INIT_STD, dtype),
                          ("experts", "embed", "mlp"))
        self.w_down = param(truncated_normal(rngs, (e, f, d), INIT_STD, dtype),
                            ("experts", "mlp", "embed"))

    def __call__(self, x: jax.Array, token_mask: jax.Array):
        """x [b, s, d] (compute dtype), token_mask [b, s] bool (False = padding).

        Returns (y [b, s, d], stats: load_balance_loss, router_z_loss, counts [E], max_over_mean,
        dropped_fraction, topk_ids [b, s, k]).
        """
        cfg = self.cfg
        if mesh_is_set() and jax.sharding.get_abstract_mesh().shape.get("expert", 1) > 1:
            # Experts sharded over the mesh: tokens travel to their experts by all_to_all, and each
            # device runs the expert kernel on its own experts (Mosaic kernels do not auto-shard).
            from smelt_jax.parallel.expert_parallel import expert_parallel_moe  # imports this module
            return expert_parallel_moe(x, token_mask, self.router.weight[...], self.w_gate[...],
                                       self.w_up[...], self.w_down[...], cfg)
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        mask = token_mask.reshape(-1)
        _, routing = self.router(tokens, mask)
        capacity = expert_capacity(cfg, b * s)
        order, group_sizes, counts = dispatch_order(routing.expert_ids, cfg.n_experts, capacity)
        x_sorted = jnp.take(tokens, order // cfg.top_k, axis=0)
        # No expert receives more than T rows (a token picks distinct experts): the capacity
        # backend's buffer bound.
        bound = b * s if capacity is None else capacity
        impl = resolve_impl(cfg.expert_impl)
        if impl in ("pallas", "megablox") and mesh_is_set() and jax.sharding.get_abstract_mesh().size > 1:
            # GSPMD cannot partition a Mosaic kernel; without an expert axis (above) use XLA's op.
            impl = "ragged_dot"
        y_sorted = expert_ffn(x_sorted, self.w_gate[...], self.w_up[...], self.w_down[...],
                              group_sizes, impl=impl, capacity=bound)
        inverse = jnp.argsort(order)
        y_copies = jnp.take(y_sorted, inverse, axis=0).reshape(b * s, cfg.top_k, d)
        y = jnp.einsum("tkd,tk->td", y_copies.astype(jnp.float32), routing.weights)
        real_counts = jnp.bincount(routing.expert_ids.reshape(-1), length=cfg.n_experts,
                                   weights=jnp.repeat(mask, cfg.top_k).astype(jnp.float32))
        load = expert_load_stats(real_counts, jnp.sum(counts), jnp.sum(group_sizes))
        stats = {
            "load_balance_loss": routing.load_balance_loss,
            "router_z_loss": routing.z_loss,
            **load,
            "topk_ids": routing.expert_ids.reshape(b, s, cfg.top_k),
        }
        return y.astype(x.dtype).reshape(b, s, d), stats

"""The MoE layer, the only one: route, dispatch, run the experts through an exchange strategy, combine.

    MoE(cfg)(x [b, s, d], token_mask [b, s]) -> (y [b, s, d], stats)

1. `Router` (the router einsum, softmax top-k, auxiliary losses; `model/router.py`);
2. `dispatch` (the sorted layout of the T*k token copies, the capacity and the kept copies;
   `model/dispatch.py`);
3. the backend, chosen once by `kernels.backend.choose_expert_backend(cfg.expert_impl, mesh=...)`, runs
   through one of two strategies:
   - local (`model/expert_compute.py`): all experts in this program, GSPMD partitions it on a mesh;
     tokens, Dispatch, weights -> y_copies [T, k, d], combined here (`combine`, float32);
   - expert-parallel (`model/expert_exchange.py`): when the mesh's `expert` axis is larger than 1,
     experts sharded over it and token copies exchanged by all_to_all in a shard_map (padded or ragged:
     `kernels.backend.choose_expert_exchange(cfg.expert_exchange)`); the same weighted sum is taken
     inside the shard_map (float32 accumulation), which returns y [T, d];
   - ring of experts (`model/ring_exchange.py`, exchange "ring"): tokens all-gathered over `expert`,
     local experts computed and combined there, reduce-scattered back (returns y [T, d] itself);
4. the load statistics, here, for every strategy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels.backend import choose_expert_backend, choose_expert_exchange, expert_axis_size
from smelt_jax.model.attention import INIT_STD, truncated_normal
from smelt_jax.model.dispatch import Dispatch, dispatch, expert_capacity
from smelt_jax.model.expert_compute import local_expert_outputs
from smelt_jax.model.expert_exchange import exchanged_moe_outputs
from smelt_jax.model.ring_exchange import ring_expert_outputs
from smelt_jax.model.router import Router, Routing, expert_load_stats
from smelt_jax.parallel.sharding import current_mesh, param


def combine(y_copies: jax.Array, weights: jax.Array) -> jax.Array:
    """y_copies [T, k, d], router weights [T, k] float32 -> [T, d] float32 (the weighted sum)."""
    return jnp.einsum("tkd,tk->td", y_copies.astype(jnp.float32), weights)


def moe_stats(routing: Routing, plan: Dispatch, token_mask: jax.Array) -> dict[str, jax.Array]:
    """The layer's statistics: auxiliary losses, load (counts of real tokens, max_over_mean,
    dropped_fraction) and topk_ids [T, k]. token_mask [T] bool."""
    n_experts = plan.counts.shape[0]
    top_k = routing.expert_ids.shape[1]
    # An int32 count of the real tokens' ids (padding's moved past the last expert): the same values as
    # a float-weighted bincount, without a float scatter-add.
    real_ids = jnp.where(jnp.repeat(token_mask, top_k), routing.expert_ids.reshape(-1), n_experts)
    real_counts = jnp.bincount(real_ids, length=n_experts + 1)[:n_experts].astype(jnp.float32)
    return {
        "load_balance_loss": routing.load_balance_loss,
        "router_z_loss": routing.z_loss,
        **expert_load_stats(real_counts, jnp.sum(plan.counts), jnp.sum(plan.group_sizes)),
        "topk_ids": routing.expert_ids,
    }


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

    @jax.named_scope("moe")  # names the ops for profiles (benchmarks/bench_ops.py)
    def __call__(self, x: jax.Array, token_mask: jax.Array):
        """x [b, s, d] (compute dtype), token_mask [b, s] bool (False = padding).

        Returns (y [b, s, d], stats: load_balance_loss, router_z_loss, counts [E], max_over_mean,
        dropped_fraction, topk_ids [b, s, k]).
        """
        cfg = self.cfg
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        mask = token_mask.reshape(-1)
        _, routing = self.router(tokens, mask)
        plan = dispatch(routing.expert_ids, cfg.n_experts, expert_capacity(cfg, b * s))
        mesh = current_mesh()
        backend = choose_expert_backend(cfg.expert_impl, mesh=mesh)
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        exchange = choose_expert_exchange(cfg.expert_exchange) if expert_axis_size(mesh) > 1 else None
        if exchange == "ring":  # combines inside its shard_map (model/ring_exchange.py)
            y = ring_expert_outputs(tokens, plan, routing.weights, *weights, backend=backend, mesh=mesh,
                                    slack=cfg.expert_buffer_slack)
        elif exchange is not None:  # combines inside its shard_map (model/expert_exchange.py)
            y = exchanged_moe_outputs(tokens, plan, routing.weights, *weights, backend=backend,
                                      ragged=exchange == "ragged", mesh=mesh, slack=cfg.expert_buffer_slack)
        else:
            y = combine(local_expert_outputs(tokens, plan, *weights, backend=backend), routing.weights)
        stats = moe_stats(routing, plan, mask)
        stats["topk_ids"] = stats["topk_ids"].reshape(b, s, cfg.top_k)
        return y.astype(x.dtype).reshape(b, s, d), stats

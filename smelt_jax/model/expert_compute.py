"""The local exchange strategy: every expert on this program's devices (one device, or a mesh that
GSPMD partitions). The expert-parallel strategy, with the same contract, is `expert_exchange`.

Contract of a strategy: tokens [T, d] (compute dtype), the layer's `Dispatch`, expert weights
w_gate / w_up [E, d, f], w_down [E, f, d], the backend name -> y_copies [T, k, d]: the expert output
of every token copy, 0 for a dropped copy (the MoE layer combines them with the router weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.model.dispatch import Dispatch


@jax.named_scope("experts")  # names the ops for profiles (benchmarks/bench_ops.py)
def local_expert_outputs(tokens: jax.Array, plan: Dispatch, w_gate: jax.Array, w_up: jax.Array,
                         w_down: jax.Array, *, backend: str) -> jax.Array:
    """Sort the copies by expert (`plan.order`), run `expert_ffn`, unsort (`plan.position`)."""
    total, d = tokens.shape
    top_k = plan.expert_ids.shape[1]
    x_sorted = jnp.take(tokens, plan.order // top_k, axis=0)
    # No expert receives more than T rows (a token picks distinct experts): the bound the capacity
    # and tiled backends size their buffers with.
    bound = total if plan.capacity is None else plan.capacity
    y_sorted = expert_ffn(x_sorted, w_gate, w_up, w_down, plan.group_sizes, impl=backend,
                          capacity=bound)
    return jnp.take(y_sorted, plan.position, axis=0).reshape(total, top_k, d)

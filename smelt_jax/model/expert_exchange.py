"""The expert-parallel exchange strategy: experts sharded over the mesh's `expert` axis, token copies
exchanged with `all_to_all` inside `jax.shard_map`, and the weighted top-k sum taken there too.

    exchanged_moe_outputs(tokens [T, d], plan, router_weights [T, k] f32, w_gate, w_up, w_down, *,
                          backend, ragged, mesh, slack) -> y [T, d] (tokens' dtype)

y[t] = sum_j router_weights[t, j] * expert_j(tokens[t]), 0 for the copies `plan` drops: the local
strategy's outputs combined as `moe.combine` does (float32 accumulation), but inside the shard_map, so
no [T, k, d] array (float32 or other) leaves it. Routing, the capacity decision (`Dispatch.kept`) and
the load statistics stay in the MoE layer (`smelt_jax.model.moe`), outside the shard_map.

Inside the shard_map each device holds T_l tokens (tokens split over data x fsdp x expert) and
E_l = E / n experts (n = size of `expert`); expert e lives on device e // E_l as local expert e % E_l.

1. Layout (`exchange_pass.send_layout`): the device's R = T_l * k copies sorted by expert (stable), so the
   copies for destination j form block j, itself grouped by local expert; counts [n, E_l] says how many
   rows each (destination, local expert) has.
2. The first pass moves rows [0, C) of every block: the sent rows [n, C, d] are one gather of the token
   rows (`row_gather.gather_sent_rows`), `exchange_pass.pass_core` exchanges them (`all_to_all` of the
   rows and of their counts [n, E_l]; the rows' experts follow from the counts), puts the received rows
   in expert order, runs `smelt_jax.kernels.expert_ffn` on the E_l local experts and sends the outputs
   back into the same [n, C, d] layout; `row_gather.combine_rows` gathers each token's k output rows
   and sums them with the router weights in float32. Every row movement is a gather with a custom VJP
   whose backward is a gather by the inverse index (`model/row_gather.py`): no scatter-add in the
   backward; the saved rows are the expert outputs in the compute dtype.
3. C = `moe_buffers.rows_per_destination` (the expected load x `ModelConfig.expert_buffer_slack`; None =
   the worst case). Rows past C are never dropped: overflow passes of width `moe_buffers.overflow_rows`
   run in a loop, as many as the fullest block of any device needs (a `pmax` over the token axes, so
   every device runs the same collectives), inside a `lax.cond` so that nothing runs when nothing
   overflows; each pass's work scales with its rows (`model/exchange_overflow.py`, a custom VJP).

Two ways to move the buffers (`ModelConfig.expert_exchange`; its default "auto" is padded on TPU and CPU,
ragged on GPU, decided by `kernels.backend.choose_expert_exchange`):
- "padded" (runs everywhere): `all_to_all` of the whole [n, width, d] buffers, empty rows included.
- "ragged": `jax.lax.ragged_all_to_all` sends only the filled prefix of each destination's block, into
  the same block layout on the receiver. XLA:CPU does not implement it ("UNIMPLEMENTED: HLO opcode
  ragged-all-to-all"), so on CPU it cannot run; the TPU compiler accepts it (tests/test_parallel_expert.py
  compiles a train step with it for a TPU slice).
Gradients flow through the exchanges (each all_to_all is the other's transpose; JAX transposes
ragged_all_to_all into the reverse ragged exchange).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from smelt_jax.parallel import sharding
from smelt_jax.platform.errors import UsageError
from smelt_jax.kernels.backend import EXPERT_AXIS
from smelt_jax.model.dispatch import Dispatch
from smelt_jax.model.exchange_overflow import overflow_outputs
from smelt_jax.model.exchange_pass import (exchange_blocks, pass_cell, pass_core, pass_counts, pass_source,
                                           ragged_block_args, send_layout)
from smelt_jax.model.moe_buffers import buffer_fill, overflow_rows, rows_per_destination
from smelt_jax.model.row_gather import combine_rows, gather_sent_rows

__all__ = ["buffer_fill", "exchange_blocks", "exchanged_moe_outputs", "ragged_block_args", "token_axes"]


def token_axes(mesh) -> tuple[str, ...]:
    """Mesh axes that split the tokens inside the expert layer: the 'batch' rule's axes, then
    `expert` (tokens must be split over the expert axis too, or its devices would repeat work)."""
    rule = dict(sharding.LOGICAL_AXIS_RULES)["batch"]
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    if mesh is None:
        return ()
    return tuple(a for a in dict.fromkeys(axes + (EXPERT_AXIS,)) if mesh.shape[a] > 1)


def _exchange_and_combine(x_local, ids_local, kept_local, weights_local, w_gate, w_up, w_down, *,
                          top_k: int, impl: str, ragged: bool, slack: float | None,
                          axes: tuple[str, ...]):
    """Per device: x_local [T_l, d], ids_local / kept_local [T_l, k], weights_local [T_l, k] f32, expert
    weights [E_l, ...] -> [T_l, d] (x_local's dtype): the weighted sum of the device's token copies."""
    n = jax.lax.axis_size(EXPERT_AXIS)
    t_local, d = x_local.shape
    experts_local = w_gate.shape[0]
    lay = send_layout(ids_local, kept_local, experts_local, n)
    pass_kw = dict(tokens_local=t_local, impl=impl, ragged=ragged)
    width = rows_per_destination(t_local, top_k, experts_local, n, slack)
    source, cell = pass_source(lay, 0, width), pass_cell(lay, 0, width, top_k)
    send = gather_sent_rows(x_local, source, cell, top_k).reshape(n, width, d)
    y = pass_core(send, w_gate, w_up, w_down, pass_counts(lay.counts, 0, width), **pass_kw)
    out = combine_rows(y.reshape(n * width, d), weights_local, cell, source)
    extra = overflow_rows(width, t_local, top_k, experts_local)
    if extra:  # rows past the first pass, in passes of `extra` rows; every device runs as many
        n_passes = -(-jnp.maximum(jnp.max(lay.fill) - width, 0) // extra)
        n_passes = jax.lax.pmax(n_passes, axes) if axes else n_passes
        out = out + overflow_outputs(x_local, weights_local, w_gate, w_up, w_down, lay, n_passes, width,
                                     extra, tuple(sorted(pass_kw.items())))
    return out.astype(x_local.dtype)


@jax.named_scope("experts")  # names the ops for profiles (benchmarks/bench_ops.py)
def exchanged_moe_outputs(tokens: jax.Array, plan: Dispatch, router_weights: jax.Array, w_gate: jax.Array,
                          w_up: jax.Array, w_down: jax.Array, *, backend: str, ragged: bool, mesh,
                          slack: float | None = None) -> jax.Array:
    """tokens [T, d] (compute dtype), router_weights [T, k] float32, expert weights [E, ...] (E divisible
    by the `expert` axis of `mesh`, an AbstractMesh or Mesh) -> y [T, d] in the tokens' dtype: the
    weighted sum of each token's expert outputs (dropped copies count 0). slack: the first pass's rows per
    destination over the balanced load (None: the worst case); the result does not depend on it."""
    top_k = plan.expert_ids.shape[1]
    axes = token_axes(mesh)
    return run_sharded(lambda *a: _exchange_and_combine(*a, top_k=top_k, impl=backend, ragged=ragged,
                                                        slack=slack, axes=axes),
                       tokens, plan, router_weights, (w_gate, w_up, w_down), mesh=mesh)


def run_sharded(body, tokens: jax.Array, plan: Dispatch, router_weights: jax.Array, expert_weights, *,
                mesh) -> jax.Array:
    """The frame every expert-parallel exchange shares: checks that the experts [E, ...] split over the
    `expert` axis, pads tokens [T, d], expert ids and kept flags [T, k] and router weights [T, k] (float32)
    to a multiple of the token shards (padding tokens keep no copy), runs
    `body(tokens, ids, kept, router, w_gate, w_up, w_down)` per device in a shard_map (tokens split over
    `token_axes(mesh)`, experts over `expert`, weights cast to the tokens' dtype) and cuts the padding off
    its [T_local, d] result."""
    n_ep = mesh.shape[EXPERT_AXIS]
    n_experts = expert_weights[0].shape[0]
    if n_experts % n_ep:
        raise UsageError(f"{n_experts} experts do not split over expert axis of size {n_ep}; choose a --layout "
                         "expert size that divides the expert count")
    total = tokens.shape[0]
    axes = token_axes(mesh)
    shards = 1
    for axis in axes:
        shards *= mesh.shape[axis]
    pad = -total % shards  # odd token counts: padding tokens send nothing and are cut off after
    padded = [jnp.pad(a, ((0, pad), (0, 0))) for a in
              (tokens, plan.expert_ids, plan.kept, router_weights.astype(jnp.float32))]
    weights = [w.astype(tokens.dtype) for w in expert_weights]
    token_spec = P(axes if axes else None)
    expert_spec = P(EXPERT_AXIS)
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(token_spec,) * 4 + (expert_spec,) * 3,
        # Pallas kernels declare output shapes without varying-manual-axes types, which check_vma
        # rejects ("manual_axis_type ... must not be None"); the body's collectives are explicit.
        out_specs=token_spec, check_vma=False)
    return sharded(*padded, *weights)[:total]

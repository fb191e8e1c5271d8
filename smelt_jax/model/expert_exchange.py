"""The expert-parallel exchange strategy: experts sharded over the mesh's `expert` axis, token copies
exchanged with `all_to_all` inside `jax.shard_map`.

`exchanged_expert_outputs` has the contract of `expert_compute.local_expert_outputs` (tokens, the
layer's Dispatch, weights, backend -> y_copies [T, k, d]) with a different data movement. Routing,
the capacity decision (`Dispatch.kept`), the combine and the load statistics stay in the MoE layer
(`smelt_jax.model.moe`), outside the shard_map, so both strategies share them.

1. Inside the shard_map each device holds T_l tokens (tokens split over data x fsdp x expert) and
   E_l = E / n experts (n = size of `expert`). It writes each kept copy into a send buffer
   [n, C, d] at (destination device = expert // E_l, next free slot), C = T_l * min(k, E_l): a token
   picks distinct experts, so at most min(k, E_l) of its copies go to one device. Dropless.
2. `all_to_all` over `expert` swaps the buffers; the receiver sorts its n*C rows by local expert and
   calls `smelt_jax.kernels.expert_ffn` on its E_l experts (empty slots are padding rows).
3. Unsort, `all_to_all` back, gather each copy's output from (destination, slot).

Two ways to move the buffers (`ModelConfig.expert_exchange`; its default "auto" is ragged on TPU/GPU and
padded on CPU, decided by `kernels.backend.choose_expert_exchange`):
- "padded" (runs everywhere): `all_to_all` of the whole [n, C, d] buffers. When E_l >= k,
  only 1/n of the rows carry a token (`buffer_fill`), so n times the necessary bytes cross the ICI.
- "ragged": `jax.lax.ragged_all_to_all` sends only the filled prefix of each destination's block, into
  the same block layout on the receiver, so everything around the exchange is unchanged. XLA:CPU does
  not implement it ("UNIMPLEMENTED: HLO opcode ragged-all-to-all"), so on CPU it cannot run; the TPU
  compiler accepts it (tests/test_parallel_expert.py compiles a train step with it for a TPU slice).
Gradients flow through the exchanges (each all_to_all is the other's transpose; JAX transposes
ragged_all_to_all into the reverse ragged exchange).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from smelt_jax import sharding
from smelt_jax.errors import UsageError
from smelt_jax.kernels.backend import EXPERT_AXIS
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.model.dispatch import Dispatch


def token_axes(mesh) -> tuple[str, ...]:
    """Mesh axes that split the tokens inside the expert layer: the 'batch' rule's axes, then
    `expert` (tokens must be split over the expert axis too, or its devices would repeat work)."""
    rule = dict(sharding.LOGICAL_AXIS_RULES)["batch"]
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    if mesh is None:
        return ()
    return tuple(a for a in dict.fromkeys(axes + (EXPERT_AXIS,)) if mesh.shape[a] > 1)


def slots_per_destination(tokens_local: int, top_k: int, experts_local: int) -> int:
    """C: send-buffer rows per destination device. A token picks distinct experts, so at most
    min(k, E_l) of its copies go to one device: C = T_l * min(k, E_l) keeps the exchange dropless."""
    return tokens_local * min(top_k, experts_local)


def buffer_fill(top_k: int, n_experts: int, expert_shards: int) -> float:
    """Expected share of the receive buffer's rows that carry a token copy, dropless: each device
    sends T_l * k copies in n * C rows, so k / (n * min(k, E / n)). 1 when E / n = 1 (S~0 models);
    1/n whenever E / n >= k. The Pallas kernels skip the empty rows; their cost estimate cannot."""
    return top_k / (expert_shards * min(top_k, n_experts // expert_shards))


def ragged_block_args(send_counts: jax.Array, recv_counts: jax.Array, slots: int, my_index: jax.Array):
    """`ragged_all_to_all` arguments for buffers laid out as n blocks of `slots` rows, each holding a
    filled prefix: my block j (rows [j * slots, j * slots + send_counts[j])) goes to device j, where it
    lands in block `my_index`; I receive recv_counts[i] rows from device i into my block i.

    Returns (input_offsets, send_sizes, output_offsets, recv_sizes), each [n] int32."""
    n = send_counts.shape[0]
    input_offsets = jnp.arange(n, dtype=jnp.int32) * slots
    output_offsets = jnp.full((n,), my_index * slots, jnp.int32)
    return input_offsets, send_counts.astype(jnp.int32), output_offsets, recv_counts.astype(jnp.int32)


def exchange_blocks(blocks: jax.Array, counts: jax.Array, *, ragged: bool, fill_value=0) -> jax.Array:
    """Block j of `blocks` [n, slots, ...] to device j over `expert`; returns [n, slots, ...] with block i
    from device i. Only the first counts[j] rows of block j are meaningful (counts [n] int32). Padded:
    `all_to_all` of everything (padding rows arrive as sent). Ragged: only the filled rows travel; the
    rest of the result is `fill_value`."""
    if not ragged:
        return jax.lax.all_to_all(blocks, EXPERT_AXIS, 0, 0)
    n, slots = blocks.shape[:2]
    recv_counts = jax.lax.all_to_all(counts, EXPERT_AXIS, 0, 0, tiled=True)
    args = ragged_block_args(counts, recv_counts, slots, jax.lax.axis_index(EXPERT_AXIS))
    flat = blocks.reshape(n * slots, *blocks.shape[2:])
    out = jax.lax.ragged_all_to_all(flat, jnp.full_like(flat, fill_value), *args, axis_name=EXPERT_AXIS)
    return out.reshape(blocks.shape)


def _exchange_and_compute(x_local, ids_local, kept_local, w_gate, w_up, w_down, *, top_k: int,
                          impl: str, ragged: bool):
    """Per device: x_local [T_l, d], ids_local / kept_local [T_l, k], weights [E_l, ...] ->
    outputs of this device's token copies [T_l, k, d] (0 for dropped copies)."""
    n = jax.lax.axis_size(EXPERT_AXIS)
    t_local, d = x_local.shape
    experts_local = w_gate.shape[0]
    slots = slots_per_destination(t_local, top_k, experts_local)
    ids = ids_local.reshape(-1)
    dest = jnp.where(kept_local.reshape(-1), ids // experts_local, n)  # n: not sent
    local_expert = (ids % experts_local).astype(jnp.int32)
    onehot = (dest[:, None] == jnp.arange(n)[None, :]).astype(jnp.int32)  # [T_l*k, n]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, jnp.minimum(dest, n - 1)[:, None],
                               axis=1)[:, 0]
    rows = jnp.repeat(x_local, top_k, axis=0)  # copy j of token t is row t*k + j
    send_x = jnp.zeros((n, slots, d), x_local.dtype).at[dest, slot].set(rows, mode="drop")
    send_e = jnp.full((n, slots), experts_local, jnp.int32).at[dest, slot].set(local_expert,
                                                                                mode="drop")
    send_counts = jnp.sum(onehot, axis=0)  # [n] copies this device sends to each destination
    recv_x = exchange_blocks(send_x, send_counts, ragged=ragged)  # [n sources, slots, d]
    recv_e = exchange_blocks(send_e, send_counts, ragged=ragged, fill_value=experts_local)
    flat_e = recv_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # empty slots (id E_l) sort last: padding rows
    group_sizes = jnp.bincount(flat_e, length=experts_local).astype(jnp.int32)
    x_sorted = jnp.take(recv_x.reshape(n * slots, d), order, axis=0)
    # One token sends at most one copy to an expert: an expert receives at most n * T_l rows.
    y_sorted = expert_ffn(x_sorted, w_gate, w_up, w_down, group_sizes, impl=impl,
                          capacity=n * t_local)
    y_recv = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(n, slots, d)
    # Back the way they came: block i holds the copies source i sent, recv_counts[i] of them.
    recv_counts = jnp.sum(flat_e.reshape(n, slots) < experts_local, axis=1).astype(jnp.int32)
    y_back = exchange_blocks(y_recv, recv_counts, ragged=ragged)  # [n destinations, slots, d]
    y_copies = y_back.at[dest, slot].get(mode="fill", fill_value=0)
    return y_copies.reshape(t_local, top_k, d)


def exchanged_expert_outputs(tokens: jax.Array, plan: Dispatch, w_gate: jax.Array, w_up: jax.Array,
                             w_down: jax.Array, *, backend: str, ragged: bool, mesh) -> jax.Array:
    """tokens [T, d] (compute dtype), weights [E, ...] (E divisible by the `expert` axis of `mesh`, an
    AbstractMesh or Mesh) -> y_copies [T, k, d], 0 for the copies `plan` drops."""
    n_ep = mesh.shape[EXPERT_AXIS]
    n_experts = w_gate.shape[0]
    if n_experts % n_ep:
        raise UsageError(f"{n_experts} experts do not split over expert axis of size {n_ep}; choose a --layout "
                         "expert size that divides the expert count")
    total = tokens.shape[0]
    top_k = plan.expert_ids.shape[1]
    axes = token_axes(mesh)
    shards = 1
    for axis in axes:
        shards *= mesh.shape[axis]
    pad = -total % shards  # odd token counts: padding tokens send nothing and are cut off after
    tokens_p = jnp.pad(tokens, ((0, pad), (0, 0)))
    ids_p = jnp.pad(plan.expert_ids, ((0, pad), (0, 0)))
    kept_p = jnp.pad(plan.kept, ((0, pad), (0, 0)))
    weights = [w.astype(tokens.dtype) for w in (w_gate, w_up, w_down)]
    token_spec = P(axes if axes else None)
    expert_spec = P(EXPERT_AXIS)
    body = jax.shard_map(
        lambda *a: _exchange_and_compute(*a, top_k=top_k, impl=backend, ragged=ragged),
        mesh=mesh, in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec,
                             expert_spec),
        # Pallas kernels declare output shapes without varying-manual-axes types, which check_vma
        # rejects ("manual_axis_type ... must not be None"); the body's collectives are explicit.
        out_specs=token_spec, check_vma=False)
    return body(tokens_p, ids_p, kept_p, *weights)[:total]

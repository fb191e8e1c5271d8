"""The expert-parallel exchange strategy: experts sharded over the mesh's `expert` axis, token copies
exchanged with `all_to_all` inside `jax.shard_map`.

`exchanged_expert_outputs` has the contract of `expert_compute.local_expert_outputs` (tokens, the
layer's Dispatch, weights, backend -> y_copies [T, k, d]) with a different data movement. Routing,
the capacity decision (`Dispatch.kept`), the combine and the load statistics stay in the MoE layer
(`smelt_jax.model.moe`), outside the shard_map, so both strategies share them.

Inside the shard_map each device holds T_l tokens (tokens split over data x fsdp x expert) and
E_l = E / n experts (n = size of `expert`); expert e lives on device e // E_l as local expert e % E_l.

1. Layout (`_send_layout`): the device's R = T_l * k copies are sorted by expert (stable), so the copies
   for destination j form block j, itself grouped by local expert: copy r sits at row slot[r] of block
   dest[r]; counts [n, E_l] says how many rows each (destination, local expert) has.
2. A pass (`_one_pass`) moves rows [first, first + width) of every block: a send buffer [n, width, d],
   `all_to_all` over `expert` of it and of its counts [n, E_l] (the rows' experts follow from the counts:
   no per-row expert id crosses the network), the receiver puts its n * width rows in expert order by
   arithmetic on the counts, runs `smelt_jax.kernels.expert_ffn` on its E_l experts, and everything goes
   back the way it came.
3. The first pass has width C = `moe_buffers.rows_per_destination` (the expected load x
   `ModelConfig.expert_buffer_slack`; None = the worst case). Rows past C are never dropped: overflow
   passes of width `moe_buffers.overflow_rows` run in a loop, as many as the fullest block of any device
   needs (a `pmax` over the token axes, so every device runs the same collectives). With enough slack the
   loop runs 0 times. The loop has a custom VJP (`_overflow_outputs`) whose backward loops over the same
   passes, recomputing each one's forward: a while loop of data-dependent length is not differentiable
   by JAX itself.

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

from smelt_jax import sharding
from smelt_jax.errors import UsageError
from smelt_jax.kernels.backend import EXPERT_AXIS
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.model.dispatch import Dispatch, argsort_small_keys, inverse_permutation
from smelt_jax.model.moe_buffers import buffer_fill, overflow_rows, rows_per_destination

__all__ = ["buffer_fill", "exchanged_expert_outputs", "token_axes"]


def token_axes(mesh) -> tuple[str, ...]:
    """Mesh axes that split the tokens inside the expert layer: the 'batch' rule's axes, then
    `expert` (tokens must be split over the expert axis too, or its devices would repeat work)."""
    rule = dict(sharding.LOGICAL_AXIS_RULES)["batch"]
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    if mesh is None:
        return ()
    return tuple(a for a in dict.fromkeys(axes + (EXPERT_AXIS,)) if mesh.shape[a] > 1)


def ragged_block_args(send_counts: jax.Array, recv_counts: jax.Array, slots: int, my_index: jax.Array):
    """`ragged_all_to_all` arguments for buffers laid out as n blocks of `slots` rows, each holding a
    filled prefix: my block j (rows [j * slots, j * slots + send_counts[j])) goes to device j, where it
    lands in block `my_index`; I receive recv_counts[i] rows from device i into my block i.

    Returns (input_offsets, send_sizes, output_offsets, recv_sizes), each [n] int32."""
    n = send_counts.shape[0]
    input_offsets = jnp.arange(n, dtype=jnp.int32) * slots
    output_offsets = jnp.full((n,), my_index * slots, jnp.int32)
    return input_offsets, send_counts.astype(jnp.int32), output_offsets, recv_counts.astype(jnp.int32)


def exchange_blocks(blocks: jax.Array, counts: jax.Array, recv_counts: jax.Array, *,
                    ragged: bool) -> jax.Array:
    """Block j of `blocks` [n, slots, d] to device j over `expert`; returns [n, slots, d] with block i
    from device i. Only the first counts[j] rows of block j are meaningful (counts [n] int32; recv_counts
    [n]: what arrives from each device). Padded: `all_to_all` of everything. Ragged: only the filled
    rows travel; the rest of the result is 0."""
    if not ragged:
        return jax.lax.all_to_all(blocks, EXPERT_AXIS, 0, 0)
    n, slots = blocks.shape[:2]
    args = ragged_block_args(counts, recv_counts, slots, jax.lax.axis_index(EXPERT_AXIS))
    flat = blocks.reshape(n * slots, *blocks.shape[2:])
    out = jax.lax.ragged_all_to_all(flat, jnp.zeros_like(flat), *args, axis_name=EXPERT_AXIS)
    return out.reshape(blocks.shape)


def _send_layout(ids_local: jax.Array, kept_local: jax.Array, experts_local: int, n: int):
    """ids_local / kept_local [T_l, k] -> (dest [R] int32, n for copies not sent; slot [R] int32, the
    copy's row in its destination's block; counts [n, E_l] int32, rows per (destination, local expert)).
    R = T_l * k; copy j of token t is r = t * k + j. Blocks are in expert order, then token order."""
    ids = ids_local.reshape(-1).astype(jnp.int32)
    kept = kept_local.reshape(-1)
    key = jnp.where(kept, ids, n * experts_local)  # global expert = destination * E_l + local expert
    rank = inverse_permutation(argsort_small_keys(key, n * experts_local + 1))
    counts = jnp.bincount(key, length=n * experts_local).astype(jnp.int32).reshape(n, experts_local)
    dest = jnp.where(kept, ids // experts_local, n)
    block_start = jnp.cumsum(jnp.sum(counts, axis=1)) - jnp.sum(counts, axis=1)  # [n]
    slot = rank - jnp.take(block_start, jnp.minimum(dest, n - 1))
    return dest, slot, counts


def _pass_counts(counts: jax.Array, first, width: int) -> jax.Array:
    """counts [n, E_l] of whole blocks -> the rows of each (block, expert) inside rows [first,
    first + width) of the block, [n, E_l] int32."""
    ends = jnp.cumsum(counts, axis=1)
    starts = ends - counts
    return (jnp.clip(ends - first, 0, width) - jnp.clip(starts - first, 0, width)).astype(jnp.int32)


def _receiver_positions(recv_counts: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """recv_counts [n sources, E_l] of blocks of `width` rows -> (position [n * width] int32: the row's
    place in expert order (experts in order, sources in order within one, rows in order), n * width for
    empty rows; group_sizes [E_l] int32)."""
    n, experts_local = recv_counts.shape
    ends = jnp.cumsum(recv_counts, axis=1)  # [n, E_l] within each block
    r = jnp.arange(width, dtype=jnp.int32)
    expert = jnp.sum(r[None, :, None] >= ends[:, None, :], axis=2)  # [n, width]; E_l for empty rows
    e = jnp.minimum(expert, experts_local - 1)
    group_sizes = jnp.sum(recv_counts, axis=0)
    group_start = jnp.cumsum(group_sizes) - group_sizes  # [E_l]
    before = jnp.cumsum(recv_counts, axis=0) - recv_counts  # [n, E_l] rows of earlier sources
    within = r[None, :] - jnp.take_along_axis(ends - recv_counts, e, axis=1)
    position = jnp.take(group_start, e) + jnp.take_along_axis(before, e, axis=1) + within
    return jnp.where(expert < experts_local, position, n * width).reshape(-1), group_sizes


def _one_pass(x_local, w_gate, w_up, w_down, dest, slot, counts, first, *, width: int, top_k: int,
              impl: str, ragged: bool):
    """Rows [first, first + width) of every destination block, exchanged and computed.
    x_local [T_l, d]; weights [E_l, ...]; dest / slot [R]; counts [n, E_l] -> [R, d], the outputs of the
    copies in this pass (0 for the others)."""
    n, experts_local = counts.shape
    t_local, d = x_local.shape
    in_pass = (dest < n) & (slot >= first) & (slot < first + width)
    to = jnp.where(in_pass, dest, n)
    row = slot - first
    rows = jnp.repeat(x_local, top_k, axis=0)  # [R, d]
    send_x = jnp.zeros((n, width, d), x_local.dtype).at[to, row].set(rows, mode="drop")
    send_counts = _pass_counts(counts, first, width)  # [n, E_l]
    recv_counts = jax.lax.all_to_all(send_counts, EXPERT_AXIS, 0, 0, tiled=True)  # [n sources, E_l]
    send_fill, recv_fill = jnp.sum(send_counts, axis=1), jnp.sum(recv_counts, axis=1)
    recv_x = exchange_blocks(send_x, send_fill, recv_fill, ragged=ragged).reshape(n * width, d)
    position, group_sizes = _receiver_positions(recv_counts, width)
    m = n * width
    source = jnp.zeros((m,), jnp.int32).at[position].set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    carried = jnp.arange(m) < jnp.sum(group_sizes)
    x_sorted = jnp.where(carried[:, None], jnp.take(recv_x, source, axis=0), 0)
    # One token sends at most one copy to an expert: an expert gets at most n * min(T_l, width) rows.
    y_sorted = expert_ffn(x_sorted, w_gate, w_up, w_down, group_sizes, impl=impl,
                          capacity=n * min(t_local, width))
    filled = position < m
    y_recv = jnp.where(filled[:, None], jnp.take(y_sorted, jnp.minimum(position, m - 1), axis=0), 0)
    y_back = exchange_blocks(y_recv.reshape(n, width, d), recv_fill, send_fill, ragged=ragged)
    return y_back.at[to, row].get(mode="fill", fill_value=0)


def _overflow_outputs(params, ints, n_passes, *, first: int, width: int, pass_kw: dict):
    """Sum of `n_passes` (traced) passes of `width` rows from row `first` on: params (x_local, w_gate,
    w_up, w_down), ints (dest, slot, counts) -> [R, d]. A custom VJP: its backward loops over the same
    passes, recomputing each pass's forward under `jax.vjp`."""

    def run(p, i, q):
        return _one_pass(*p, *i, first + q * width, width=width, **pass_kw)

    @jax.custom_vjp
    def overflow(p, i, passes):
        zero = jnp.zeros((i[0].shape[0], p[0].shape[1]), p[0].dtype)
        return jax.lax.fori_loop(0, passes, lambda q, acc: acc + run(p, i, q), zero)

    def fwd(p, i, passes):
        return overflow(p, i, passes), (p, i, passes)

    def bwd(res, g):
        p, i, passes = res

        def step(q, acc):
            _, vjp = jax.vjp(lambda pp: run(pp, i, q), p)
            return jax.tree.map(jnp.add, acc, vjp(g)[0])
        return jax.lax.fori_loop(0, passes, step, jax.tree.map(jnp.zeros_like, p)), None, None

    overflow.defvjp(fwd, bwd)
    return overflow(tuple(params), tuple(ints), n_passes)


def _exchange_and_compute(x_local, ids_local, kept_local, w_gate, w_up, w_down, *, top_k: int,
                          impl: str, ragged: bool, slack: float | None, axes: tuple[str, ...]):
    """Per device: x_local [T_l, d], ids_local / kept_local [T_l, k], weights [E_l, ...] ->
    outputs of this device's token copies [T_l, k, d] (0 for dropped copies)."""
    n = jax.lax.axis_size(EXPERT_AXIS)
    t_local, d = x_local.shape
    experts_local = w_gate.shape[0]
    ints = _send_layout(ids_local, kept_local, experts_local, n)
    params = (x_local, w_gate, w_up, w_down)
    pass_kw = dict(top_k=top_k, impl=impl, ragged=ragged)
    width = rows_per_destination(t_local, top_k, experts_local, n, slack)
    y = _one_pass(*params, *ints, 0, width=width, **pass_kw)
    extra = overflow_rows(width, t_local, top_k, experts_local)
    if extra:  # rows past the first pass, in passes of `extra` rows; every device runs as many
        fullest = jnp.max(jnp.sum(ints[2], axis=1))
        n_passes = -(-jnp.maximum(fullest - width, 0) // extra)
        n_passes = jax.lax.pmax(n_passes, axes) if axes else n_passes
        y = y + _overflow_outputs(params, ints, n_passes, first=width, width=extra, pass_kw=pass_kw)
    return y.reshape(t_local, top_k, d)


@jax.named_scope("experts")  # names the ops for profiles (benchmarks/bench_ops.py)
def exchanged_expert_outputs(tokens: jax.Array, plan: Dispatch, w_gate: jax.Array, w_up: jax.Array,
                             w_down: jax.Array, *, backend: str, ragged: bool, mesh,
                             slack: float | None = None) -> jax.Array:
    """tokens [T, d] (compute dtype), weights [E, ...] (E divisible by the `expert` axis of `mesh`, an
    AbstractMesh or Mesh) -> y_copies [T, k, d], 0 for the copies `plan` drops. slack: the first pass's
    rows per destination over the balanced load (None: the worst case); the result does not depend on it."""
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
        lambda *a: _exchange_and_compute(*a, top_k=top_k, impl=backend, ragged=ragged, slack=slack,
                                         axes=axes),
        mesh=mesh, in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec,
                             expert_spec),
        # Pallas kernels declare output shapes without varying-manual-axes types, which check_vma
        # rejects ("manual_axis_type ... must not be None"); the body's collectives are explicit.
        out_specs=token_spec, check_vma=False)
    return body(tokens_p, ids_p, kept_p, *weights)[:total]

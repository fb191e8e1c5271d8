"""The ring-of-experts exchange: all-gather the tokens over `expert`, compute the local experts,
combine, reduce-scatter back (`ModelConfig.expert_exchange = "ring"`).

    ring_expert_outputs(tokens [T, d], plan, router_weights [T, k], w_gate, w_up, w_down, ...) -> y [T, d]

Unlike `expert_exchange.exchanged_expert_outputs` (y_copies [T, k, d], combined by the MoE layer), the
weighted top-k sum happens here, inside the shard_map, so only [T, d] rows travel back.

Inside the shard_map each device holds T_l tokens (split over the batch axes and `expert`) and
E_l = E / n experts (n = size of `expert`; expert e lives on device e // E_l as local expert e % E_l):

1. `all_gather` over `expert` of the tokens [T_l, d], their expert ids, kept flags and router weights
   (flat, [T_l * k]): every device of an expert group sees the group's G = n * T_l tokens.
2. The G * k copies routed to this device's experts are sorted by local expert (stable; other copies
   sort last). A first pass computes the first `rows` of them through `kernels.experts.expert_ffn`
   (`rows` = the expected load G * k / n x `ModelConfig.expert_buffer_slack`, rounded to tiles:
   `moe_buffers.rows_per_destination(G, ...)`; None = the worst case G * min(k, E_l)); copies past it
   run in overflow passes of `moe_buffers.overflow_rows` rows, a loop of as many passes as this device
   needs. The loop holds no collective, so devices do not agree on a count.
3. The expert FFN weighs each row by its router weight (`expert_ffn(row_weight=...)`: on TPU in the
   down-projection kernel's epilogue, on the f32 accumulator, so no array of unweighted or weighted rows
   is written twice); each weighted row is scatter-added into its token's row of y_partial [G, d] in the
   compute dtype (no float32 [rows, d] or [G, d] array, no convert), every pass into the same buffer in
   place; y_partial is `psum_scatter`ed over `expert`: each device gets the sum over devices for its own
   T_l tokens.

Steps 2-3 are one custom VJP (`_local_experts`): the forward saves the first pass's FFN residuals (its
input rows and hidden activations in the compute dtype, not its output rows); the backward gathers the
cotangent's rows and hands them to the FFN's VJP, which returns the router weights' gradient with the
others (on TPU from the down-projection's backward kernel: no [rows, d] product and reduction in XLA).
Each pass (overflow passes recomputed) scatter-adds only its own rows into the gradients, so an overflow
pass costs in proportion to its rows, not to G.

Per device and layer this sends (n - 1) T_l d elements twice (gather, reduce-scatter) instead of two
all-to-alls of n C d elements (C = slack T_l k / n): 2 (n-1) T_l d against 2 slack k T_l d, e.g.
14 T_l d against 24 T_l d at n = k = 8, slack 1.5. It computes the same rows (the local experts' copies).

Precision: the expert rows, their weighted sum per device and the reduce-scatter's sum over devices are
in the compute dtype (bfloat16 on TPU: a token's copies on one device, at most min(k, E_l) and about
k / n, are added in bfloat16 as the reduce-scatter adds the devices' partial sums; float32 in the
tests, which compare with the dense reference). Rows past a pass's copies gather a clamped token row
(`take_rows_clamped`: one gather, no mask) whose output is dropped and whose cotangent is 0.

The collectives sit under the named scope RING_SCOPE so the compile report can count them as the
expert exchange (`compile.hlo_stats`) rather than as FSDP traffic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from smelt_jax.kernels.backend import EXPERT_AXIS
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.model.dispatch import Dispatch, argsort_small_keys
from smelt_jax.model.expert_exchange import run_sharded
from smelt_jax.model.row_gather import take_rows, take_rows_clamped
from smelt_jax.model.moe_buffers import overflow_rows, round_up, rows_per_destination, worst_case_rows

__all__ = ["RING_SCOPE", "ring_expert_outputs", "ring_fill", "ring_rows"]

RING_SCOPE = "ring_exchange"  # named scope of the exchange's collectives (op_name in the HLO metadata)


LANES = 128  # a TPU vector register's lanes: the minor dimension of a row-major array pads to them
KERNEL_ROW_TILE = 512  # the grouped matmul's row tile (kernels/gmm.py DEFAULT_TILING): no row padding copy


def ring_rows(gathered_tokens: int, top_k: int, experts_local: int, expert_shards: int,
              slack: float | None) -> int:
    """Rows of the first pass: the copies of G gathered tokens a device expects (G k / n) x slack,
    rounded up to KERNEL_ROW_TILE (to the 128 / 8 tiles of `moe_buffers` when smaller), capped at the
    worst case G * min(k, E_l)."""
    rows = rows_per_destination(gathered_tokens, top_k, experts_local, expert_shards, slack)
    worst = worst_case_rows(gathered_tokens, top_k, experts_local)
    return rows if rows < KERNEL_ROW_TILE else min(worst, round_up(rows, KERNEL_ROW_TILE))


def ring_fill(top_k: int, n_experts: int, expert_shards: int, tokens_local: int,
              slack: float | None) -> float:
    """Expected share of the first pass's rows that carry a copy: (G k / n) / rows, G = n * T_l."""
    experts_local = n_experts // expert_shards
    gathered = expert_shards * tokens_local
    rows = ring_rows(gathered, top_k, experts_local, expert_shards, slack)
    return min(1.0, gathered * top_k / expert_shards / rows)


def _window_counts(counts: jax.Array, first, width: int) -> jax.Array:
    """counts [E_l] of the sorted local copies -> rows of each expert inside [first, first + width)."""
    ends = jnp.cumsum(counts)
    starts = ends - counts
    return (jnp.clip(ends - first, 0, width) - jnp.clip(starts - first, 0, width)).astype(jnp.int32)


def _window(order, counts, first, width: int, gathered: int, top_k: int):
    """The sorted local copies [first, first + width): (group_sizes [E_l], copies [W] flat copy index,
    token [W] (`gathered` past the end: dropped / filled with 0), valid [W])."""
    group_sizes = _window_counts(counts, first, width)
    copies = jax.lax.dynamic_slice(order, (first,), (width,))
    valid = jnp.arange(width) < jnp.sum(group_sizes)
    return group_sizes, jnp.where(valid, copies, gathered * top_k), jnp.where(valid, copies // top_k, gathered), valid


def _pass_forward(x_all, route_w, experts, window, *, capacity: int, impl: str):
    """One pass's rows, each times its router weight: (y_sorted [W, d] in x's dtype, the ffn's VJP in x,
    weight and experts). The weight is applied by the expert FFN (in the down-projection kernel's
    epilogue on TPU, which also takes its gradient in its backward: kernels/gmm.py)."""
    group_sizes, copies, token, _ = window
    x_sorted = take_rows_clamped(x_all, token)  # rows past the copies: dropped by the combine
    weight = take_rows(route_w, copies)  # [W] float32, 0 past the copies
    return jax.vjp(lambda xs, wt, *w: expert_ffn(xs, *w, group_sizes, impl=impl, capacity=capacity,
                                                 row_weight=wt), x_sorted, weight, *experts)


def _combine(acc, y_sorted, token):
    """acc [G, d] += the weighted rows y_sorted at each row's token, in y's dtype (in place; the dropped
    rows' token is G)."""
    return acc.at[token].add(y_sorted, mode="drop")


def _pass_backward(g, ffn_vjp, window, grads):
    """Adds one pass's cotangents into grads = (dx_all [G, d], droute_w [G k] f32, dw_gate, dw_up, dw_down)
    (in place: scatter-adds of the pass's rows only). g [G, d] is the cotangent of the combined rows."""
    _, copies, token, _ = window
    g_rows = take_rows_clamped(g, token)  # dropped rows: weight 0, their dx and dweight dropped
    dx_sorted, dweight, *dw = ffn_vjp(g_rows)
    dx_all, droute_w, *dw_all = grads
    return (dx_all.at[token].add(dx_sorted.astype(dx_all.dtype), mode="drop"),
            droute_w.at[copies].add(dweight.astype(droute_w.dtype), mode="drop"),
            *(a + b.astype(a.dtype) for a, b in zip(dw_all, dw)))


def _local_experts(x_all, route_w, experts, order, counts, *, rows: int, extra: int, top_k: int, impl: str):
    """The local experts' copies of the gathered tokens, weighted and summed per token.

    x_all [G, d]; route_w [G k] float32 (0 for copies not computed here); experts (w_gate, w_up, w_down)
    [E_l, ...]; order [G k + max(rows, extra)] int32 (flat copy index of each sorted row, padded); counts
    [E_l] -> y [G, d] in x_all's dtype, accumulated in it.

    A first pass of `rows` sorted rows, then overflow passes of `extra` rows for the device's copies past
    it (a loop of data-dependent length; none when extra = 0). A custom VJP: the forward saves the first
    pass's rows in x's dtype (no float32 [rows, d]); the backward gathers the cotangent's rows, and every
    pass (the overflow passes recomputed) scatter-adds only its own rows into the gradient of x_all, so a
    pass costs in proportion to its rows, not to G."""
    gathered = x_all.shape[0]
    kw = dict(impl=impl)

    def windows(order, counts):
        """(the first pass's window, q -> overflow pass q's window, the number of overflow passes)."""
        n_passes = (-(-jnp.maximum(jnp.sum(counts) - rows, 0) // extra)) if extra else 0
        return (_window(order, counts, 0, rows, gathered, top_k),
                lambda q: _window(order, counts, rows + q * extra, extra, gathered, top_k), n_passes)

    def forward(x_all, route_w, experts, order, counts):
        first, over, n_passes = windows(order, counts)
        y_sorted, ffn_vjp = _pass_forward(x_all, route_w, experts, first, capacity=min(gathered, rows), **kw)
        y = _combine(jnp.zeros(x_all.shape, y_sorted.dtype), y_sorted, first[2])

        def overflow(q, y):
            w = over(q)
            y_q, _ = _pass_forward(x_all, route_w, experts, w, capacity=min(gathered, extra), **kw)
            return _combine(y, y_q, w[2])
        if extra:
            y = jax.lax.fori_loop(0, n_passes, overflow, y)
        return y.astype(x_all.dtype), ffn_vjp  # y's dtype is x's: no convert

    @jax.custom_vjp
    def local(x_all, route_w, experts, order, counts):
        return forward(x_all, route_w, experts, order, counts)[0]

    def fwd(x_all, route_w, experts, order, counts):
        y, saved = forward(x_all, route_w, experts, order, counts)
        return y, (x_all, route_w, experts, order, counts, saved)

    def bwd(res, g):
        x_all, route_w, experts, order, counts, ffn_vjp = res
        first, over, n_passes = windows(order, counts)
        zeros = (jnp.zeros_like(x_all), jnp.zeros_like(route_w), *(jnp.zeros_like(w) for w in experts))
        grads = _pass_backward(g, ffn_vjp, first, zeros)

        def overflow(q, grads):
            w = over(q)
            _, vjp_q = _pass_forward(x_all, route_w, experts, w, capacity=min(gathered, extra), **kw)
            return _pass_backward(g, vjp_q, w, grads)
        if extra:
            # The loop carries the first pass's dx (the reduce-scatter's operand) but not its weight
            # gradients, added after: so the first pass's weight-gradient kernels depend on nothing the
            # reduce-scatter waits for and the scheduler may run them inside its window (docs/roofline.md).
            looped = jax.lax.fori_loop(0, n_passes, overflow, (*grads[:2], *zeros[2:]))
            grads = (*looped[:2], *(a + b for a, b in zip(grads[2:], looped[2:])))
        return grads[0], grads[1], tuple(grads[2:]), None, None

    local.defvjp(fwd, bwd)
    return local(x_all, route_w, tuple(experts), order, counts)


def _row_major(x: jax.Array) -> jax.Array:
    """x [T_l, d] held row-major (d minor) where d does not fill whole 128-wide lanes (a no-op where it
    does, and for the cotangent too).

    Left to itself, XLA:TPU lays such an activation out transposed (tokens minor: no lane padding) and
    so lays out the ring's [G, d] all-gather and reduce-scatter buffers the same way, which the expert
    kernels and the row gathers cannot read: a transposing copy of [G, d] per layer and direction (100M S95
    SMELT, d 576: 15 copies of 0.32 GB; docs/roofline.md). Held row-major at the [T_l, d] boundary, the
    transposes XLA still wants happen on T_l rows, not on G = n T_l."""
    if x.shape[-1] % LANES == 0:
        return x
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def _ring_body(x_local, ids_local, kept_local, weights_local, w_gate, w_up, w_down, *, top_k: int,
               impl: str, slack: float | None):
    """Per device: x_local [T_l, d], ids / kept / router weights [T_l, k], expert weights [E_l, ...]
    -> y_local [T_l, d] in x_local's dtype (the weighted sum over the token's kept copies)."""
    n = jax.lax.axis_size(EXPERT_AXIS)
    experts_local = w_gate.shape[0]
    x_local = _row_major(x_local)
    # The per-copy arrays travel flat ([T_l * k]: copy j of token t at t * k + j, devices in order, as
    # the [T_l, k] arrays gathered would be): a [G, k] int32 array is laid out on TPU with its k = 8
    # lanes padded to 128, 16x its bytes in every op that touches it.
    with jax.named_scope(RING_SCOPE):
        x_all, ids, kept, route_w = (jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
                                     for a in (x_local, ids_local.reshape(-1), kept_local.reshape(-1),
                                               weights_local.reshape(-1)))
    gathered = x_all.shape[0]
    local_expert = ids.astype(jnp.int32) - jax.lax.axis_index(EXPERT_AXIS) * experts_local
    here = kept & (local_expert >= 0) & (local_expert < experts_local)
    key = jnp.where(here, local_expert, experts_local)
    counts = jnp.bincount(key, length=experts_local + 1)[:experts_local].astype(jnp.int32)
    route_w = jnp.where(here, route_w.astype(jnp.float32), 0.0)
    rows = ring_rows(gathered, top_k, experts_local, n, slack)
    extra = overflow_rows(rows, gathered, top_k, experts_local)
    order = argsort_small_keys(key, experts_local + 1)
    order = jnp.pad(order, (0, max(rows, extra)))  # windows past the end read padding (masked)
    y = _local_experts(x_all, route_w, (w_gate, w_up, w_down), order, counts, rows=rows, extra=extra,
                       top_k=top_k, impl=impl)
    with jax.named_scope(RING_SCOPE):
        y_local = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return _row_major(y_local)


@jax.named_scope("experts")  # names the ops for profiles (benchmarks/bench_ops.py)
def ring_expert_outputs(tokens: jax.Array, plan: Dispatch, router_weights: jax.Array, w_gate: jax.Array,
                        w_up: jax.Array, w_down: jax.Array, *, backend: str, mesh,
                        slack: float | None = None) -> jax.Array:
    """tokens [T, d] (compute dtype), router_weights [T, k] float32, expert weights [E, ...] (E divisible
    by `mesh`'s `expert` axis) -> y [T, d] float32 in value (rounded to the compute dtype): the weighted
    sum of each token's kept expert outputs. slack: first-pass rows over the expected load (None: the
    worst case); the result does not depend on it."""
    top_k = plan.expert_ids.shape[1]
    return run_sharded(lambda *a: _ring_body(*a, top_k=top_k, impl=backend, slack=slack),
                       tokens, plan, router_weights, (w_gate, w_up, w_down), mesh=mesh).astype(jnp.float32)

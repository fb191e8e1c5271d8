"""The unembedding and the masked next-token cross-entropy, fused and chunked over the sequence: the whole
float32 logits [b, s, vocab] never exist (4 GiB per device at smelt16's 65,536-token vocabulary).

    unembed_cross_entropy(hidden [b, s, d] compute dtype, unembedding [d, V] param dtype,
                          targets [b, s] int, mask [b, s] float) -> (sum of masked token losses, token count)

The sequence is cut into chunks of `seq_chunk(s, V)` positions (the last one padded with masked rows). For
each chunk, in one `lax.scan`: logits [b, c, V] = hidden_c @ unembedding (compute-dtype operands, float32
accumulation), log-partition, target logit, and at once the gradients of the chunk's loss sum,
dlogits = (softmax - onehot(target)) * mask (cast to the compute dtype), d hidden_c = dlogits @ U^T and
d U += hidden_c^T @ dlogits (float32 accumulator). The loss is linear in its cotangent, so the backward
only scales those saved gradients (a `custom_vjp`): 3 matmuls per chunk, as unchunked autodiff, and no
logits kept for the backward. Without differentiation (evaluation) only the forward part runs.

The matmul form is decided by `kernels.backend.choose_unembedding_form` from the platform traced for:
`einsum` over [b, c, ...] (TPU, GPU), or `matmul` on [b * c, ...] 2-D operands (CPU, where the einsum's
weight gradient makes a transposed copy: docs/performance.md).

Two implementations, chosen by `kernels.backend.choose_loss_impl` from the platform traced for (`impl`):
- `chunked` (CPU, GPU): the scan above; its float32 logit chunks pass through HBM on a TPU (the issue-50
  measurement: 26.8 GB walked for the 100M shapes' loss on v5p).
- `fused` (TPU): the Pallas kernels of `kernels/fused_ce.py`. The forward kernel writes only each
  token's log-partition and target logit; the backward kernel recomputes the logits tile by tile and
  writes d hidden and d unembedding (each d-unembedding block accumulated over all tokens in VMEM, written
  once). No [tokens, vocab] buffer exists in HBM (2.5 GB walked for the same shapes: docs/kernels.md).
  Under a mesh of more than one device the kernels run per device in a `shard_map` (Mosaic kernels are
  not partitioned by GSPMD): tokens split over the `batch` axes, the vocabulary over the `vocab` axes
  (per-token statistics combined across them), d unembedding summed over the batch axes and
  reduce-scattered over those that shard the unembedding's `embed` dimension.
Both support an optional z-loss, z_loss * logsumexp(logits)**2 per counted token (default 0).

`cross_entropy(logits, targets, mask)` is the unfused definition (tests and callers that hold logits).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from smelt_jax.kernels import fused_ce
from smelt_jax.kernels.backend import choose_loss_impl, choose_unembedding_form
from smelt_jax.parallel.sharding import constrain, current_mesh, logical_to_mesh

# Logits per batch row in one chunk: 2**24 = 256 positions at a 65,536 vocabulary (256 MiB of float32 per
# device at 4 rows a device), the whole row at the CPU suites' 512.
LOGITS_PER_ROW_CHUNK = 2**24


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token losses, number of masked tokens). logits [b, s, V] float32."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    losses = (log_z - target_logit) * mask
    return losses.sum(), mask.sum()


def seq_chunk(seq_len: int, vocab: int) -> int:
    """Sequence positions per chunk: the largest power of two (>= 8) with at most LOGITS_PER_ROW_CHUNK
    logits per batch row, or the whole sequence when that is shorter."""
    chunk = 8
    while chunk * 2 * vocab <= LOGITS_PER_ROW_CHUNK:
        chunk *= 2
    return min(chunk, seq_len)


@jax.named_scope("unembedding_loss")  # names the ops for profiles (benchmarks/bench_ops.py)
def unembed_cross_entropy(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, mask: jax.Array,
                          *, chunk: int | None = None, form: str | None = None, z_loss: float = 0.0,
                          impl: str = "auto", tiles: fused_ce.Tiles | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token losses, number of masked tokens) of logits = hidden @ unembedding.

    hidden [b, s, d] in the compute dtype; unembedding [d, V] (cast to hidden's dtype for the matmuls);
    targets [b, s] int; mask [b, s] float (1 = counted). A token's loss is logsumexp(logits) -
    logits[target] + z_loss * logsumexp(logits)**2. impl: 'chunked', 'fused' or 'auto'
    (`choose_loss_impl`: fused on TPU). chunked only: chunk, positions per chunk (None: `seq_chunk`), and
    form, 'einsum' or 'matmul' (None: `choose_unembedding_form`). fused only: tiles (None: the kernel's
    defaults for d).
    """
    b, s, _ = hidden.shape
    mesh = current_mesh()
    mask = mask.astype(jnp.float32)
    targets = targets.astype(jnp.int32)
    plan = None
    if choose_loss_impl(impl, mesh=mesh) == "fused":
        plan = _fused_plan(mesh, b, unembedding.shape, tiles)
    if plan is not None:
        plan = dataclasses.replace(plan, grad_dtype=jnp.dtype(unembedding.dtype).name)
        loss_sum = _fused_loss(hidden, unembedding, targets, mask, float(z_loss), plan)
    else:
        chunk = chunk or seq_chunk(s, unembedding.shape[-1])
        form = form or choose_unembedding_form(mesh=mesh)
        loss_sum = _chunked_loss(hidden, unembedding, targets, mask, chunk, form, float(z_loss))
    return loss_sum, mask.sum()


def _chunks(a: jax.Array, chunk: int) -> jax.Array:
    """[b, s, ...] -> [n, b, chunk, ...], the sequence padded with zeros to n * chunk."""
    b, s = a.shape[:2]
    n = -(-s // chunk)
    a = jnp.pad(a, [(0, 0), (0, n * chunk - s)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape((b, n, chunk) + a.shape[2:]), 1, 0)


def _unchunk(a: jax.Array, s: int) -> jax.Array:
    """[n, b, chunk, ...] -> [b, s, ...]."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape((a.shape[0], -1) + a.shape[3:])[:, :s]


def _logits(h, u, form):
    """h [b, c, d], u [d, V] (same dtype) -> [b, c, V] float32."""
    if form == "einsum":
        logits = jnp.einsum("bcd,dv->bcv", h, u, preferred_element_type=jnp.float32)
    else:
        b, c, d = h.shape
        logits = jnp.dot(h.reshape(b * c, d), u, preferred_element_type=jnp.float32).reshape(b, c, -1)
    return constrain(logits, ("batch", "seq", "act_vocab"))


def _chunk_grads(h, u, dlogits, form):
    """d hidden [b, c, d] (h's dtype) and d unembedding [d, V] float32 of sum(dlogits * logits)."""
    if form == "einsum":
        dh = jnp.einsum("bcv,dv->bcd", dlogits, u, preferred_element_type=jnp.float32)
        du = jnp.einsum("bcd,bcv->dv", h, dlogits, preferred_element_type=jnp.float32)
    else:
        b, c, d = h.shape
        flat = dlogits.reshape(b * c, -1)
        dh = jnp.dot(flat, u.T, preferred_element_type=jnp.float32).reshape(b, c, d)
        du = jnp.dot(h.reshape(b * c, d).T, flat, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), du


def _token_losses(logits, targets, z_loss):
    """(unmasked token losses [b, c] with z-loss, log-partition [b, c]) of logits [b, c, V] float32."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit + z_loss * jnp.square(log_z), log_z


def _scan(hidden, unembedding, targets, mask, chunk, form, z_loss, with_grads):
    """Loss sum, and with_grads: (unmasked token losses [b, s], d hidden [b, s, d], d unembedding [d, V]),
    the gradients of the loss sum."""
    s = hidden.shape[1]
    u = unembedding.astype(hidden.dtype)
    xs = (_chunks(hidden, chunk), _chunks(targets, chunk), _chunks(mask, chunk))

    def body(du, chunk_xs):
        h, t, m = chunk_xs
        logits = _logits(h, u, form)
        losses, log_z = _token_losses(logits, t, z_loss)
        if not with_grads:
            return du, losses * m
        probs = jnp.exp(logits - log_z[..., None]) * (1.0 + 2.0 * z_loss * log_z)[..., None]
        onehot = jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
        dlogits = ((probs - onehot) * m[..., None]).astype(h.dtype)
        dh, du_chunk = _chunk_grads(h, u, dlogits, form)
        return du + du_chunk, (losses * m, losses, dh)

    du0 = jnp.zeros(unembedding.shape, jnp.float32) if with_grads else None
    du, per_chunk = jax.lax.scan(body, du0, xs)
    if not with_grads:
        return _unchunk(per_chunk, s).sum()
    masked, losses, dh = (_unchunk(a, s) for a in per_chunk)
    return masked.sum(), (losses, dh, du.astype(unembedding.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_loss(hidden, unembedding, targets, mask, chunk, form, z_loss):
    return _scan(hidden, unembedding, targets, mask, chunk, form, z_loss, with_grads=False)


def _chunked_loss_fwd(hidden, unembedding, targets, mask, chunk, form, z_loss):
    total, saved = _scan(hidden, unembedding, targets, mask, chunk, form, z_loss, with_grads=True)
    return total, saved


def _chunked_loss_bwd(chunk, form, z_loss, saved, g):
    losses, dh, du = saved
    # d/d mask of sum(losses * mask) is the unmasked token loss; targets are integers (no cotangent).
    return g.astype(dh.dtype) * dh, g.astype(du.dtype) * du, None, g * losses


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)


# ------------------------------------------------------------------------------------------------------
# The fused path: kernels/fused_ce.py per device, in a shard_map when traced under a mesh of > 1 device.
# ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _FusedPlan:
    """How the fused loss is split over the mesh (empty tuples: no shard_map, one device).

    batch: mesh axes of the batch dimension; vocab: of the vocabulary (the kernel then sees a shard of
    it and the per-token statistics are combined across it); scatter: batch axes over which d(unembedding)
    is reduce-scattered along d (the parameter's `embed` sharding), the other batch axes are summed."""

    batch: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    scatter: tuple[str, ...] = ()
    tiles: fused_ce.Tiles | None = None
    sharded: bool = False
    grad_dtype: str = "float32"  # the unembedding's dtype, its gradient's


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _fused_plan(mesh, batch: int, unembedding_shape, tiles) -> _FusedPlan | None:
    """The plan for `mesh` (None: no mesh), or None when the shapes do not split evenly over it (the
    caller then takes the chunked path, which GSPMD partitions)."""
    if mesh is None or int(mesh.size) == 1:
        return _FusedPlan(tiles=tiles)
    sizes = dict(mesh.shape)
    size = lambda axes: math.prod(sizes.get(a, 1) for a in axes)  # noqa: E731
    batch_axes = tuple(a for a in _axes(logical_to_mesh(("batch",))[0]) if a in sizes)
    vocab_axes = tuple(a for a in _axes(logical_to_mesh(("vocab",))[0])
                       if sizes.get(a, 1) > 1 and a not in batch_axes)
    scatter = tuple(a for a in _axes(logical_to_mesh(("embed",))[0]) if a in batch_axes and sizes[a] > 1)
    d, vocab = unembedding_shape
    if batch % size(batch_axes) or vocab % size(vocab_axes):
        return None
    if d % size(scatter):
        scatter = ()
    return _FusedPlan(batch_axes, vocab_axes, scatter, tiles, sharded=True)


def _local_stats(hidden, u, targets, plan):
    """Per device: (lse [b, s], target logit [b, s]) over the whole vocabulary; u is a vocab shard."""
    b, s, d = hidden.shape
    offset = jax.lax.axis_index(plan.vocab) * u.shape[1] if plan.vocab else 0
    lse, picked = fused_ce.token_stats(hidden.reshape(b * s, d), u, (targets - offset).reshape(-1),
                                       tiles=plan.tiles)
    if plan.vocab:
        top = jax.lax.pmax(lse, plan.vocab)
        lse = top + jnp.log(jax.lax.psum(jnp.exp(lse - top), plan.vocab))
        picked = jax.lax.psum(picked, plan.vocab)
    return lse.reshape(b, s), picked.reshape(b, s)


def _local_grads(hidden, u, targets, lse, a, c, plan):
    """Per device: (d hidden [b, s, d] in hidden's dtype, d u [d / scatter, V / vocab] float32)."""
    b, s, d = hidden.shape
    offset = jax.lax.axis_index(plan.vocab) * u.shape[1] if plan.vocab else 0
    flat = lambda x: x.reshape(-1)  # noqa: E731
    dh, du = fused_ce.token_grads(hidden.reshape(b * s, d), u, flat(targets - offset), flat(lse), flat(a),
                                  flat(c), tiles=plan.tiles)
    if plan.vocab:
        dh = jax.lax.psum(dh, plan.vocab)
    summed = tuple(axis for axis in plan.batch if axis not in plan.scatter)
    if summed:
        du = jax.lax.psum(du, summed)
    if plan.scatter:
        du = jax.lax.psum_scatter(du, plan.scatter, scatter_dimension=0, tiled=True)
    return dh.reshape(b, s, d).astype(hidden.dtype), du


def _per_device(fn, plan, in_specs, out_specs):
    """fn itself without a mesh, else fn in a shard_map over the traced mesh."""
    if not plan.sharded:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _specs(plan):
    P = jax.sharding.PartitionSpec
    token = P(plan.batch or None, None)
    return token, P(plan.batch or None, None, None), P(None, plan.vocab or None)


def _fused_stats(hidden, u, targets, plan):
    token, rows, columns = _specs(plan)
    fn = functools.partial(_local_stats, plan=plan)
    return _per_device(fn, plan, (rows, columns, token), (token, token))(hidden, u, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_loss(hidden, unembedding, targets, mask, z_loss, plan):
    return _fused_loss_fwd(hidden, unembedding, targets, mask, z_loss, plan)[0]


def _fused_loss_fwd(hidden, unembedding, targets, mask, z_loss, plan):
    u = unembedding.astype(hidden.dtype)  # cast before the shard_map gathers it
    lse, picked = _fused_stats(hidden, u, targets, plan)
    losses = lse - picked + z_loss * jnp.square(lse)
    return (losses * mask).sum(), (hidden, u, targets, mask, lse, losses)


def _fused_loss_bwd(z_loss, plan, saved, g):
    hidden, u, targets, mask, lse, losses = saved
    c = g * mask  # d loss / d target logit = -c; d loss / d logits = a * softmax
    a = c * (1.0 + 2.0 * z_loss * lse)
    token, rows, columns = _specs(plan)
    du_spec = jax.sharding.PartitionSpec(plan.scatter or None, plan.vocab or None)
    fn = functools.partial(_local_grads, plan=plan)
    dh, du = _per_device(fn, plan, (rows, columns, token, token, token, token), (rows, du_spec))(
        hidden, u, targets, lse, a, c)
    return dh, du.astype(plan.grad_dtype), None, g * losses


_fused_loss.defvjp(_fused_loss_fwd, _fused_loss_bwd)

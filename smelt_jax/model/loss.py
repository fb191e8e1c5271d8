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

`cross_entropy(logits, targets, mask)` is the unfused definition (tests and callers that hold logits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from smelt_jax.kernels.backend import choose_unembedding_form
from smelt_jax.parallel.sharding import constrain, current_mesh

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
                          *, chunk: int | None = None, form: str | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token losses, number of masked tokens) of logits = hidden @ unembedding.

    hidden [b, s, d] in the compute dtype; unembedding [d, V] (cast to hidden's dtype for the matmuls);
    targets [b, s] int; mask [b, s] float (1 = counted). chunk: positions per chunk (None: `seq_chunk`);
    form: 'einsum' or 'matmul' (None: `choose_unembedding_form` for the platform traced for).
    """
    b, s, _ = hidden.shape
    chunk = chunk or seq_chunk(s, unembedding.shape[-1])
    form = form or choose_unembedding_form(mesh=current_mesh())
    mask = mask.astype(jnp.float32)
    loss_sum = _chunked_loss(hidden, unembedding, targets.astype(jnp.int32), mask, chunk, form)
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


def _token_losses(logits, targets):
    """(unmasked token losses [b, c], log-partition [b, c]) of logits [b, c, V] float32."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def _scan(hidden, unembedding, targets, mask, chunk, form, with_grads):
    """Loss sum, and with_grads: (unmasked token losses [b, s], d hidden [b, s, d], d unembedding [d, V]),
    the gradients of the loss sum."""
    s = hidden.shape[1]
    u = unembedding.astype(hidden.dtype)
    xs = (_chunks(hidden, chunk), _chunks(targets, chunk), _chunks(mask, chunk))

    def body(du, chunk_xs):
        h, t, m = chunk_xs
        logits = _logits(h, u, form)
        losses, log_z = _token_losses(logits, t)
        if not with_grads:
            return du, losses * m
        probs = jnp.exp(logits - log_z[..., None])
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_loss(hidden, unembedding, targets, mask, chunk, form):
    return _scan(hidden, unembedding, targets, mask, chunk, form, with_grads=False)


def _chunked_loss_fwd(hidden, unembedding, targets, mask, chunk, form):
    total, saved = _scan(hidden, unembedding, targets, mask, chunk, form, with_grads=True)
    return total, saved


def _chunked_loss_bwd(chunk, form, saved, g):
    losses, dh, du = saved
    # d/d mask of sum(losses * mask) is the unmasked token loss; targets are integers (no cotangent).
    return g.astype(dh.dtype) * dh, g.astype(du.dtype) * du, None, g * losses


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)

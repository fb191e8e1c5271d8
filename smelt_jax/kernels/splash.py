"""Causal, segment-aware block-sparse attention on TPU: JAX's Pallas splash attention.

    splash_attention_head_major(q [b, heads, s, hd], k, v [b, kv_heads, s, hd], segment_ids [b, s]) -> [b, heads, s, hd]
    splash_attention(q [b, s, heads, hd], k, v [b, s, kv_heads, hd], segment_ids [b, s]) -> [b, s, heads, hd]

The same function as `model.attention.dot_product_attention` with the segment-causal mask of a full
forward (a query sees the keys of its own document at or before it), which stays the CPU path and the
test oracle (tests/test_attention_splash.py). Which one runs is decided by
`kernels.backend.choose_attention_backend`.

- GQA: splash's multi-head kernel takes k and v with fewer heads ([kv_heads, s, hd]) and maps query head
  h to KV head h // (heads / kv_heads) in its index maps, the model's grouping (query heads of a group
  are adjacent): K/V are read once per group, never copied per query head, and the backward kernel
  accumulates dk/dv of a KV head over its group's query heads in VMEM (its grid runs a group's heads
  consecutively) and writes them once ([kv_heads, s, hd]): no sum over the group outside it.
- The layer calls the head-major form (`splash_attention_head_major`, the kernel's own layout: its
  projections write [b, heads, s, hd], so no transposes around the kernel); `splash_attention` is the
  same in the sequence-major layout of the reference (tests).
- The static mask is causal, so the kernel skips every (query block, key block) pair above the diagonal:
  of the nb x nb pairs per head (nb = s / block) it runs nb (nb + 1) / 2. Segment ids are a dynamic
  mask applied inside the blocks it runs: packed documents skip nothing more (`kernel_flops`).
- Softmax statistics (running max, denominator, logsumexp) are float32 inside the kernel, whatever the
  input dtype; the scores are computed with float32 accumulation, as in the reference.
- Mosaic kernels cannot be partitioned by GSPMD: under a mesh the call runs in a `shard_map`, batch split
  as the activations are (the `batch` rule) and heads over `tensor` when both head counts divide.
- The backward's residuals are named `RESIDUALS_NAME` (`checkpoint_name`): remat policies that keep
  dots keep them too, so the forward kernel runs once per step (`model.layer.REMAT_POLICIES`).
- Off TPU the kernel runs in Pallas interpret mode (slow: tests only); whether it does is read from the
  compile target (`kernels.backend.pallas_interpret`), so an ahead-of-time TPU compile gets Mosaic.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from smelt_jax.parallel import sharding
from smelt_jax.platform.errors import UsageError
from smelt_jax.kernels.backend import SPLASH_SEQ_MULTIPLE, pallas_interpret

BLOCKS = (512, 256, 128)  # the largest that divides the row length is used (one size for every block)
KERNEL_PREFIX = "splash_"  # splash's pallas_call names: splash_{mha,mqa}_{fwd,dq,dkv}...
RESIDUALS_NAME = "splash_residuals"  # checkpoint_name of what the backward kernel reads (remat policies)


def block_size(seq_len: int) -> int:
    """The square block (queries x keys) for rows of `seq_len`: the largest of BLOCKS dividing it."""
    for block in BLOCKS:
        if seq_len % block == 0:
            return block
    raise UsageError(f"splash attention needs a row length that is a multiple of {SPLASH_SEQ_MULTIPLE}, "
                     f"got {seq_len}")


def _kernel(heads: int, seq_len: int, interpret: bool):
    """The splash kernel for [heads, seq_len, hd] queries: causal mask, square blocks, forward and
    fused backward. Built where it is traced, not cached: its mask tables (numpy, lifted by jnp.array)
    then enter the trace as values of it. Built eagerly under a compile-only TPU mesh they would be
    placed on its devices and fail ("'Executable' object has no attribute 'local_devices'"), and a
    cached kernel would hold one trace's values."""
    block = block_size(seq_len)
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((seq_len, seq_len))] * heads)
    # The fused backward kernel computes dq, dk and dv in one pass over the blocks (5 matmuls per block
    # pair) instead of a dq pass (3) and a dkv pass (4), each recomputing the scores.
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              use_fused_bwd_kernel=True)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _local_attention(q, k, v, segment_ids, *, interpret: bool, query_scaled: bool):
    """Per device, head-major: q [b, h, s, hd], k/v [b, kv, s, hd] -> [b, h, s, hd] (q's dtype)."""
    b, heads, s, hd = q.shape
    kernel = _kernel(heads, s, interpret)
    if not query_scaled:  # splash does not scale the scores
        q = (q.astype(jnp.float32) * hd ** -0.5).astype(q.dtype)

    def one_row(q, k, v, seg):  # the kernel's layout [h, s, hd]; k, v keep their kv heads (GQA)
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    return jax.vmap(one_row)(q, k, v, segment_ids.astype(jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention_with_named_residuals(q, k, v, segment_ids, interpret: bool, query_scaled: bool):
    """`_local_attention` whose backward residuals (what the kernel's forward saves: q, k, v, the output
    and its logsumexp) are tagged `checkpoint_name(., RESIDUALS_NAME)`, so a remat policy can keep them
    (`model.layer.REMAT_POLICIES`) instead of running the forward kernel again in the backward pass:
    `checkpoint_dots` alone sees a Pallas call, not a dot, and recomputes it."""
    return _local_attention(q, k, v, segment_ids, interpret=interpret, query_scaled=query_scaled)


def _named_fwd(q, k, v, segment_ids, interpret, query_scaled):
    out, vjp = jax.vjp(lambda q, k, v: _local_attention(q, k, v, segment_ids, interpret=interpret,
                                                        query_scaled=query_scaled), q, k, v)
    return out, (jax.tree.map(lambda r: checkpoint_name(r, RESIDUALS_NAME), vjp), segment_ids)


def _named_bwd(interpret, query_scaled, residuals, grad_out):
    del interpret, query_scaled
    vjp, segment_ids = residuals
    return (*vjp(grad_out), np.zeros(segment_ids.shape, jax.dtypes.float0))


_attention_with_named_residuals.defvjp(_named_fwd, _named_bwd)


def splash_attention_head_major(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                                query_scaled: bool = False, interpret: bool | None = None) -> jax.Array:
    """Segment-causal GQA attention in the kernel's layout: q [b, heads, s, hd], k and v [b, kv_heads,
    s, hd] (heads a multiple of kv_heads; query head h reads KV head h // (heads / kv_heads) through the
    kernel's index maps, and its dk/dv are accumulated per KV head inside the backward kernel: no K/V
    copy per query head, no sum over the group), segment_ids [b, s] (0 = padding: it attends to padding
    only) -> [b, heads, s, hd] in q's dtype. `query_scaled`: q already carries the hd^-0.5 factor (the
    layer folds it into its RoPE). `interpret` None = Mosaic when tracing for a TPU (an ahead-of-time
    compile included), Pallas interpret mode elsewhere (`kernels.backend.pallas_interpret`)."""
    interpret = pallas_interpret(interpret)
    # The output is named too: the next matmul's backward reads it (else the forward kernel reruns for it).
    body = lambda q, k, v, seg: checkpoint_name(  # noqa: E731
        _attention_with_named_residuals(q, k, v, seg, interpret, query_scaled), RESIDUALS_NAME)
    mesh = sharding.current_mesh()
    if mesh is None or mesh.size == 1:
        return body(q, k, v, segment_ids)
    batch = _split(mesh, "batch", (q.shape[0],))
    heads = _split(mesh, "act_heads", (q.shape[1], k.shape[1]))
    qkv_spec, seg_spec = P(batch, heads, None, None), P(batch, None)
    # Pallas kernels declare outputs without varying-manual-axes types, which check_vma rejects.
    return jax.shard_map(body, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_spec),
                         out_specs=qkv_spec, check_vma=False)(q, k, v, segment_ids)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     interpret: bool | None = None) -> jax.Array:
    """`splash_attention_head_major` in the sequence-major layout: q [b, s, heads, hd], k and v
    [b, s, kv_heads, hd] -> [b, s, heads, hd] (q unscaled)."""
    out = splash_attention_head_major(*(x.swapaxes(1, 2) for x in (q, k, v)), segment_ids,
                                      interpret=interpret)
    return out.swapaxes(1, 2)


def _split(mesh, name: str, sizes: tuple[int, ...]) -> tuple[str, ...] | None:
    """The mesh axes the rule for logical axis `name` splits over, when they divide every one of `sizes`
    (else None: replicated, as `fit_spec` does for parameters)."""
    rule = dict(sharding.LOGICAL_AXIS_RULES)[name]
    axes = tuple(a for a in ((rule,) if isinstance(rule, str) else tuple(rule or ())) if mesh.shape[a] > 1)
    ways = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and all(size % ways == 0 for size in sizes) else None


def dense_equivalent_keys(seq_len: int) -> float:
    """Keys per query at which the reference's dense attention (6 matmuls per block pair, forward and
    backward, over all nb^2 pairs) costs what splash executes over rows of `seq_len` (7 per pair over
    nb (nb + 1) / 2 pairs: `kernel_flops`): seq_len x 7 (nb + 1) / (12 nb); 2688 for 4096 keys."""
    nb = seq_len // block_size(seq_len)
    return seq_len * 7 * (nb + 1) / (12 * nb)


def kernel_flops(grid: tuple[int, ...], query_shape: tuple[int, ...], step_flops: float) -> float:
    """Matmul FLOPs one splash kernel (forward, dq or dkv) executes.

    Over forward and backward that is 7 block matmuls per run block pair against the reference's 6 per
    pair of all nb^2 (its backward reuses the saved probabilities): 7 (nb + 1) / (12 nb) of the
    reference, 0.66 at nb = 8 (4096 keys in blocks of 512).

    grid: the pallas_call's grid, rows x nb x nb in some order, rows = the query's leading dimensions
    (vmapped batch x heads; square blocks, one row length for queries and keys: `_kernel`);
    query_shape: [..., heads, seq, hd]; step_flops: the matmul FLOPs of one grid step (its body, from the kernel's
    jaxpr: 2 matmuls forward, 5 for the fused backward, each 2 x block^2 x hd). The causal block mask makes the
    kernel skip the steps above the diagonal (its `block_mask` is 0 there: no compute and no copy), so
    nb (nb + 1) / 2 of the nb^2 steps of a head run; the diagonal blocks run whole (masked inside), and
    segment ids, a dynamic mask, skip nothing.
    """
    rows = math.prod(query_shape[:-2])
    nb = math.isqrt(math.prod(grid) // rows)
    if rows * nb * nb != math.prod(grid):
        raise ValueError(f"splash grid {grid} is not {rows} rows x nb x nb")
    return step_flops * rows * nb * (nb + 1) / 2

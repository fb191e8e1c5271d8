"""Pre-norm decoder layer with a residual-write scale, and stacks of layers run with `lax.scan` or a
Python loop (`loop_over`; `kernels.backend.choose_layer_loop` picks by platform).

dx_attn = Attn(norm(x)) * scale;  dx_moe = MoE(norm(x + dx_attn)) * scale;  x <- x + dx_attn + dx_moe.
scale = 1 / loop_repeats inside the loop span and 1 outside (the paper's SMELT block).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design.config import ModelConfig
from smelt_jax.kernels import splash
from smelt_jax.model.attention import Attention
from smelt_jax.model.moe import MoE
from smelt_jax.model.norm import RMSNorm
from smelt_jax.parallel.sharding import constrain

# Attention probabilities are captured only for rows at most this long ([b, heads, s, keys] each;
# 1024 fits a 4-shot Dyck prompt in bytes).
CAPTURE_ATTENTION_MAX_KEYS = 1024

_policies = jax.checkpoint_policies
_SPLASH_RESIDUALS = _policies.save_only_these_names(splash.RESIDUALS_NAME)
REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the layer in the backward pass
    # Keep the matmul outputs and splash attention's residuals (a Pallas call is not a dot: without its
    # name the backward pass would run the attention forward kernel again).
    "dots": _policies.save_from_both_policies(_policies.checkpoint_dots, _SPLASH_RESIDUALS),
    "dots_no_batch": _policies.save_from_both_policies(_policies.dots_with_no_batch_dims_saveable,
                                                       _SPLASH_RESIDUALS),
}


class Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.attention = Attention(cfg, rngs=rngs)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.moe = MoE(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, context: dict, scale: float, *, cache: dict | None = None,
                 capture: bool = False):
        """x [b, s, d] -> (x', stats, updated cache {'k', 'v'} or None, captures or {}).

        context: 'cos', 'sin' [b, s, hd/2], 'segment_ids' [b, s], 'token_mask' [b, s] bool.
        captures (only with `capture`): 'residual' (x), 'normed_input' (attn_norm(x)) [b, s, d];
        'q' [b, s, heads, hd], 'k', 'v' [b, s, kv_heads, hd], 'pv' [b, s, heads, hd]; 'attn_out'
        [b, s, d] (before the residual scale); 'dx_attn', 'dx_moe' [b, s, d] (after it);
        'topk_ids' [b, s, k]; 'attn_probs' [b, heads, s, keys] when keys <= CAPTURE_ATTENTION_MAX_KEYS.
        """
        keys = x.shape[1] if cache is None else cache["k"].shape[1]
        want_probs = capture and keys <= CAPTURE_ATTENTION_MAX_KEYS
        normed_input = self.attn_norm(x)
        attn_out, new_cache, attention_internals = self.attention(
            normed_input, context["cos"], context["sin"], context["segment_ids"],
            cache=cache, capture=capture, return_probs=want_probs)
        dx_attn = attn_out * jnp.asarray(scale, x.dtype)
        moe_out, stats = self.moe(self.moe_norm(x + dx_attn), context["token_mask"])
        dx_moe = moe_out * jnp.asarray(scale, x.dtype)
        topk_ids = stats.pop("topk_ids")
        captures = {}
        if capture:
            captures = {"residual": x, "dx_attn": dx_attn, "dx_moe": dx_moe, "topk_ids": topk_ids,
                        "normed_input": normed_input, "attn_out": attn_out, **attention_internals}
        x_out = constrain(x + dx_attn + dx_moe, ("batch", "seq", "act_embed"))
        return x_out, stats, new_cache, captures


def make_stack(cfg: ModelConfig, n_layers: int, rngs: nnx.Rngs) -> Layer:
    """`n_layers` layers with parameters stacked on a leading 'layers' axis (one Layer, vmapped)."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(layer_rngs: nnx.Rngs) -> Layer:
        return Layer(cfg, rngs=layer_rngs)

    return create(rngs)


def distinct_scan_lengths(depths: Sequence[int]) -> list[int]:
    """`peel` for each of a decoder's scans in order (`run_stack`): how many leading layers to run
    outside the scan so that no two scans have the same length.

    Why: JAX fills a scan's stacked outputs (the residuals saved for the backward, the per-layer weight
    gradients) into buffers it initialises with zeros, and XLA:TPU's while-initializer-removal turns
    that zero fill into an uninitialised allocation only when the fill has one loop as user. The fills
    of two scans whose stacks have the same shape are merged into one instruction before that pass, so
    every such stack is zero-filled, a write of its whole size per step (SMELT's two visits of its loop:
    200M S97, 31 GB of 671 per device per step; docs/performance.md). A length-1 remainder is left alone.
    Measured on a minimal two-scan program for v5p: 10 zero-filled stacks -> 0 with one layer peeled.
    """
    used: set[int] = set()
    peels = []
    for depth in depths:
        peel = 0
        while depth - peel > 1 and depth - peel in used:
            peel += 1
        used.add(depth - peel)
        peels.append(peel)
    return peels


def run_stack(stack: Layer, x: jax.Array, context: dict, scale: float, *,
              caches: dict | None = None, shared_cache: dict | None = None, capture: bool = False,
              remat: str = "none", loop: str = "scan", peel: int = 0):
    """Run a stacked Layer over its leading axis: `loop` 'scan' (one compiled body for any depth) or
    'unrolled' (a Python loop over the layers; `loop_over`). With a scan, the first `peel` layers run
    unrolled before it (`distinct_scan_lengths`); the outputs are the same.

    caches: per-layer {'k', 'v'} stacked [n, ...] or None; shared_cache: 'segment_ids', 'index'
    (the same for every layer). Returns (x, stats stacked [n, ...], caches or None, captures
    stacked [n, ...]).
    """
    graphdef, params = nnx.split(stack)

    def body(carry, per_layer):
        layer_params, layer_cache = per_layer
        layer = nnx.merge(graphdef, layer_params)
        if layer_cache is not None:
            layer_cache = {**layer_cache, **shared_cache}
        carry, stats, new_cache, captures = layer(carry, context, scale, cache=layer_cache,
                                                  capture=capture)
        return carry, (stats, new_cache, captures)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    depth = jax.tree.leaves(params)[0].shape[0]
    xs = (params, caches)
    if loop == "scan" and 0 < peel < depth:
        x, head = loop_over(body, x, jax.tree.map(lambda a: a[:peel], xs), length=peel, loop="unrolled")
        x, tail = loop_over(body, x, jax.tree.map(lambda a: a[peel:], xs), length=depth - peel, loop=loop)
        stats, new_caches, captures = jax.tree.map(lambda h, t: jnp.concatenate([h, t]), head, tail)
    else:
        x, (stats, new_caches, captures) = loop_over(body, x, xs, length=depth, loop=loop)
    return x, stats, new_caches, captures


def loop_over(body, carry, xs, *, length: int, loop: str):
    """`lax.scan(body, carry, xs, length=length)`, or the same with a Python loop when `loop` is
    'unrolled': each step gets xs[i] (a static slice) and the per-step outputs are stacked at the end, so
    no stacked residual buffer is filled step by step (the CPU's choice: kernels/backend.py). Both give
    the same numbers (tests/test_model_decoder.py)."""
    if loop == "scan":
        return jax.lax.scan(body, carry, xs, length=length)
    if loop != "unrolled":
        raise ValueError(f"loop {loop!r} is neither 'scan' nor 'unrolled'")
    outputs = []
    for i in range(length):
        carry, out = body(carry, jax.tree.map(lambda a, i=i: a[i], xs))
        outputs.append(out)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *outputs)

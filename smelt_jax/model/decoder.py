"""The decoder: embedding, prefix stack, looped stack (run loop_repeats times, same weights),
suffix stack, final RMSNorm, untied unembedding.

Each stack is one vmapped Layer iterated over its depth: a scan on TPU and GPU, so compile time does not
depend on depth, and a Python loop on CPU (`Decoder.layer_loop`, kernels/backend.py). The loop's visits
(loop_repeats, 2-4) are a Python loop in training, each visit its own scan over the looped layers: a scan
of visits around the layer scan would stack each visit's saved activations a second time ([visits,
layers, ...] filled from [layers, ...]: every residual written and read twice; with the router's
one-hot, the 100M S95 SMELT program's residual stacks fell 121.4 -> 59.2 GB: docs/performance.md).
Decoding with a cache keeps the visits a scan of the layer loop's kind. In training no two scans have
the same length: a later visit (and a suffix as long as the prefix) runs its first layers unrolled
(`layer.distinct_scan_lengths`), because XLA:TPU zero-fills the saved-activation stacks of scans of
equal length instead of allocating them (200M S97 SMELT: 51.6 GB of 670.7 walked per device per step;
docs/performance.md).
Inside the loop both residual writes are scaled by 1/loop_repeats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design.config import REMAT_POLICIES, ModelConfig
from smelt_jax.kernels.backend import LAYER_LOOPS, choose_layer_loop
from smelt_jax.model.attention import INIT_STD, truncated_normal
from smelt_jax.model.layer import distinct_scan_lengths, loop_over, make_stack, run_stack
from smelt_jax.model.norm import RMSNorm
from smelt_jax.model.rope import rope_angles
from smelt_jax.parallel.sharding import constrain, current_mesh, param

STACKS = ("prefix", "loop", "suffix")
LOAD_STATS = ("counts", "max_over_mean", "dropped_fraction")


def stack_layers(cfg: ModelConfig) -> dict[str, range]:
    """Physical layers of each stack."""
    return {"prefix": range(cfg.loop_start),
            "loop": range(cfg.loop_start, cfg.loop_end),
            "suffix": range(cfg.loop_end, cfg.n_layers)}


class Decoder(nnx.Module):
    """`Decoder(cfg, rngs=nnx.Rngs(seed), remat=policy, layer_loop=form)`; call with tokens, segment_ids,
    positions [b, s] int32. `remat` (config.REMAT_POLICIES) and `layer_loop` (LAYER_LOOPS) are how the
    layers are executed, not what they compute: the run's layout chooses them
    (descriptors.Parallelism.remat, .layer_loop)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none", layer_loop: str = "auto"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat {remat!r} not in {REMAT_POLICIES}")
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop {layer_loop!r} not in {LAYER_LOOPS}")
        self.cfg = cfg
        self.remat = remat
        dtype = jnp.dtype(cfg.param_dtype)
        self.embedding = param(truncated_normal(rngs, (cfg.vocab, cfg.d_model), INIT_STD, dtype),
                               ("vocab", "embed"))
        for name, layers in stack_layers(cfg).items():
            setattr(self, name, make_stack(cfg, len(layers), rngs) if len(layers) else None)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.unembedding = param(truncated_normal(rngs, (cfg.d_model, cfg.vocab), INIT_STD, dtype),
                                 ("embed", "vocab"))
        # How the stacks and the loop's visits are iterated (kernels.backend.LAYER_LOOPS): 'auto' is a
        # scan on TPU/GPU and a Python loop on CPU. Both give the same numbers; XLA's cost analysis counts
        # a while body once, so the FLOP test asks for 'unrolled'. The run's layout chooses it
        # (descriptors.Parallelism.layer_loop; the layout search compiles both on TPU: compile/loop_form.py).
        self.layer_loop = layer_loop

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array, *,
                 capture: bool = False):
        """-> (logits [b, s, vocab] float32, aux).

        aux: 'load_balance_loss', 'router_z_loss' (means over executed layers, unweighted),
        'expert_load' {'counts' [L_exec, E], 'max_over_mean' [L_exec], 'dropped_fraction'
        [L_exec]} in `cfg.execution_order()`, and with capture=True 'captures'
        {(physical layer, visit): {'residual', 'dx_attn', 'dx_moe' [b, s, d], 'topk_ids'
        [b, s, k], 'attn_probs' [b, heads, s, s] (rows up to CAPTURE_ATTENTION_MAX_KEYS = 1024)}}.
        Segment id 0 marks padding: it attends only to padding and is left out of the router
        losses and load statistics.
        """
        logits, aux, _ = self.forward(tokens, segment_ids, positions, capture=capture)
        return logits, aux

    def features(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array):
        """-> (final-normed hidden [b, s, d] in the compute dtype, aux): everything but the unembedding,
        for the fused chunked loss (model/loss.py), which multiplies by `self.unembedding` itself."""
        hidden, aux, _ = self._trunk(tokens, segment_ids, positions)
        return hidden, aux

    def forward(self, tokens, segment_ids, positions, *, cache: dict | None = None,
                capture: bool = False):
        """The forward pass, optionally reading and extending a KV cache (see model/decode.py).

        Returns (logits, aux, updated cache or None).
        """
        x, aux, new_cache = self._trunk(tokens, segment_ids, positions, cache=cache, capture=capture)
        logits = jnp.einsum("bsd,dv->bsv", x, self.unembedding[...].astype(x.dtype),
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "act_vocab")), aux, new_cache

    def _trunk(self, tokens, segment_ids, positions, *, cache: dict | None = None, capture: bool = False):
        """Embedding, stacks and final norm: (hidden [b, s, d] compute dtype, aux, cache or None)."""
        cfg = self.cfg
        _check_inputs(tokens, segment_ids, positions)
        compute = jnp.dtype(cfg.compute_dtype)
        with jax.named_scope("embedding"):
            x = jnp.take(self.embedding[...], tokens, axis=0).astype(compute)
        x = constrain(x, ("batch", "seq", "act_embed"))
        cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
        context = {"cos": cos, "sin": sin, "segment_ids": segment_ids,
                   "token_mask": segment_ids > 0}
        shared_cache = None
        if cache is not None:
            index = cache["index"]
            segments = jax.lax.dynamic_update_slice(cache["segment_ids"],
                                                    segment_ids.astype(jnp.int32), (0, index))
            shared_cache = {"segment_ids": segments, "index": index}
        loop = choose_layer_loop(self.layer_loop, mesh=current_mesh())
        run = {"shared_cache": shared_cache, "capture": capture, "remat": self.remat, "loop": loop}
        stats, captures, new_cache = {}, {}, {}
        peels = iter(self._peels(training=cache is None))
        if self.prefix is not None:
            x, stats["prefix"], new_cache["prefix"], captures["prefix"] = run_stack(
                self.prefix, x, context, 1.0, caches=_get(cache, "prefix"), peel=next(peels), **run)
        if self.loop is not None:
            scale = 1.0 / cfg.loop_repeats

            def visit(carry, visit_cache):
                carry, visit_stats, visit_new_cache, visit_captures = run_stack(
                    self.loop, carry, context, scale, caches=visit_cache, peel=next(peels), **run)
                return carry, (visit_stats, visit_new_cache, visit_captures)

            x, (stats["loop"], new_cache["loop"], captures["loop"]) = loop_over(
                visit, x, _get(cache, "loop"), length=cfg.loop_repeats,
                loop=loop if cache is not None else "unrolled")
        if self.suffix is not None:
            x, stats["suffix"], new_cache["suffix"], captures["suffix"] = run_stack(
                self.suffix, x, context, 1.0, caches=_get(cache, "suffix"), peel=next(peels), **run)
        x = self.final_norm(x)
        aux = _aux(cfg, stats)
        if capture:
            aux["captures"] = _key_captures(cfg, captures)
        if cache is not None:
            new_cache = {**new_cache, "segment_ids": shared_cache["segment_ids"],
                         "index": cache["index"] + tokens.shape[1]}
        else:
            new_cache = None
        return x, aux, new_cache


    def _peels(self, training: bool) -> list[int]:
        """Layers each scan runs unrolled first, in call order (prefix, each visit, suffix): distinct
        scan lengths in training (`layer.distinct_scan_lengths`); none when decoding, whose visits
        are one scan (the peel of its single visit body, traced once, is 0)."""
        depths = [len(layers) for name, layers in stack_layers(self.cfg).items() if len(layers)
                  for _ in range(self.cfg.loop_repeats if name == "loop" else 1)]
        return distinct_scan_lengths(depths) if training else [0] * len(depths)


def _get(cache: dict | None, name: str):
    return None if cache is None else cache[name]


def _check_inputs(tokens, segment_ids, positions) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    for label, array in (("segment_ids", segment_ids), ("positions", positions)):
        if array.shape != tokens.shape:
            raise ValueError(f"{label} shape {array.shape} != tokens shape {tokens.shape}")
    for label, array in (("tokens", tokens), ("segment_ids", segment_ids), ("positions", positions)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{label} must be integers, got {array.dtype}")


def _in_execution_order(cfg: ModelConfig, per_stack: dict) -> list:
    """Stacked per-layer pytrees -> one pytree with a leading executed-layer axis."""
    parts = []
    if "prefix" in per_stack:
        parts.append(per_stack["prefix"])
    if "loop" in per_stack:  # [visits, layers, ...] -> [visits * layers, ...], visit-major
        parts.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), per_stack["loop"]))
    if "suffix" in per_stack:
        parts.append(per_stack["suffix"])
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts)


def _aux(cfg: ModelConfig, stats: dict) -> dict:
    ordered = _in_execution_order(cfg, stats)
    return {
        "load_balance_loss": jnp.mean(ordered["load_balance_loss"]),
        "router_z_loss": jnp.mean(ordered["router_z_loss"]),
        "expert_load": {name: ordered[name] for name in LOAD_STATS},
    }


def _key_captures(cfg: ModelConfig, captures: dict) -> dict:
    """{(physical layer, visit): {...}} from the per-stack stacked captures."""
    keyed = {}
    for name, layers in stack_layers(cfg).items():
        if name not in captures:
            continue
        for j, layer in enumerate(layers):
            if name == "loop":
                for v in range(cfg.loop_repeats):
                    keyed[(layer, v)] = jax.tree.map(lambda a, v=v, j=j: a[v, j], captures[name])
            else:
                keyed[(layer, 0)] = jax.tree.map(lambda a, j=j: a[j], captures[name])
    return keyed

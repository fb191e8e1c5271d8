"""The loss, the optimizer and the train/eval steps: plain functions of (params, opt_state, batch).

`params` is the model's `nnx.State` (a pytree of arrays); the model is rebuilt from its graph
definition inside the step, so the step is a pure function that `jax.jit` can shard.

Loss = masked next-token cross-entropy (mean over target tokens; `model.loss.unembed_cross_entropy`)
       + load_balance_weight * Switch load-balance loss + router_z_weight * router z-loss.
AdamW is decoupled weight decay on everything but the RMSNorm scales, with global-norm clipping;
the learning rate is an argument of the step (a pure function of the step, `train.lr`), so a decay
branch restored from the stable run's optimizer state needs no schedule inside that state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.model.loss import unembed_cross_entropy

Batch = dict[str, jax.Array]  # tokens, targets, segment_ids, positions int32 [b, s]; loss_mask f32


def decay_mask(params: Any) -> Any:
    """True for parameters that take weight decay: all but norm scales (1 per channel)."""
    def decays(path, _leaf) -> bool:
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        return not any("norm" in name for name in names)
    return jax.tree_util.tree_map_with_path(decays, params)


def optimizer(schedule: Schedule) -> optax.GradientTransformation:
    """Clip, Adam moments, decoupled weight decay; the caller scales by -lr."""
    return optax.chain(
        optax.clip_by_global_norm(schedule.grad_clip),
        optax.scale_by_adam(b1=schedule.adam_b1, b2=schedule.adam_b2, eps=schedule.adam_eps),
        optax.add_decayed_weights(schedule.weight_decay, mask=decay_mask),
    )


def _token_loss(model, batch: Batch):
    """(sum of masked token losses, token count, aux): the model's trunk, then the fused chunked
    unembedding + cross-entropy (model/loss.py; the float32 logits are never whole)."""
    hidden, aux = model.features(batch["tokens"], batch["segment_ids"], batch["positions"])
    loss_sum, count = unembed_cross_entropy(hidden, model.unembedding[...], batch["targets"],
                                            batch["loss_mask"])
    return loss_sum, count, aux


def loss_fn(params: nnx.State, graphdef: nnx.GraphDef, cfg: ModelConfig, batch: Batch):
    loss_sum, count, aux = _token_loss(nnx.merge(graphdef, params), batch)
    ce = loss_sum / jnp.maximum(count, 1.0)
    total = (ce + cfg.load_balance_weight * aux["load_balance_loss"]
             + cfg.router_z_weight * aux["router_z_loss"])
    load = aux["expert_load"]
    metrics = {"loss": total, "ce": ce, "load_balance_loss": aux["load_balance_loss"],
               "router_z_loss": aux["router_z_loss"], "tokens": count,
               "expert_max_over_mean": jnp.mean(load["max_over_mean"]),
               "expert_dropped_fraction": jnp.mean(load["dropped_fraction"])}
    return total, metrics


def make_train_step(graphdef: nnx.GraphDef, cfg: ModelConfig, tx: optax.GradientTransformation):
    """-> train_step(params, opt_state, batch, lr) -> (params, opt_state, metrics)."""
    def train_step(params, opt_state, batch: Batch, lr: jax.Array):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(params, graphdef, cfg, batch)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
            params = optax.apply_updates(params, updates)
        metrics = {**metrics, "grad_norm": optax.global_norm(grads), "lr": lr}
        return params, opt_state, metrics
    return train_step


def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig):
    """-> eval_step(params, batch) -> (sum of token losses, token count)."""
    def eval_step(params, batch: Batch):
        loss_sum, count, _ = _token_loss(nnx.merge(graphdef, params), batch)
        return loss_sum, count
    return eval_step


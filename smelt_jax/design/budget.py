"""Budget accounting: parameters, FLOPs and KV cache of a `ModelConfig`, as pure functions.

Conventions (docs/budget.md says why):
- Non-embedding parameters count attention (Q, K, V, O; no biases), both RMSNorm scales of every
  layer, the router, the experts (SwiGLU: gate, up, down) and the final norm. The embedding and the
  untied unembedding are reported apart (`params_embedding`).
- *Active* parameters are one traversal of the physical layers with `top_k` experts: a looped block
  is counted once. *Executed* parameters count every executed layer, a looped block `loop_repeats`
  times; they are what one token's forward pass multiplies by.
- Training FLOPs per token = 6 * executed params + 12 * executed layers * q_width * attended keys.
  The second term is QK^T and PV (2 + 2 FLOPs per key and query channel forward, x3 for training) at
  a stated mean number of attended keys per query (`ATTENDED_KEYS`, the paper's mean document length
  in packed 4096-token rows). Embedding and unembedding FLOPs are excluded, as the paper does.
- KV cache per token = one K and one V vector (`kv_width` entries each) per executed layer.
"""

from __future__ import annotations

import dataclasses

from smelt_jax.design.config import ModelConfig
from smelt_jax.platform.errors import UsageError

# Mean keys attended per query in the paper's packed 4096-token contexts (derived: reproduces the
# paper's worked example F = 1.33e9 / 1.37e9 at 200M, S~95%; see docs/budget.md).
ATTENDED_KEYS = 400.0
# SwiGLU: gate, up and down projections.
EXPERT_MATRICES = 3


def attention_params(cfg: ModelConfig) -> int:
    """Q and O ([d_model, q_width] each) plus K and V ([d_model, kv_width] each)."""
    return 2 * cfg.d_model * cfg.q_width + 2 * cfg.d_model * cfg.kv_width


def expert_params(cfg: ModelConfig) -> int:
    """One SwiGLU expert: W_gate, W_up [d_model, expert_ffn] and W_down [expert_ffn, d_model]."""
    return EXPERT_MATRICES * cfg.d_model * cfg.expert_ffn


def router_params(cfg: ModelConfig) -> int:
    return cfg.d_model * cfg.n_experts


def norm_params_per_layer(cfg: ModelConfig) -> int:
    return 2 * cfg.d_model


def layer_params(cfg: ModelConfig, experts: int) -> int:
    """Parameters of one decoder layer that a token touches when `experts` experts are counted."""
    return (attention_params(cfg) + norm_params_per_layer(cfg) + router_params(cfg)
            + experts * expert_params(cfg))


def params_total(cfg: ModelConfig) -> int:
    """All non-embedding parameters (physical layers, every expert, final norm)."""
    return cfg.n_layers * layer_params(cfg, cfg.n_experts) + cfg.d_model


def params_active(cfg: ModelConfig) -> int:
    """Non-embedding parameters of one traversal with top_k experts; a looped block counted once."""
    return cfg.n_layers * layer_params(cfg, cfg.top_k) + cfg.d_model


def params_executed(cfg: ModelConfig) -> int:
    """Non-embedding parameters multiplied per token: every executed layer with top_k experts."""
    return cfg.executed_layers * layer_params(cfg, cfg.top_k) + cfg.d_model


def params_embedding(cfg: ModelConfig) -> int:
    """Input embedding plus untied unembedding, [vocab, d_model] each."""
    return 2 * cfg.vocab * cfg.d_model


def attention_flops_forward(cfg: ModelConfig, attended_keys: float = ATTENDED_KEYS) -> float:
    """QK^T and PV per token over all executed layers: 4 * q_width * keys per layer."""
    return 4.0 * cfg.executed_layers * cfg.q_width * attended_keys


def forward_flops_per_token(cfg: ModelConfig, attended_keys: float = ATTENDED_KEYS,
                            include_unembedding: bool = False) -> float:
    flops = 2.0 * params_executed(cfg) + attention_flops_forward(cfg, attended_keys)
    if include_unembedding:
        flops += 2.0 * cfg.vocab * cfg.d_model
    return flops


def train_flops_per_token(cfg: ModelConfig, attended_keys: float = ATTENDED_KEYS,
                          include_unembedding: bool = False) -> float:
    """Forward + backward = 3x forward: 6 N_exec + 12 L_exec q_width keys."""
    return 3.0 * forward_flops_per_token(cfg, attended_keys, include_unembedding)


def kv_per_token(cfg: ModelConfig) -> int:
    """KV-cache entries per token: a K and a V vector of kv_width per executed layer."""
    return 2 * cfg.executed_layers * cfg.kv_width


def compute_equivalent_sparsity(flops: float, params: float, control_flops: float,
                                control_params: float) -> float:
    """S = 1 - (F / F0) * N0 / N against a fully active control with FLOPs F0 and params N0."""
    if min(flops, params, control_flops, control_params) <= 0:
        raise UsageError("FLOPs and parameter counts must be positive")
    return 1.0 - (flops / control_flops) * control_params / params


@dataclasses.dataclass(frozen=True)
class Budget:
    """Every budget of one configuration, as the descriptors and the CLI report it."""

    train_flops_per_token: float
    forward_flops_per_token: float
    params_total: int
    params_active: int
    params_executed: int
    params_embedding: int
    kv_per_token: int
    sparsity: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def budget(cfg: ModelConfig, control: ModelConfig | None = None,
           attended_keys: float = ATTENDED_KEYS) -> Budget:
    """All budgets of `cfg`; with `control`, also its compute-equivalent sparsity."""
    flops = train_flops_per_token(cfg, attended_keys)
    total = params_total(cfg)
    sparsity = None
    if control is not None:
        sparsity = compute_equivalent_sparsity(
            flops, total, train_flops_per_token(control, attended_keys), params_total(control))
    return Budget(
        train_flops_per_token=flops,
        forward_flops_per_token=forward_flops_per_token(cfg, attended_keys),
        params_total=total,
        params_active=params_active(cfg),
        params_executed=params_executed(cfg),
        params_embedding=params_embedding(cfg),
        kv_per_token=kv_per_token(cfg),
        sparsity=sparsity,
    )

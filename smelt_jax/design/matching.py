"""The matcher: find a looped configuration whose budgets equal a reference's.

Looping raises FLOPs per token (more executed layers). The paper's recipe restores the three budgets
by narrowing the hidden size (FLOPs), adding experts (total parameters) and shrinking heads or raising
the GQA ratio (KV cache per token). `match` searches hidden size, expert count, head size, head
count and KV-head count on hardware-friendly grids; for every grid point the expert width is solved
from the parameter budget, so the search is a vectorised sweep over a few hundred thousand
candidates that reuses the budget module's formulas on numpy arrays (one formula, two uses).

Queries span the hidden size (`n_heads * head_dim == d_model`), as in every configuration the paper
reports.
"""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np

from smelt_jax.design import budget as budget_lib
from smelt_jax.design.config import ModelConfig
from smelt_jax.platform.errors import SmeltError


class MatchError(SmeltError, ValueError):
    """No configuration on the grid meets every tolerance; names the budgets and the closest one."""


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Largest accepted relative mismatch per budget (the paper's worst residuals round to these)."""

    flops: float = 0.04
    params: float = 0.01
    kv: float = 0.04


@dataclasses.dataclass(frozen=True)
class SearchGrid:
    """Hardware-friendly grids. Widths are multiples of 8 (TPU sublanes, GPU MMA tiles), head sizes
    multiples of 4 (the paper's SMELT heads are 72, 84 and 88 wide), expert counts multiples of 8
    (expert-parallel axes of 8 devices)."""

    d_model_step: int = 8
    d_model_range: tuple[float, float] = (0.5, 1.6)  # relative to the reference's d_model
    head_dim_step: int = 4
    head_dim_range: tuple[int, int] = (32, 256)
    kv_heads: tuple[int, ...] = (1, 2, 4, 8)
    experts_step: int = 8
    experts_range: tuple[float, float] = (0.5, 4.0)  # relative to the reference's n_experts
    ffn_step: int = 8
    # A relative change of this size in expert_ffn / d_model costs as much as a budget mismatch
    # at its tolerance. None: match the budgets only.
    shape_scale: float | None = 0.1


BUDGET_NAMES = ("flops", "params", "kv")


@dataclasses.dataclass(frozen=True)
class MatchResult:
    config: ModelConfig
    mismatch: dict[str, float]  # relative (candidate / reference - 1) per budget
    candidates: int  # grid points examined

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "mismatch": dict(self.mismatch),
                "candidates": self.candidates}


def _reference_budgets(cfg: ModelConfig) -> dict[str, float]:
    return {"flops": budget_lib.train_flops_per_token(cfg), "params": budget_lib.params_total(cfg),
            "kv": budget_lib.kv_per_token(cfg)}


def _grid(start: int, stop: int, step: int) -> np.ndarray:
    lo = max(step, -(-start // step) * step)
    return np.arange(lo, stop + 1, step)


def _candidate_geometry(reference: ModelConfig, grid: SearchGrid,
                        fixed: dict[str, int]) -> dict[str, np.ndarray]:
    """Every (d_model, n_experts, head_dim, n_kv_heads) grid point, flattened to 1-d arrays."""
    def axis(name: str, values: np.ndarray) -> np.ndarray:
        return np.array([fixed[name]]) if name in fixed else values

    d_models = axis("d_model", _grid(int(grid.d_model_range[0] * reference.d_model),
                                     int(grid.d_model_range[1] * reference.d_model),
                                     grid.d_model_step))
    experts = axis("n_experts", _grid(int(grid.experts_range[0] * reference.n_experts),
                                      int(grid.experts_range[1] * reference.n_experts),
                                      grid.experts_step))
    head_dims = axis("head_dim", _grid(grid.head_dim_range[0], grid.head_dim_range[1],
                                       grid.head_dim_step))
    kv_heads = axis("n_kv_heads", np.array(grid.kv_heads))
    rows = []
    for d_model, head_dim, n_kv in itertools.product(d_models, head_dims, kv_heads):
        if d_model % head_dim or (d_model // head_dim) % n_kv:
            continue
        n_heads = d_model // head_dim
        if "n_heads" in fixed and fixed["n_heads"] != n_heads:
            continue
        rows.append((d_model, head_dim, n_kv, n_heads))
    if not rows:
        raise MatchError("no (d_model, head_dim, n_kv_heads) on the grid lets queries span d_model")
    geometry = np.array(rows, dtype=np.int64)
    count = len(geometry)
    geometry = np.repeat(geometry, len(experts), axis=0)
    n_experts = np.tile(experts, count)
    return {"d_model": geometry[:, 0], "head_dim": geometry[:, 1], "n_kv_heads": geometry[:, 2],
            "n_heads": geometry[:, 3], "n_experts": n_experts.astype(np.int64)}


def _as_arrays(target: ModelConfig, geometry: dict[str, np.ndarray],
               expert_ffn: np.ndarray) -> SimpleNamespace:
    """A duck-typed `ModelConfig` whose geometry fields are arrays, for the budget formulas."""
    n = dict(geometry, expert_ffn=expert_ffn)
    return SimpleNamespace(
        vocab=target.vocab, n_layers=target.n_layers, top_k=target.top_k,
        executed_layers=target.executed_layers, q_width=n["n_heads"] * n["head_dim"],
        kv_width=n["n_kv_heads"] * n["head_dim"], **n)


def _solve_expert_ffn(target: ModelConfig, geometry: dict[str, np.ndarray], params: float,
                      step: int) -> np.ndarray:
    """Expert widths (two grid neighbours per point) that bring total params nearest `params`."""
    unit = _as_arrays(target, geometry, np.ones_like(geometry["d_model"]))
    zero = _as_arrays(target, geometry, np.zeros_like(geometry["d_model"]))
    per_ffn = budget_lib.params_total(unit) - budget_lib.params_total(zero)
    exact = (params - budget_lib.params_total(zero)) / per_ffn
    low = np.maximum(step, np.floor(exact / step) * step).astype(np.int64)
    return np.stack([low, low + step])


def match(reference: ModelConfig, target: ModelConfig, *, fixed: dict[str, int] | None = None,
          tolerances: Tolerances = Tolerances(), grid: SearchGrid = SearchGrid()) -> MatchResult:
    """Geometry for `target` (its depth, loop recipe and top_k kept) matching `reference`'s budgets.

    `fixed` pins any of d_model, n_experts, head_dim, n_kv_heads, n_heads (e.g. the paper's chosen
    hidden sizes and expert counts) and the rest is searched. Among candidates within every tolerance
    the one with the smallest tolerance-normalised squared mismatch wins; ties keep the
    reference's KV-head count, then prefer the larger d_model, larger heads and fewer experts
    (deterministic). Raises `MatchError` naming the budgets no
    candidate meets, with the closest candidate found.
    """
    fixed = dict(fixed or {})
    unknown = set(fixed) - {"d_model", "n_experts", "head_dim", "n_kv_heads", "n_heads"}
    if unknown:
        raise MatchError(f"cannot pin {sorted(unknown)}")
    want = _reference_budgets(reference)
    geometry = _candidate_geometry(reference, grid, fixed)
    ffn_options = _solve_expert_ffn(target, geometry, want["params"], grid.ffn_step)
    geometry = {k: np.concatenate([v, v]) for k, v in geometry.items()}
    expert_ffn = np.concatenate(list(ffn_options))
    arrays = _as_arrays(target, geometry, expert_ffn)
    got = {"flops": budget_lib.train_flops_per_token(arrays),
           "params": budget_lib.params_total(arrays).astype(np.float64),
           "kv": budget_lib.kv_per_token(arrays).astype(np.float64)}
    tol = dataclasses.asdict(tolerances)
    mismatch = {k: got[k] / want[k] - 1.0 for k in BUDGET_NAMES}
    normalised = np.stack([np.abs(mismatch[k]) / tol[k] for k in BUDGET_NAMES])
    # Keep the reference's expert shape (expert_ffn / d_model) where the budgets allow: the paper's
    # recipe narrows the model and adds experts rather than reshaping each expert.
    shape_change = np.log((expert_ffn / geometry["d_model"])
                          / (reference.expert_ffn / reference.d_model))
    score = (normalised ** 2).sum(axis=0)
    if grid.shape_scale is not None:
        score = score + (shape_change / grid.shape_scale) ** 2
    feasible = (normalised <= 1.0).all(axis=0)
    # lexsort: last key is primary. Ties prefer the reference's KV-head count (keeps its GQA
    # sharding), then a wider d_model, then wider (fewer) heads, then fewer experts.
    kv_heads_change = np.abs(geometry["n_kv_heads"] - reference.n_kv_heads)
    order = np.lexsort((geometry["n_experts"], -geometry["head_dim"], -geometry["d_model"],
                        kv_heads_change, score, ~feasible))
    best = int(order[0])
    config = target.replace(**{k: int(geometry[k][best]) for k in
                               ("d_model", "n_experts", "head_dim", "n_kv_heads", "n_heads")},
                            expert_ffn=int(expert_ffn[best]))
    result = MatchResult(config=config, mismatch={k: float(mismatch[k][best]) for k in BUDGET_NAMES},
                         candidates=int(len(score)))
    if not feasible[best]:
        failing = [k for k in BUDGET_NAMES if (np.abs(mismatch[k]) > tol[k] + 1e-12).all()]
        failing = failing or [k for k in BUDGET_NAMES if abs(result.mismatch[k]) > tol[k]]
        closest = ", ".join(f"{k} {result.mismatch[k]:+.2%} (tolerance {tol[k]:.0%})"
                            for k in BUDGET_NAMES)
        raise MatchError(
            f"cannot match the {' and '.join(failing)} budget(s) within tolerance on this grid "
            f"({result.candidates} candidates); closest: d_model={config.d_model}, "
            f"n_experts={config.n_experts}, {config.n_heads}x{config.head_dim} heads, "
            f"{config.n_kv_heads} KV heads, expert_ffn={config.expert_ffn}: {closest}")
    return result


def mismatch(reference: ModelConfig, candidate: ModelConfig) -> dict[str, float]:
    """Relative budget mismatch of `candidate` against `reference` (candidate / reference - 1)."""
    want, got = _reference_budgets(reference), _reference_budgets(candidate)
    return {k: got[k] / want[k] - 1.0 for k in BUDGET_NAMES}

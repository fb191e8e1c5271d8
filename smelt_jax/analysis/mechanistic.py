"""Cross-visit analyses of a looped model's captured internals: routing, residual writes, attention stages.

Pure numpy in, tidy pandas DataFrame out; nothing here knows the model package.

Input layout (shared with `smelt_jax.analysis.attention`). A capture set is a mapping

    captures[(layer, visit)] -> {name: np.ndarray}

keyed by the *physical* layer index (0-based, as in ModelConfig) and the visit (1 for the first execution,
2 for the second; layers outside the looped span, and every layer of a Baseline, have visit 1 only). Every
array of one capture set covers the same held-out tokens in the same order. Array names and shapes:

    topk_ids       [batch, seq, k]            int    expert indices chosen by the router (top-k, distinct)
    dx_attn        [batch, seq, d]            float  the attention write to the residual stream (after 1/r)
    dx_moe         [batch, seq, d]            float  the MoE write (after 1/r)
    normed_input   [batch, seq, d]            float  RMSNorm(x), the attention's input
    q              [batch, seq, heads, hd]    float  queries (after RoPE, if the model applies it there)
    k, v           [batch, seq, kv_heads, hd] float  keys, values
    pv             [batch, seq, heads, hd]    float  attention-weighted values, before the output projection
    attn_out       [batch, seq, d]            float  the attention block's output (= dx_attn * r)
    attn_probs     [batch, heads, q, k]       float  softmax attention probabilities (masked entries 0)

These are the names the model's `capture=True` arrays carry (one vocabulary); the model numbers visits
from 0, and `smelt_jax.analysis.run_analysis.analysis_captures` converts to this layout.

Any leading shape works where a function says "[..., x]": leading axes are flattened into tokens. Padding
is the caller's to drop. The looped layers are those with both visits present.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

Captures = Mapping[tuple[int, int], Mapping[str, np.ndarray]]
ATTENTION_STAGES = ("normed_input", "q", "k", "v", "pv", "attn_out")
_EPS = 1e-12


def looped_layers(captures: Captures) -> list[int]:
    """Physical layers captured at both visit 1 and visit 2, ascending."""
    layers = sorted({layer for layer, visit in captures if visit == 1 and (layer, 2) in captures})
    for layer, visit in captures:
        if visit not in (1, 2):
            raise ValueError(f"visit must be 1 or 2, got {visit} for layer {layer}")
    return layers


def capture_array(captures: Captures, layer: int, visit: int, name: str) -> np.ndarray:
    try:
        return np.asarray(captures[(layer, visit)][name])
    except KeyError as error:
        raise KeyError(f"capture ({layer}, visit {visit}) lacks {name!r}") from error


def require_looped_layers(captures: Captures) -> list[int]:
    layers = looped_layers(captures)
    if not layers:
        raise ValueError("no layer has both visits captured; cross-visit analyses need a looped model")
    return layers


# ---------------------------------------------------------------------------------------------------------
# Routing overlap


def topk_intersection_sizes(topk_a: np.ndarray, topk_b: np.ndarray) -> np.ndarray:
    """|set(a_t) ∩ set(b_t)| for every token t.

    topk_a, topk_b: [..., k] integer indices, distinct within each row. Returns int [...].
    """
    topk_a, topk_b = np.asarray(topk_a), np.asarray(topk_b)
    if topk_a.shape != topk_b.shape or topk_a.ndim < 1:
        raise ValueError(
            f"top-k arrays must have equal shapes [..., k], got {topk_a.shape} and {topk_b.shape}"
        )
    for name, array in (("a", topk_a), ("b", topk_b)):
        ordered = np.sort(array, axis=-1)
        if np.any(ordered[..., 1:] == ordered[..., :-1]):
            raise ValueError(f"top-k array {name} repeats an index within a row")
    return (topk_a[..., :, None] == topk_b[..., None, :]).any(axis=-1).sum(axis=-1)


def random_overlap_reference(k: int, n_experts: int) -> float:
    """Expected |A ∩ B| for two independent uniform k-subsets of n experts: k^2 / n (hypergeometric mean)."""
    if not 1 <= k <= n_experts:
        raise ValueError(f"need 1 <= k <= n_experts, got k={k}, n_experts={n_experts}")
    return k * k / n_experts


def routing_overlap(captures: Captures, n_experts: int) -> pd.DataFrame:
    """Per looped layer: mean |top-k(visit 1) ∩ top-k(visit 2)| over tokens, against the random k^2/n.

    Reads `topk_ids` [batch, seq, k]. Columns: layer, k, n_experts, n_tokens, mean_overlap,
    random_reference, overlap_fraction (= mean_overlap / k).
    """
    rows = []
    for layer in require_looped_layers(captures):
        first, second = (
            capture_array(captures, layer, 1, "topk_ids"),
            capture_array(captures, layer, 2, "topk_ids"),
        )
        if first.size and (
            first.min() < 0 or max(first.max(), second.max()) >= n_experts or second.min() < 0
        ):
            raise ValueError(f"layer {layer}: expert index outside [0, {n_experts})")
        sizes = topk_intersection_sizes(first, second)
        k = first.shape[-1]
        rows.append(
            {
                "layer": layer,
                "k": k,
                "n_experts": n_experts,
                "n_tokens": int(sizes.size),
                "mean_overlap": float(sizes.mean()),
                "random_reference": random_overlap_reference(k, n_experts),
                "overlap_fraction": float(sizes.mean()) / k,
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------
# Residual writes


def rowwise_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity along the last axis: [..., d] x [..., d] -> [...]. Zero vectors give 0."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"cosine needs equal shapes, got {a.shape} and {b.shape}")
    dot = (a * b).sum(axis=-1)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return dot / np.maximum(norms, _EPS)


def norm_ratio(second: np.ndarray, first: np.ndarray) -> float:
    """mean_t ||second_t|| / mean_t ||first_t|| over tokens (a ratio of means: robust to tiny writes)."""
    second, first = np.asarray(second, dtype=np.float64), np.asarray(first, dtype=np.float64)
    if second.shape != first.shape:
        raise ValueError(f"norm ratio needs equal shapes, got {second.shape} and {first.shape}")
    denominator = np.linalg.norm(first, axis=-1).mean()
    if denominator <= _EPS:
        raise ValueError("visit-1 writes are all zero; the norm ratio is undefined")
    return float(np.linalg.norm(second, axis=-1).mean() / denominator)


def _residual_writes(captures: Captures, layer: int, visit: int) -> dict[str, np.ndarray]:
    dx_attn = capture_array(captures, layer, visit, "dx_attn").astype(np.float64)
    dx_moe = capture_array(captures, layer, visit, "dx_moe").astype(np.float64)
    return {"dx": dx_attn + dx_moe, "dx_attn": dx_attn, "dx_moe": dx_moe}


def residual_write_ratios(captures: Captures) -> pd.DataFrame:
    """Per looped layer and write: ||dx(visit 2)|| / ||dx(visit 1)|| (ratio of token-mean L2 norms).

    Reads `dx_attn`, `dx_moe` [batch, seq, d]; dx = dx_attn + dx_moe. Columns: layer, write, norm_visit1,
    norm_visit2, ratio. Both visits carry the same 1/r factor, so it cancels in the ratio.
    """
    rows = []
    for layer in require_looped_layers(captures):
        first, second = _residual_writes(captures, layer, 1), _residual_writes(captures, layer, 2)
        for write in ("dx", "dx_attn", "dx_moe"):
            rows.append(
                {
                    "layer": layer,
                    "write": write,
                    "norm_visit1": float(np.linalg.norm(first[write], axis=-1).mean()),
                    "norm_visit2": float(np.linalg.norm(second[write], axis=-1).mean()),
                    "ratio": norm_ratio(second[write], first[write]),
                }
            )
    return pd.DataFrame(rows)


def residual_write_cosines(captures: Captures) -> pd.DataFrame:
    """Token-mean cosine of dx between visit 1 of one looped layer and visit 2 of another (or the same).

    Every ordered pair (layer_visit1, layer_visit2) of looped layers is a row; `pair` is "same_layer" when
    they are equal and "unrelated" otherwise (the control: two writes that share neither weights nor the
    position in the forward pass, taken on the same tokens). Columns: layer_visit1, layer_visit2, pair,
    mean_cosine. Summarise with `summarize_pairs`.
    """
    layers = require_looped_layers(captures)
    writes = {
        (layer, visit): _residual_writes(captures, layer, visit)["dx"] for layer in layers for visit in (1, 2)
    }
    rows = []
    for layer_a in layers:
        for layer_b in layers:
            cosine = rowwise_cosine(writes[(layer_a, 1)], writes[(layer_b, 2)])
            rows.append(
                {
                    "layer_visit1": layer_a,
                    "layer_visit2": layer_b,
                    "pair": "same_layer" if layer_a == layer_b else "unrelated",
                    "mean_cosine": float(cosine.mean()),
                }
            )
    return pd.DataFrame(rows)


def summarize_pairs(table: pd.DataFrame, value: str = "mean_cosine") -> pd.DataFrame:
    """Mean, min and max of `value` per `pair` kind (same_layer / unrelated, or same_head / control_head)."""
    if "pair" not in table or value not in table:
        raise ValueError(f"table needs 'pair' and {value!r} columns")
    grouped = table.groupby("pair", sort=True)[value]
    return grouped.agg(["mean", "min", "max", "count"]).reset_index()


# ---------------------------------------------------------------------------------------------------------
# Attention-stage cosines


def attention_stage_cosines(captures: Captures, stages: Sequence[str] = ATTENTION_STAGES) -> pd.DataFrame:
    """Per looped layer and stage: token-mean cosine between visit 1 and visit 2 of the same stage.

    The cosine is taken over the last axis and averaged over all leading positions, so per-head stages
    ([batch, seq, heads, hd]) give per-(token, head) cosines and residual-width stages per-token ones.
    Columns: layer, stage, mean_cosine, n_vectors.
    """
    unknown = sorted(set(stages) - set(ATTENTION_STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; known: {ATTENTION_STAGES}")
    rows = []
    for layer in require_looped_layers(captures):
        for stage in stages:
            cosine = rowwise_cosine(
                capture_array(captures, layer, 1, stage), capture_array(captures, layer, 2, stage)
            )
            rows.append(
                {
                    "layer": layer,
                    "stage": stage,
                    "mean_cosine": float(cosine.mean()),
                    "n_vectors": int(cosine.size),
                }
            )
    return pd.DataFrame(rows)


def summary_beside_paper(tables: Mapping[str, pd.DataFrame], paper_ranges: Mapping[str, tuple[float, float]]
                         ) -> pd.DataFrame:
    """One row per §9 measure of a looped model's analysis tables (`smelt analyze` CSVs, by name): the
    mean, min and max over layers (or head pairs) next to the paper's (low, high), and whether the mean
    lies inside it. `sink_v2_below_v1` (no paper range: "nearly all heads") is the share of the
    repeated layers' heads whose first-token mass falls from visit 1 to visit 2."""
    rows = []

    def add(measure: str, values, key: str | None = None):
        values = np.asarray(values, float)
        low, high = paper_ranges.get(key or measure, (np.nan, np.nan))
        mean = float(values.mean()) if values.size else np.nan
        rows.append({"measure": measure, "mean": mean, "min": float(values.min()) if values.size else np.nan,
                     "max": float(values.max()) if values.size else np.nan, "n": int(values.size),
                     "paper_low": low, "paper_high": high,
                     "inside": bool(low <= mean <= high) if np.isfinite(low) and np.isfinite(mean) else None})

    if "routing_overlap" in tables:
        add("routing_overlap_fraction", tables["routing_overlap"]["overlap_fraction"])
        add("routing_overlap_random", tables["routing_overlap"]["random_reference"] /
            tables["routing_overlap"]["k"])
    if "residual_write_ratios" in tables:
        add("write_norm_ratio", tables["residual_write_ratios"]["ratio"])
    if "residual_write_cosines" in tables:
        cosines = tables["residual_write_cosines"]
        for pair in ("same_layer", "unrelated"):
            add(f"write_cosine_{pair}", cosines[cosines["pair"] == pair]["mean_cosine"])
    if "attention_stage_cosines" in tables:
        stages = tables["attention_stage_cosines"]
        for stage in ATTENTION_STAGES:
            add(f"stage_cosine_{stage}", stages[stages["stage"] == stage]["mean_cosine"])
    if "attended_token_overlap" in tables:
        overlap = tables["attended_token_overlap"]
        for pair in ("same_head", "control_head"):
            key = "attended_overlap_same_head" if pair == "same_head" else "attended_overlap_control"
            add(key, overlap[overlap["pair"] == pair]["mean_overlap"])
    if "attention_sink_mass" in tables:
        sink = tables["attention_sink_mass"]
        both = sink[sink["visit"] == 1].merge(sink[sink["visit"] == 2], on=["layer", "head"],
                                              suffixes=("_1", "_2"))
        add("sink_v2_below_v1", (both["sink_mass_2"] < both["sink_mass_1"]).astype(float))
    return pd.DataFrame(rows)

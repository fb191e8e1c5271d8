"""Attention-pattern analyses: attended-token overlap between visits, attention sinks, the Dyck head.

Inputs follow the capture layout of `smelt_jax.analysis.mechanistic`: `captures[(layer, visit)]["attn_probs"]`
is [batch, heads, q, k] softmax probabilities over the full (packed) sequence, q == k == seq, with masked
entries exactly 0 (causal and document masks). `segment_ids` [batch, seq] label documents: a document is a
maximal run of equal ids (packing keeps documents contiguous), and its first token is the run's first
position. Numpy in, tidy DataFrame out.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from smelt_jax.analysis.mechanistic import (
    Captures,
    capture_array,
    require_looped_layers,
)

GU_THRESHOLD = 0.3
GU_SEQ_LEN = 64


def _check_probs(probs: np.ndarray, what: str) -> np.ndarray:
    probs = np.asarray(probs)
    if probs.ndim != 4 or probs.shape[2] != probs.shape[3]:
        raise ValueError(
            f"{what}: attention probs must be [batch, heads, q, k] with q == k, got {probs.shape}"
        )
    return probs


# ---------------------------------------------------------------------------------------------------------
# Attended-token overlap


def attended_key_overlap(
    probs_a: np.ndarray, probs_b: np.ndarray, top: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Per (head, query): |top keys(a) ∩ top keys(b)| / top, and whether the query counts.

    probs_a, probs_b: [heads, q, k]. A query counts when both visits give at least `top` keys a non-zero
    probability (earlier queries have fewer attendable keys, and their top set would include masked keys
    chosen by tie-breaking). Returns (overlap [heads, q] float, valid [heads, q] bool); overlap is 0 where
    not valid.
    """
    probs_a, probs_b = np.asarray(probs_a), np.asarray(probs_b)
    if probs_a.shape != probs_b.shape or probs_a.ndim != 3:
        raise ValueError(
            f"need two [heads, q, k] arrays of one shape, got {probs_a.shape} and {probs_b.shape}"
        )
    if not 1 <= top <= probs_a.shape[-1]:
        raise ValueError(f"top must be in [1, {probs_a.shape[-1]}], got {top}")
    keys_a = np.argpartition(-probs_a, top - 1, axis=-1)[..., :top]
    keys_b = np.argpartition(-probs_b, top - 1, axis=-1)[..., :top]
    shared = (keys_a[..., :, None] == keys_b[..., None, :]).any(axis=-1).sum(axis=-1)
    valid = ((probs_a > 0).sum(axis=-1) >= top) & ((probs_b > 0).sum(axis=-1) >= top)
    return np.where(valid, shared / top, 0.0), valid


def attended_token_overlap(captures: Captures, top: int = 8, control_shift: int = 1) -> pd.DataFrame:
    """Per looped layer and head: mean top-`top` attended-key overlap between visits, and a control.

    `same_head` pairs head h of visit 1 with head h of visit 2. The control (`control_head`) pairs head h of
    visit 1 with head (h + control_shift) mod H of visit 2: same layer, same tokens, same position in the
    forward pass, but different weights — what overlap attention to the same positions gives by itself
    (recent tokens, the sink). Columns: layer, head, partner_head, pair, mean_overlap, n_queries.
    Summarise with `mechanistic.summarize_pairs(table, "mean_overlap")`.
    """
    rows = []
    for layer in require_looped_layers(captures):
        first = _check_probs(capture_array(captures, layer, 1, "attn_probs"), f"layer {layer} visit 1")
        second = _check_probs(capture_array(captures, layer, 2, "attn_probs"), f"layer {layer} visit 2")
        if first.shape != second.shape:
            raise ValueError(
                f"layer {layer}: visits have different attention shapes {first.shape}, {second.shape}"
            )
        n_heads = first.shape[1]
        if n_heads < 2 or control_shift % n_heads == 0:
            raise ValueError(
                f"the control pairing needs >= 2 heads and a shift that is not a multiple of {n_heads}"
            )
        for pair, shift in (("same_head", 0), ("control_head", control_shift)):
            totals, counts = np.zeros(n_heads), np.zeros(n_heads, dtype=np.int64)
            for batch_index in range(first.shape[0]):  # one sequence at a time bounds memory
                partner = np.roll(second[batch_index], -shift, axis=0)  # partner[h] = second[(h + shift) % H]
                overlap, valid = attended_key_overlap(first[batch_index], partner, top)
                totals += overlap.sum(axis=-1)
                counts += valid.sum(axis=-1)
            for head in range(n_heads):
                rows.append(
                    {
                        "layer": layer,
                        "head": head,
                        "partner_head": (head + shift) % n_heads,
                        "pair": pair,
                        "mean_overlap": float(totals[head] / counts[head]) if counts[head] else float("nan"),
                        "n_queries": int(counts[head]),
                    }
                )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------
# Attention sinks


def document_starts(segment_ids: np.ndarray) -> np.ndarray:
    """For every position, the index of the first token of its document: [..., seq] -> [..., seq] int."""
    segment_ids = np.asarray(segment_ids)
    if segment_ids.ndim < 1 or segment_ids.shape[-1] == 0:
        raise ValueError(f"segment_ids must be [..., seq] with seq >= 1, got {segment_ids.shape}")
    positions = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    is_start = np.ones(segment_ids.shape, dtype=bool)
    is_start[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    return np.maximum.accumulate(np.where(is_start, positions, 0), axis=-1)


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """1-based position of every token within its document: [..., seq] -> [..., seq] int."""
    segment_ids = np.asarray(segment_ids)
    return np.arange(segment_ids.shape[-1]) - document_starts(segment_ids) + 1


def first_token_mass(probs: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Attention mass each query puts on the first token of its own document.

    probs: [batch, heads, q, k] (q == k == seq); segment_ids: [batch, seq]. Returns [batch, heads, q].
    """
    probs = _check_probs(probs, "first_token_mass")
    segment_ids = np.asarray(segment_ids)
    if segment_ids.shape != (probs.shape[0], probs.shape[2]):
        raise ValueError(
            f"segment_ids must be [batch, seq] = {(probs.shape[0], probs.shape[2])}, got {segment_ids.shape}"
        )
    starts = document_starts(segment_ids)  # [batch, seq]
    index = np.broadcast_to(starts[:, None, :, None], (*probs.shape[:3], 1))
    return np.take_along_axis(probs, index, axis=-1)[..., 0]


def attention_sink_mass(captures: Captures, segment_ids: np.ndarray, skip_first: bool = True) -> pd.DataFrame:
    """Per layer, visit and head: the mean over queries of the mass on the own document's first token.

    Every captured (layer, visit) is included, so Baseline models (visit 1 only) work too. With `skip_first`
    the documents' first tokens are left out as queries (causality forces their mass to 1). Columns: layer,
    visit, head, sink_mass, n_queries.
    """
    if not captures:
        raise ValueError("no captures")
    segment_ids = np.asarray(segment_ids)
    queries = document_positions(segment_ids) > 1 if skip_first else np.ones(segment_ids.shape, dtype=bool)
    n_queries = int(queries.sum())
    if n_queries == 0:
        raise ValueError("no query left: every document has a single token")
    rows = []
    for layer, visit in sorted(captures):
        mass = first_token_mass(
            capture_array(captures, layer, visit, "attn_probs"), segment_ids
        )  # [batch, heads, q]
        per_head = (mass * queries[:, None, :]).sum(axis=(0, 2)) / n_queries
        for head, value in enumerate(per_head):
            rows.append(
                {
                    "layer": layer,
                    "visit": visit,
                    "head": head,
                    "sink_mass": float(value),
                    "n_queries": n_queries,
                }
            )
    return pd.DataFrame(rows)


def first_token_attention(
    captures: Captures, threshold: float = GU_THRESHOLD, seq_len: int | None = GU_SEQ_LEN
) -> pd.DataFrame:
    """Gu et al. (2024) per head: alpha = mean over sequences and all queries of attention to token 1.

    Inputs are single-document sequences ([batch, heads, seq_len, seq_len]); the first query is included, as
    in their definition. `seq_len` (64 in their metric) is checked unless None. Columns: layer, visit, head,
    first_token_attention, is_sink (alpha > threshold).
    """
    if not captures:
        raise ValueError("no captures")
    rows = []
    for layer, visit in sorted(captures):
        probs = _check_probs(
            capture_array(captures, layer, visit, "attn_probs"), f"layer {layer} visit {visit}"
        )
        if seq_len is not None and probs.shape[2] != seq_len:
            raise ValueError(
                f"Gu et al.'s sink rate is defined on {seq_len}-token inputs, got {probs.shape[2]} (seq_len=None skips the check)"
            )
        alpha = probs[..., 0].mean(axis=(0, 2))  # [heads]
        for head, value in enumerate(alpha):
            rows.append(
                {
                    "layer": layer,
                    "visit": visit,
                    "head": head,
                    "first_token_attention": float(value),
                    "is_sink": bool(value > threshold),
                }
            )
    return pd.DataFrame(rows)


def gu_sink_rate(
    captures: Captures, threshold: float = GU_THRESHOLD, seq_len: int | None = GU_SEQ_LEN
) -> pd.DataFrame:
    """Share of heads (over every executed layer) whose mean first-token attention exceeds `threshold`.

    Rows: scope "all" and one per visit present ("visit 1", "visit 2"). Columns: scope, n_heads,
    n_sink_heads, sink_rate.
    """
    heads = first_token_attention(captures, threshold, seq_len)
    scopes = [("all", heads)] + [
        (f"visit {visit}", group) for visit, group in heads.groupby("visit", sort=True)
    ]
    return pd.DataFrame(
        [
            {
                "scope": scope,
                "n_heads": len(group),
                "n_sink_heads": int(group["is_sink"].sum()),
                "sink_rate": float(group["is_sink"].mean()),
            }
            for scope, group in scopes
        ]
    )


# ---------------------------------------------------------------------------------------------------------
# The Dyck head


def rank_ablated_heads(
    ablation_losses: Mapping[tuple[int, int], float], baseline_loss: float
) -> pd.DataFrame:
    """Heads ranked by how much their ablation raises the Dyck loss; row 0 is the Dyck head.

    ablation_losses: {(layer, head): Dyck continuation cross-entropy with that head ablated} over the looped
    block's heads (an ablation of a shared head acts on both visits); baseline_loss: the unablated loss.
    Columns: rank (0 = largest increase), layer, head, loss, loss_increase. Ties keep (layer, head) order.
    """
    if not ablation_losses:
        raise ValueError("no ablation losses")
    rows = [
        {"layer": layer, "head": head, "loss": float(loss)}
        for (layer, head), loss in sorted(ablation_losses.items())
    ]
    table = pd.DataFrame(rows)
    if not np.all(np.isfinite(table["loss"])) or not np.isfinite(baseline_loss):
        raise ValueError("losses must be finite")
    table["loss_increase"] = table["loss"] - float(baseline_loss)
    table = table.sort_values("loss_increase", ascending=False, kind="stable").reset_index(drop=True)
    table.insert(0, "rank", np.arange(len(table)))
    return table


def dyck_head_attention(
    captures: Captures,
    layer: int,
    head: int,
    query_mask: np.ndarray,
    bos_mask: np.ndarray,
    demo_answer_mask: np.ndarray,
) -> pd.DataFrame:
    """Per visit of (layer, head): mean attention mass on BOS keys and on demonstration-answer keys.

    query_mask [batch, q]: the queries to average over (e.g. the positions that predict the query's answer
    tokens); bos_mask, demo_answer_mask [batch, k]: disjoint key sets. The mass of a query on a set is the sum
    of its probabilities over the set. Columns: layer, head, visit, bos_mass, demo_answer_mass, other_mass,
    n_queries.
    """
    query_mask, bos_mask, demo_answer_mask = (
        np.asarray(m, dtype=bool) for m in (query_mask, bos_mask, demo_answer_mask)
    )
    if np.any(bos_mask & demo_answer_mask):
        raise ValueError("bos_mask and demo_answer_mask overlap")
    n_queries = int(query_mask.sum())
    if n_queries == 0:
        raise ValueError("query_mask selects no query")
    visits = sorted(visit for captured_layer, visit in captures if captured_layer == layer)
    if not visits:
        raise KeyError(f"layer {layer} was not captured")
    rows = []
    for visit in visits:
        probs = _check_probs(
            capture_array(captures, layer, visit, "attn_probs"), f"layer {layer} visit {visit}"
        )
        if not 0 <= head < probs.shape[1]:
            raise ValueError(f"head {head} outside [0, {probs.shape[1]})")
        shape = (probs.shape[0], probs.shape[2])
        for name, mask in (
            ("query_mask", query_mask),
            ("bos_mask", bos_mask),
            ("demo_answer_mask", demo_answer_mask),
        ):
            if mask.shape != shape:
                raise ValueError(f"{name} must be [batch, seq] = {shape}, got {mask.shape}")
        head_probs = probs[:, head]  # [batch, q, k]
        bos = (head_probs * bos_mask[:, None, :]).sum(axis=-1)[query_mask]
        demo = (head_probs * demo_answer_mask[:, None, :]).sum(axis=-1)[query_mask]
        total = head_probs.sum(axis=-1)[query_mask]
        rows.append(
            {
                "layer": layer,
                "head": head,
                "visit": visit,
                "bos_mass": float(bos.mean()),
                "demo_answer_mass": float(demo.mean()),
                "other_mass": float((total - bos - demo).mean()),
                "n_queries": n_queries,
            }
        )
    return pd.DataFrame(rows)

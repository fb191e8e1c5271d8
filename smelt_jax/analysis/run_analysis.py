"""The mechanistic analyses of docs/paper.md §9 on a trained model: run it with `capture=True` on held-out tokens and
turn the captures into the tables of `analysis.mechanistic` and `analysis.attention`.

Capture names are one vocabulary: the model's `capture=True` arrays carry the names the analyses read
(`topk_ids`, `dx_attn`, `dx_moe`, `normed_input`, `q`, `k`, `v`, `pv`, `attn_out`, `attn_probs`). Only
the visit numbering differs: the model counts visits from 0 (`(layer, 0)` for every layer outside the
loop), the analyses from 1 as the paper does; `analysis_captures` converts and moves arrays to numpy.

Held-out tokens: validation rows (`data.pipeline.validation_sets`, round-robin over sources) of
`seq_len` tokens with no padding, run `batch_size` rows at a time; token-level arrays of all batches are
concatenated, attention probabilities are kept for the first `attention_rows` rows only (they are
[rows, heads, seq, seq] per executed layer). Gu et al.'s sink rate uses 64-token single-document inputs:
the first 64 tokens (BOS first) of validation documents at least that long.

Head ablation (the Dyck head): head h of looped layer l is ablated on both visits by zeroing its slice
`wo[l, h]` of the output projection — the head's contribution to the residual stream is then exactly 0
while every other head and layer is unchanged. No model code is involved: the ablated model is a copy
with that parameter changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from smelt_jax.analysis import attention as attention_lib
from smelt_jax.analysis import dyck as dyck_lib
from smelt_jax.analysis import mechanistic as mech
from smelt_jax.platform.errors import UsageError

TOKEN_CAPTURES = ("topk_ids", "dx_attn", "dx_moe", "normed_input", "q", "k", "v", "pv", "attn_out")
GU_LENGTH = attention_lib.GU_SEQ_LEN


def analysis_captures(model_captures: dict, max_visit: int = 2) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Model captures {(layer, visit0): {name: array}} -> analysis layout {(layer, visit0 + 1): numpy}.

    Visits past `max_visit` are dropped (the cross-visit analyses compare visits 1 and 2; a model looped
    more than twice keeps its first two). `residual` is left out (no analysis reads it).
    """
    out = {}
    for (layer, visit), arrays in model_captures.items():
        if visit + 1 > max_visit:
            continue
        out[(int(layer), int(visit) + 1)] = {name: np.asarray(value) for name, value in arrays.items()
                                             if name != "residual"}
    return out


def _capture_fn():
    from flax import nnx

    @nnx.jit
    def run(model, tokens, segment_ids, positions):
        _, aux = model(tokens, segment_ids, positions, capture=True)
        return aux["captures"]

    return run


def capture_rows(model, tokens: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray, *,
                 batch_size: int = 4, attention_rows: int | None = None) -> dict:
    """Captures (analysis layout) of `model` on rows [n, seq], `batch_size` rows per forward.

    Token-level arrays are concatenated over all rows; `attn_probs` over the first `attention_rows` rows
    (all when None, at most the rows given). Rows must hold no padding (segment id 0).
    """
    tokens, segment_ids, positions = (np.asarray(a, np.int32) for a in (tokens, segment_ids, positions))
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise ValueError(f"need rows [n, seq] with n >= 1, got {tokens.shape}")
    if np.any(segment_ids <= 0):
        raise ValueError("rows must not contain padding (segment id 0)")
    attention_rows = tokens.shape[0] if attention_rows is None else attention_rows
    run = _capture_fn()
    parts: list[dict] = []
    for start in range(0, tokens.shape[0], batch_size):
        stop = min(start + batch_size, tokens.shape[0])
        captured = analysis_captures(run(model, tokens[start:stop], segment_ids[start:stop],
                                         positions[start:stop]))
        if start >= attention_rows:
            for arrays in captured.values():
                arrays.pop("attn_probs", None)
        elif stop > attention_rows:
            for arrays in captured.values():
                if "attn_probs" in arrays:
                    arrays["attn_probs"] = arrays["attn_probs"][: attention_rows - start]
        parts.append(captured)
    return {key: {name: np.concatenate([part[key][name] for part in parts if name in part[key]])
                  for name in parts[0][key]} for key in parts[0]}


def held_out_rows(corpus, *, n_tokens: int, seq_len: int) -> dict[str, np.ndarray]:
    """At least `n_tokens` validation tokens as full rows [n, seq_len] without padding, sources interleaved.

    Returns 'tokens', 'segment_ids', 'positions' (int32 [n, seq_len]) and 'source' (object [n]).
    """
    from smelt_jax.data.pipeline import validation_sets

    sets = validation_sets(corpus, batch_size=1, seq_len=seq_len, host_index=0, host_count=1)
    iterators = {name: iter(vset) for name, vset in sets.items()}
    rows: dict[str, list] = {"tokens": [], "segment_ids": [], "positions": [], "source": []}
    wanted = -(-n_tokens // seq_len)
    while len(rows["tokens"]) < wanted and iterators:
        for name in list(iterators):
            batch = next(iterators[name], None)
            if batch is None:
                del iterators[name]
                continue
            if np.any(batch["segment_ids"] == 0):
                continue  # the padded last row of a source
            for key in ("tokens", "segment_ids", "positions"):
                rows[key].append(batch[key][0])
            rows["source"].append(name)
            if len(rows["tokens"]) == wanted:
                break
    if not rows["tokens"]:
        raise UsageError(f"no validation row of {seq_len} tokens without padding; lower --seq-len")
    return {key: np.asarray(value, dtype=object if key == "source" else np.int32)
            for key, value in rows.items()}


def gu_rows(corpus, *, n_rows: int, length: int = GU_LENGTH) -> np.ndarray:
    """The first `length` tokens (BOS first) of up to `n_rows` validation documents at least that long:
    int32 [n, length], sources interleaved."""
    per_source = []
    for source in sorted(corpus.sources):
        split = corpus.split(source, "val")
        docs = [split.document(i)[:length] for i in range(split.num_documents)]
        per_source.append([doc for doc in docs if doc.size >= length])
    picked = []
    for index in range(max((len(docs) for docs in per_source), default=0)):
        for docs in per_source:
            if index < len(docs) and len(picked) < n_rows:
                picked.append(docs[index])
    if not picked:
        raise UsageError(f"no validation document of at least {length} tokens (the data's validation split "
                         "is too small for this analysis)")
    return np.asarray(picked, dtype=np.int32)


# ---------------------------------------------------------------------------------------------------------
# The Dyck head


def ablate_head(model, layer: int, head: int):
    """A copy of `model` whose looped layer `layer` has head `head` removed on every visit (wo[l, h] = 0)."""
    import jax
    from flax import nnx

    cfg = model.cfg
    if not cfg.loop_start <= layer < cfg.loop_end:
        raise ValueError(f"layer {layer} is outside the looped span [{cfg.loop_start}, {cfg.loop_end})")
    if not 0 <= head < cfg.n_heads:
        raise ValueError(f"head {head} outside [0, {cfg.n_heads})")
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # new Variables, shared arrays
    wo = copy.loop.attention.wo
    wo[...] = wo[...].at[layer - cfg.loop_start, head].set(0)
    return copy


def dyck_loss(score_fn, examples: Sequence[dyck_lib.DyckExample]) -> float:
    """Mean continuation cross-entropy (nats per token, averaged per example) of a Dyck set."""
    scores = score_fn([e.context for e in examples], [e.continuation for e in examples])
    return float(np.mean([-s / n for s, n, _ in scores]))


def dyck_head_tables(model, *, shots: int = 4, n_examples: int = 16, seed: int = 0, max_len: int = 1024,
                     batch_size: int = 8) -> dict[str, pd.DataFrame]:
    """Rank the looped block's heads by the Dyck loss rise under ablation, then the top head's attention.

    Returns 'dyck_head_ablation' (`attention.rank_ablated_heads`) and 'dyck_head_attention'
    (`attention.dyck_head_attention` per visit: queries = the positions predicting the answer tokens;
    keys = BOS and the demonstrations' answer tokens).
    """
    from smelt_jax.analysis.evaluate import encode_pair, make_score_fn
    from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER

    cfg = model.cfg
    if not cfg.is_looped:
        raise UsageError("the Dyck head is a head of the looped block; this model has none")
    examples = dyck_lib.make_examples(seed, n_examples, shots)
    baseline = dyck_loss(make_score_fn(model, max_len=max_len, batch_size=batch_size), examples)
    losses = {}
    for layer in range(cfg.loop_start, cfg.loop_end):
        for head in range(cfg.n_heads):
            ablated = ablate_head(model, layer, head)
            losses[(layer, head)] = dyck_loss(make_score_fn(ablated, max_len=max_len, batch_size=batch_size),
                                              examples)
    ranking = attention_lib.rank_ablated_heads(losses, baseline)
    ranking.insert(len(ranking.columns), "baseline_loss", baseline)
    top_layer, top_head = int(ranking.loc[0, "layer"]), int(ranking.loc[0, "head"])

    # One example per row (rows differ in length), each with its own masks; attention of the top head.
    run = _capture_fn()
    per_visit: dict[int, list] = {}
    for example in examples:
        ids, n_answer = encode_pair(example.context, example.continuation, DEFAULT_TOKENIZER, max_len)
        if ids[0] != DEFAULT_TOKENIZER.bos_id:
            raise UsageError(f"a {shots}-shot Dyck prompt does not fit max_len {max_len}; use fewer --dyck-shots")
        n = ids.size
        captured = analysis_captures(run(model, ids[None], np.ones((1, n), np.int32),
                                         np.arange(n, dtype=np.int32)[None]))
        # character c of the (ASCII) context is token c + 1 (BOS is token 0)
        offsets = np.stack([np.arange(n) - 1, np.arange(n)], axis=1)
        offsets[0] = (0, 0)
        demo_mask = dyck_lib.char_spans_to_token_mask(offsets, example.demo_answer_spans)
        demo_mask[0] = False
        bos_mask = np.zeros(n, bool)
        bos_mask[0] = True
        query_mask = np.zeros(n, bool)
        query_mask[n - n_answer - 1:n - 1] = True  # these positions predict the answer tokens
        if not demo_mask.any():
            demo_mask = np.zeros(n, bool)  # 0-shot: no demonstration keys
        table = attention_lib.dyck_head_attention(
            {key: value for key, value in captured.items() if key[0] == top_layer}, top_layer, top_head,
            query_mask[None], bos_mask[None], demo_mask[None])
        for row in table.to_dict("records"):
            per_visit.setdefault(row["visit"], []).append(row)
    attention_rows = []
    for visit, rows in sorted(per_visit.items()):
        weights = np.array([r["n_queries"] for r in rows], float)
        attention_rows.append({
            "layer": top_layer, "head": top_head, "visit": visit, "shots": shots,
            **{name: float(np.average([r[name] for r in rows], weights=weights))
               for name in ("bos_mass", "demo_answer_mass", "other_mass")},
            "n_queries": int(weights.sum()), "n_examples": len(rows)})
    return {"dyck_head_ablation": ranking, "dyck_head_attention": pd.DataFrame(attention_rows)}


# ---------------------------------------------------------------------------------------------------------
# Everything


def analysis_tables(model, corpus, *, n_tokens: int = 8192, seq_len: int = 256, batch_size: int = 4,
                    attention_rows: int = 8, gu_rows_count: int = 32, dyck: bool = True,
                    dyck_shots: int = 4, dyck_examples: int = 16) -> dict[str, pd.DataFrame]:
    """Every §9 table for `model` (a Decoder; `model.cfg` its ModelConfig) on `corpus`'s validation data.

    Looped models get all tables; a Baseline gets the ones defined for single visits (sink mass, Gu's
    sink rate). Returns {table name: DataFrame}; see the module docstring for the sampling.
    """
    cfg = model.cfg
    seq_len = min(seq_len, cfg.seq_len) if cfg.seq_len else seq_len
    rows = held_out_rows(corpus, n_tokens=n_tokens, seq_len=seq_len)
    captures = capture_rows(model, rows["tokens"], rows["segment_ids"], rows["positions"],
                            batch_size=batch_size, attention_rows=attention_rows)
    n_attention_rows = min(attention_rows, rows["tokens"].shape[0])
    attention_captures = {key: {"attn_probs": arrays["attn_probs"]} for key, arrays in captures.items()
                          if "attn_probs" in arrays}
    tables: dict[str, pd.DataFrame] = {}
    if cfg.is_looped:
        tables["routing_overlap"] = mech.routing_overlap(captures, cfg.n_experts)
        tables["residual_write_ratios"] = mech.residual_write_ratios(captures)
        cosines = mech.residual_write_cosines(captures)
        tables["residual_write_cosines"] = cosines
        tables["residual_write_cosine_summary"] = mech.summarize_pairs(cosines)
        tables["attention_stage_cosines"] = mech.attention_stage_cosines(captures)
        if attention_captures and cfg.n_heads >= 2:
            top = min(8, seq_len)
            overlap = attention_lib.attended_token_overlap(attention_captures, top=top)
            tables["attended_token_overlap"] = overlap
            tables["attended_token_overlap_summary"] = mech.summarize_pairs(overlap, "mean_overlap")
    if attention_captures:
        tables["attention_sink_mass"] = attention_lib.attention_sink_mass(
            attention_captures, rows["segment_ids"][:n_attention_rows])
    gu_tokens = gu_rows(corpus, n_rows=gu_rows_count)
    gu_captures = capture_rows(model, gu_tokens, np.ones_like(gu_tokens),
                               np.broadcast_to(np.arange(GU_LENGTH, dtype=np.int32), gu_tokens.shape),
                               batch_size=max(batch_size, 8))
    gu_captures = {key: {"attn_probs": arrays["attn_probs"]} for key, arrays in gu_captures.items()}
    tables["gu_first_token_attention"] = attention_lib.first_token_attention(gu_captures)
    tables["gu_sink_rate"] = attention_lib.gu_sink_rate(gu_captures)
    if dyck and cfg.is_looped:
        tables.update(dyck_head_tables(model, shots=dyck_shots, n_examples=dyck_examples))
    tables["sample"] = pd.DataFrame([{
        "n_rows": int(rows["tokens"].shape[0]), "seq_len": seq_len, "n_tokens": int(rows["tokens"].size),
        "attention_rows": n_attention_rows, "gu_rows": int(gu_tokens.shape[0]),
        "sources": ",".join(sorted(set(rows["source"])))}])
    return tables


def write_tables(tables: dict[str, pd.DataFrame], folder) -> list[Any]:
    """Each table as `<folder>/<name>.csv` (a local folder or gs://...); returns the paths (URLs)."""
    from pathlib import Path

    from smelt_jax.platform import storage as gcs

    if gcs.is_gcs(folder):
        urls = [gcs.join(str(folder), f"{name}.csv") for name in tables]
        for url, table in zip(urls, tables.values()):
            gcs.write_text(url, table.to_csv(index=False))
        return urls
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in tables.items():
        path = folder / f"{name}.csv"
        with gcs.naming(path):  # a full disk says which file
            table.to_csv(path, index=False)
        paths.append(path)
    return paths


def check_writable(folder) -> None:
    """Refuse an output folder the tables cannot be written to before the analysis runs (issue 53): a
    local folder is made and a probe file written and removed in it; the folders the probe made are
    removed again. An OSError names the path (the CLI's one line); gs:// is checked for its form only."""
    import os
    import tempfile
    from pathlib import Path

    from smelt_jax.platform import storage as gcs

    gcs.require_folder(folder, "--out")
    if gcs.is_gcs(folder):
        return
    folder = Path(folder).absolute()
    made = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".smelt-write-probe-"):
            pass
    except OSError as err:
        if err.filename is None:
            err.filename = str(folder)
        raise
    finally:
        for path in made:  # deepest first
            try:
                path.rmdir()
            except OSError:
                pass

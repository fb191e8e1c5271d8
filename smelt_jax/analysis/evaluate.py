"""Evaluating a trained model: validation loss (overall, per source, per document length), a model-backed
scorer for task files, and the k-shot Dyck task.

Two halves:
- pure aggregation (`loss_by_length_bucket`, `validation_document_lengths`, `dyck_table`), numpy in and
  tidy DataFrames out;
- the model side (`load_model`, `make_score_fn`, `validation_report`), which runs a `Decoder` restored
  from a run's checkpoint. The model reads bytes (`smelt_jax.data.tokenizer.ByteTokenizer`): a scored text
  is BOS + the UTF-8 bytes of `context + continuation`.

Document-length buckets: a document of n tokens (as stored: BOS + bytes + EOS) falls into the smallest edge
of (32, 64, ..., 4096) that is >= n, so bucket 32 holds 1..32 tokens, bucket 64 holds 33..64, and so on;
documents longer than the last edge go to bucket `inf`. A token counts towards its whole document's
length, not towards the fragment that one packed row holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from smelt_jax.analysis import dyck as dyck_lib
from smelt_jax.platform.errors import MissingInput, UsageError

LENGTH_BUCKETS: tuple[int, ...] = tuple(2**i for i in range(5, 13))  # 32, 64, ..., 4096
# The shot counts of the paper's Dyck table; `smelt eval` runs Dyck only when asked (--dyck-shots):
# at 32 shots its texts are far longer than a small model's training context.
DEFAULT_DYCK_SHOTS: tuple[int, ...] = (0, 1, 4, 32)


def effective_max_len(max_len: int | None, seq_len: int) -> int:
    """The longest scored text: `max_len`, or by default the model's training context `seq_len`
    (longer texts are left-truncated; a longer window costs memory quadratically and scores
    positions the model never trained on)."""
    return int(max_len) if max_len else int(seq_len)


# ---------------------------------------------------------------------------------------------------------
# Pure aggregation


def length_bucket(lengths: np.ndarray, edges: Sequence[int] = LENGTH_BUCKETS) -> np.ndarray:
    """The bucket of each document length: the smallest edge >= length, inf past the last edge.

    lengths: int [...] (>= 1). Returns float [...] (edges as floats, np.inf for the overflow bucket).
    """
    lengths = np.asarray(lengths)
    edges_array = np.asarray(edges, dtype=np.float64)
    if edges_array.ndim != 1 or edges_array.size == 0 or np.any(np.diff(edges_array) <= 0):
        raise ValueError(f"edges must be a non-empty increasing sequence, got {edges}")
    if lengths.size and lengths.min() < 1:
        raise ValueError("document lengths must be >= 1")
    index = np.searchsorted(edges_array, lengths, side="left")
    return np.append(edges_array, np.inf)[index]


def loss_by_length_bucket(token_losses: np.ndarray, document_lengths: np.ndarray,
                          document_ids: np.ndarray | None = None,
                          edges: Sequence[int] = LENGTH_BUCKETS) -> pd.DataFrame:
    """Mean token loss per document-length bucket.

    token_losses [n] (nats, scored tokens only); document_lengths [n]: the length of each token's document;
    document_ids [n] (optional): any id unique per document, to count documents. Columns: bucket (upper
    edge, inf for the overflow), n_tokens, n_documents (when ids are given), loss. Every edge gets a row;
    empty buckets have n_tokens 0 and loss NaN.
    """
    token_losses = np.asarray(token_losses, dtype=np.float64).reshape(-1)
    document_lengths = np.asarray(document_lengths).reshape(-1)
    if token_losses.shape != document_lengths.shape:
        raise ValueError(f"token_losses {token_losses.shape} and document_lengths {document_lengths.shape} "
                         "must have one entry per token")
    buckets = length_bucket(document_lengths, edges)
    if document_ids is not None:
        document_ids = np.asarray(document_ids).reshape(-1)
        if document_ids.shape != token_losses.shape:
            raise ValueError("document_ids must have one entry per token")
    rows = []
    for bucket in [*map(float, edges), np.inf]:
        pick = buckets == bucket
        n = int(pick.sum())
        if bucket == np.inf and n == 0:
            continue  # the overflow row only when used
        row = {"bucket": bucket, "n_tokens": n}
        if document_ids is not None:
            row["n_documents"] = int(np.unique(document_ids[pick]).size)
        row["loss"] = float(token_losses[pick].mean()) if n else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def validation_document_lengths(cumulative: np.ndarray, lengths: np.ndarray, rows: np.ndarray,
                                seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(document index, document length) of every input slot of packed validation rows.

    The validation stream concatenates documents in stored order: `cumulative` int [docs + 1] is each
    document's stream offset (last entry: the stream length), `lengths` int [docs]; row r holds stream
    positions [r * seq_len, (r + 1) * seq_len). rows: int [b] global row indices. Returns int [b, seq_len]
    arrays; slots past the stream's end get index -1 and length 0.
    """
    cumulative, lengths = np.asarray(cumulative, np.int64), np.asarray(lengths, np.int64)
    positions = np.asarray(rows, np.int64)[:, None] * seq_len + np.arange(seq_len)
    valid = positions < cumulative[-1]
    index = np.clip(np.searchsorted(cumulative, positions, side="right") - 1, 0, len(lengths) - 1)
    return np.where(valid, index, -1), np.where(valid, lengths[index], 0)


def dyck_table(results: Sequence[tuple[int, Sequence[bool], Sequence[float]]]) -> pd.DataFrame:
    """One row per shot count from (shots, exact matches, cross-entropies) triples.

    Columns: shots, n_examples, exact_match (accuracy), cross_entropy (mean per-example continuation
    cross-entropy, nats per token).
    """
    rows = []
    for shots, matches, entropies in results:
        summary = dyck_lib.summarize_scores(list(matches), list(entropies))
        rows.append({"shots": int(shots), "n_examples": int(summary["n_examples"]),
                     "exact_match": summary["exact_match"], "cross_entropy": summary["cross_entropy"]})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------
# Loading a trained model


@dataclasses.dataclass
class LoadedModel:
    """A Decoder restored from a run's checkpoint, with what it came from."""

    model: Any  # smelt_jax.model.Decoder
    cfg: Any  # ModelConfig
    run: dict  # run.json
    run_root: Path
    branch: int | None
    step: int

    @property
    def label(self) -> str:
        phase = "stable" if self.branch is None else f"branch{self.branch}"
        return f"{self.run.get('id', self.run_root.name)} {phase} step {self.step}"


def _find_run_root(target: str, root: Path | None) -> tuple[Path, int | None, int | None]:
    """(run folder, branch from the path or None, step from the path or None) for an id or a path."""
    path = Path(target)
    if path.exists():
        path = path.absolute()
        step = int(path.name) if path.name.isdigit() else None
        for candidate in [path, *path.parents][:4]:
            if (candidate / "run.json").is_file():
                relative = path.relative_to(candidate).parts
                branch = None
                if relative and relative[0].startswith("branch") and relative[0][6:].isdigit():
                    branch = int(relative[0][6:])
                return candidate, branch, step
        raise MissingInput(f"{target}: no run.json in it or in the 3 folders above it")
    from smelt_jax.run_files.run_lookup import find_run
    from smelt_jax.run_files.rundir import run_dir, runs_root
    base = root or runs_root()
    matches = sorted(base.glob(f"*/{target}/run.json"))  # a run folder of this exact name, as it is
    if matches:
        return matches[0].parent, None, None
    run = find_run(target, base)  # a suite's run or one saved under base; UnknownName (a KeyError)
    folder = run_dir(run.suite, run.id, base).root
    if not (folder / "run.json").is_file():
        raise MissingInput(f"run {target} has not been trained under {base} (no {folder}/run.json)")
    return folder, None, None


def run_corpus(loaded: LoadedModel, data_dir: str | None = None):
    """The corpus to evaluate `loaded` on: `data_dir` when given, else the token store its run trained
    on (run.json's record; `run_data.evaluation_data`)."""
    from smelt_jax.data.corpus import open_dataset
    from smelt_jax.run_files.rundir import RunDir
    from smelt_jax.run_files.run_data import evaluation_data

    run_id = str(loaded.run.get("id", loaded.run_root.name))
    return evaluation_data(run_id, RunDir(loaded.run_root).spec_file, data_dir=data_dir, open_store=open_dataset)


def load_model(target: str, branch: int | None = None, *, root: Path | None = None,
               step: int | None = None) -> LoadedModel:
    """Restore a trained model: `target` is a run id, a run folder, or a checkpoint folder inside one.

    branch None: the stable run (its newest checkpoint); K: decay branch K's newest checkpoint (its
    endpoint once finished). A checkpoint step folder given as `target`, or `step`, fixes the step. A
    damaged newest checkpoint is refused (`CheckpointDamaged`), never replaced by an older step unasked;
    a damaged step asked for is refused by the restore (`CheckpointError`, one line).
    """
    import jax
    from flax import nnx

    from smelt_jax.design.config import ModelConfig, Schedule
    from smelt_jax.analysis.eval_step import newest_whole_step
    from smelt_jax.run_files.rundir import RunDir
    from smelt_jax.run_files.run_spec_file import read_run_record
    from smelt_jax.train.checkpoint import Checkpointer, abstract_like
    from smelt_jax.train.state import abstract_train_state
    from smelt_jax.train.step import optimizer

    run_root, path_branch, path_step = _find_run_root(target, root)
    if path_branch is not None and branch is not None and path_branch != branch:
        raise UsageError(f"{target} is branch {path_branch}, but --branch {branch} was given")
    branch = path_branch if path_branch is not None else branch
    if path_step is not None and step is not None and path_step != step:
        raise UsageError(f"{target} is step {path_step}, but --step {step} was given")
    step = path_step if path_step is not None else step
    run = read_run_record(run_root / "run.json")  # damaged or edited: one line, before any restore
    cfg = ModelConfig.from_dict(run["config"])
    schedule = Schedule.from_dict(run["schedule"])
    folder = RunDir(run_root).checkpoints(branch)
    if not folder.is_dir():
        raise MissingInput(f"no checkpoints at {folder} (train that phase first: `smelt train`)")
    step = step if step is not None else newest_whole_step(folder)  # a damaged newest one is refused
    graphdef, abstract_state = abstract_train_state(cfg, optimizer(schedule))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with Checkpointer(folder, read_only=True) as checkpointer:  # a reader: orbax changes nothing
        restored_step, state, _ = checkpointer.restore(abstract_like(abstract_state, device), step=step)
    model = nnx.merge(graphdef, state["params"])
    return LoadedModel(model=model, cfg=cfg, run=run, run_root=run_root, branch=branch, step=restored_step)


# ---------------------------------------------------------------------------------------------------------
# Scoring text with the model


def _padded_length(n: int, limit: int) -> int:
    """Round up to a power of two (>= 16) so a handful of programs serve every length; at most `limit`."""
    return min(max(16, 1 << (n - 1).bit_length()), max(limit, n))


def _forward_logprobs(model, tokens, segment_ids, positions, targets):
    """(log p(target) [b, s], target is the argmax [b, s]) for next-token targets."""
    import jax
    import jax.numpy as jnp

    logits, _ = model(tokens, segment_ids, positions)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target_logprobs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return target_logprobs, jnp.argmax(logits, axis=-1) == targets


def encode_pair(context: str, continuation: str, tokenizer, max_len: int) -> tuple[np.ndarray, int]:
    """(ids, n_continuation) for BOS + bytes(context) + bytes(continuation), left-truncated to `max_len`.

    Truncation keeps the last `max_len` tokens (dropping BOS first, as a packed training row starts
    mid-document); a continuation longer than max_len - 1 is an error (nothing would predict its first
    token), so is an empty one.
    """
    context_ids, continuation_ids = tokenizer.encode(context), tokenizer.encode(continuation)
    n_continuation = int(continuation_ids.size)
    if n_continuation == 0:
        raise UsageError(f"empty continuation after context {context[-40:]!r}")
    if n_continuation > max_len - 1:
        raise UsageError(f"a continuation of {n_continuation} tokens does not fit max_len {max_len}; raise "
                         "--max-len")
    ids = np.concatenate([[tokenizer.bos_id], context_ids, continuation_ids]).astype(np.int32)
    return ids[-max_len:], n_continuation


def make_score_fn(model, *, max_len: int, batch_size: int = 8, tokenizer=None
                  ) -> Callable[[list[str], list[str]], list[tuple[float, int, bool]]]:
    """A `smelt_jax.analysis.tasks` scorer backed by `model` (a Decoder).

    Each (context, continuation) becomes one row (see `encode_pair`), padded with segment id 0 (padding
    attends only to padding, so it changes nothing). Rows run `batch_size` at a time in one jitted forward;
    lengths are padded to powers of two. Returns, per pair, (sum of the continuation tokens' log-probs,
    their count, whether each is the argmax).
    """
    from flax import nnx

    from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER

    tokenizer = tokenizer or DEFAULT_TOKENIZER
    forward = nnx.jit(_forward_logprobs)

    def score_fn(contexts: list[str], continuations: list[str]) -> list[tuple[float, int, bool]]:
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        encoded = [encode_pair(c, x, tokenizer, max_len) for c, x in zip(contexts, continuations)]
        results: list[tuple[float, int, bool]] = []
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            width = _padded_length(max(ids.size for ids, _ in chunk), max_len)
            tokens = np.full((batch_size, width), tokenizer.pad_id, np.int32)
            targets = np.zeros((batch_size, width), np.int32)
            segments = np.zeros((batch_size, width), np.int32)
            positions = np.zeros((batch_size, width), np.int32)
            for row, (ids, _) in enumerate(chunk):
                n = ids.size
                tokens[row, :n], targets[row, :n - 1] = ids, ids[1:]
                segments[row, :n], positions[row, :n] = 1, np.arange(n)
            logprobs, greedy = (np.asarray(a) for a in forward(model, tokens, segments, positions, targets))
            for row, (ids, n_continuation) in enumerate(chunk):
                # the continuation's tokens are ids[n - m:]; position i predicts ids[i + 1]
                predicting = slice(ids.size - n_continuation - 1, ids.size - 1)
                results.append((float(logprobs[row, predicting].sum(dtype=np.float64)), n_continuation,
                                bool(greedy[row, predicting].all())))
        return results

    return score_fn


def evaluate_dyck(score_fn, shots: Sequence[int] = DEFAULT_DYCK_SHOTS, n_examples: int = 64,
                  seed: int = 0, config: dyck_lib.DyckConfig | None = None) -> pd.DataFrame:
    """k-shot Dyck: exact match (every continuation token greedy) and continuation cross-entropy.

    The same `n_examples` queries at every shot count (see `analysis.dyck`). Columns as `dyck_table`.
    """
    config = config or dyck_lib.DyckConfig()
    results = []
    for k in shots:
        examples = dyck_lib.make_examples(seed, n_examples, int(k), config)
        scores = score_fn([e.context for e in examples], [e.continuation for e in examples])
        results.append((k, [greedy for _, _, greedy in scores], [-s / n for s, n, _ in scores]))
    return dyck_table(results)


# ---------------------------------------------------------------------------------------------------------
# Validation loss


def _token_losses(model, tokens, segment_ids, positions, targets):
    logprobs, _ = _forward_logprobs(model, tokens, segment_ids, positions, targets)
    return -logprobs


def validation_report(model, corpus, *, seq_len: int, max_tokens: int | None = None, batch_size: int = 8,
                      edges: Sequence[int] = LENGTH_BUCKETS) -> dict[str, Any]:
    """Validation loss of `model` on `corpus`: overall, per source and per document-length bucket.

    Reads each source's validation split packed as in training evaluation (`data.pipeline.ValidationSet`,
    the first `max_tokens` tokens per source). Returns {'overall': float, 'by_source': DataFrame (source,
    n_tokens, loss), 'by_length': DataFrame (see `loss_by_length_bucket`, all sources together),
    'by_source_length': the same per source (with a `source` column)}. Losses are nats per token,
    token-weighted.
    """
    from flax import nnx

    from smelt_jax.data.pipeline import validation_sets

    token_loss_fn = nnx.jit(_token_losses)
    losses, lengths, documents, sources = [], [], [], []
    for source_index, (source, vset) in enumerate(validation_sets(
            corpus, batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens,
            host_index=0, host_count=1).items()):
        for index in range(len(vset)):
            batch = vset.batch_at(index)
            rows = index * vset.batch_size + np.arange(vset.batch_size)
            token_loss = np.asarray(token_loss_fn(model, batch["tokens"], batch["segment_ids"],
                                                  batch["positions"], batch["targets"]))
            doc, length = validation_document_lengths(vset.cumulative, vset.table.length, rows, seq_len)
            mask = batch["loss_mask"] > 0
            losses.append(token_loss[mask])
            lengths.append(length[mask])
            documents.append(doc[mask] + source_index * (1 << 40))  # unique across sources
            sources.append(np.full(int(mask.sum()), source, dtype=object))
    if not losses:
        raise UsageError("the corpus has no validation documents")
    losses, lengths = np.concatenate(losses).astype(np.float64), np.concatenate(lengths)
    documents, sources = np.concatenate(documents), np.concatenate(sources)
    by_source = (pd.DataFrame({"source": sources, "loss": losses}).groupby("source", sort=True)["loss"]
                 .agg(n_tokens="size", loss="mean").reset_index())
    per_source_length = []
    for source in by_source["source"]:
        pick = sources == source
        table = loss_by_length_bucket(losses[pick], lengths[pick], documents[pick], edges)
        table.insert(0, "source", source)
        per_source_length.append(table)
    return {"overall": float(losses.mean()), "n_tokens": int(losses.size), "by_source": by_source,
            "by_length": loss_by_length_bucket(losses, lengths, documents, edges),
            "by_source_length": pd.concat(per_source_length, ignore_index=True)}


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN/inf: None for non-finite numbers."""
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------------------
# Everything for one checkpoint


def task_specs(paths: Sequence[str]) -> list:
    """TaskSpecs from task files (.jsonl: one task named after the file, kind inferred) and registries
    (.yaml/.yml/.json: `analysis.tasks.load_registry`)."""
    from smelt_jax.analysis import tasks as tasks_lib

    specs = []
    for path in paths:
        suffix = Path(path).suffix.lower()
        if suffix in (".yaml", ".yml", ".json"):
            specs += tasks_lib.load_registry(path)
        else:
            kind, _ = tasks_lib.read_task_file(path)
            specs.append(tasks_lib.TaskSpec(name=Path(path).stem, path=str(path), kind=kind))
    return specs


def evaluate_model(model, corpus=None, *, seq_len: int, eval_tokens: int | None = 16_384,
                   task_paths: Sequence[str] = (), dyck_shots: Sequence[int] = (),
                   dyck_examples: int = 64, max_len: int | None = None, batch_size: int = 8) -> dict[str, Any]:
    """Validation report (when `corpus` is given), Dyck per shot count (when `dyck_shots`, e.g.
    DEFAULT_DYCK_SHOTS), task files. `max_len`: see effective_max_len. What it will cost:
    analysis.eval_estimate.estimate_eval with the same arguments.

    Returns {'validation': validation_report(...) or None, 'dyck': DataFrame or None, 'tasks': DataFrame
    or None, 'dclm_core': float or None}.
    """
    from smelt_jax.analysis import tasks as tasks_lib

    out: dict[str, Any] = {"validation": None, "dyck": None, "tasks": None, "dclm_core": None}
    if corpus is not None:
        out["validation"] = validation_report(model, corpus, seq_len=seq_len, max_tokens=eval_tokens,
                                              batch_size=batch_size)
    score_fn = make_score_fn(model, max_len=effective_max_len(max_len, seq_len), batch_size=batch_size)
    if dyck_shots:
        out["dyck"] = evaluate_dyck(score_fn, dyck_shots, n_examples=dyck_examples)
    if task_paths:
        out["tasks"] = tasks_lib.evaluate_tasks(task_specs(task_paths), score_fn, batch_size=batch_size)
        out["dclm_core"] = tasks_lib.dclm_core(out["tasks"])
    return out


def report_to_json(report: dict[str, Any]) -> dict[str, Any]:
    """`evaluate_model`'s result as plain JSON (tables as lists of records, NaN/inf as null)."""
    def records(table: pd.DataFrame | None):
        if table is None:
            return None
        return [{k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}
                for row in table.to_dict("records")]

    validation = report["validation"]
    return {
        "validation": None if validation is None else {
            "overall": validation["overall"], "n_tokens": validation["n_tokens"],
            "by_source": records(validation["by_source"]), "by_length": records(validation["by_length"]),
            "by_source_length": records(validation["by_source_length"])},
        "dyck": records(report["dyck"]), "tasks": records(report["tasks"]), "dclm_core": report["dclm_core"],
    }

"""Offline scoring of local task files (language modelling and multiple choice), for any model.

File formats (JSON Lines, one example per line; blank lines are skipped):

- language modelling (`kind="lm"`): `{"context": str, "continuation": str}`. Correct when every continuation
  token is the model's greedy choice (exact match).
- multiple choice (`kind="mc"`): `{"context": str, "choices": [str, ...], "gold": int}` (`"query"` is read
  as `"context"`, the spelling of llm-foundry's files). Each choice is scored as a continuation of the
  context.

The model enters only through `score_fn(contexts, continuations) -> [(sum_logprob, n_tokens, is_greedy)]`:
for each pair, the model reads `context + continuation` (concatenated verbatim, so a leading space belongs
to the continuation) and returns the summed log-probability of the continuation's tokens, their number, and
whether every one of them is the argmax. Per-task options (`TaskSpec`) add few-shot demonstrations drawn
from the same file and a delimiter between context and continuation.

Metrics per task: `acc` (MC: highest summed log-prob; LM: exact match), `acc_norm` (MC: highest mean
log-prob per token; LM: same as acc), `centered = (score - rho) / (1 - rho)` with rho the task's random
baseline (MC default: mean of 1/n_choices over the file's examples; LM default: 0), where `score` is the
task's `metric` (`acc_norm` by default for MC: DCLM's llm-foundry scorer picks the choice with the lowest
per-token cross-entropy). DCLM Core = unweighted mean of `centered` over tasks. Ties pick the first choice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from smelt_jax.platform.errors import SmeltError, UsageError

ScoreFn = Callable[[list[str], list[str]], Sequence[tuple[float, int, bool]]]
TASK_KINDS = ("lm", "mc")
METRICS = ("acc", "acc_norm")


class TaskFileError(SmeltError, ValueError):
    """A task file or registry that cannot be read: names the file and line."""


@dataclasses.dataclass(frozen=True)
class LMExample:
    context: str
    continuation: str


@dataclasses.dataclass(frozen=True)
class MCExample:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task: its file, kind and scoring options.

    random_baseline: rho in [0, 1), or None for the kind's default. metric: which accuracy enters `centered`
    (None: `acc_norm` for MC, `acc` for LM). num_fewshot demonstrations (context + gold continuation) are
    drawn without replacement from the other examples of the file, deterministically from `seed` and the
    example's index, and joined with `example_delimiter` before the example's context.
    """

    name: str
    path: str
    kind: str
    random_baseline: float | None = None
    metric: str | None = None
    num_fewshot: int = 0
    continuation_delimiter: str = ""
    example_delimiter: str = "\n"
    seed: int = 0

    def __post_init__(self):
        if not self.name:
            raise TaskFileError("TaskSpec.name must be non-empty")
        if self.kind not in TASK_KINDS:
            raise TaskFileError(f"task {self.name!r}: kind must be one of {TASK_KINDS}, got {self.kind!r}")
        if self.random_baseline is not None and not 0.0 <= self.random_baseline < 1.0:
            raise TaskFileError(
                f"task {self.name!r}: random_baseline must be in [0, 1), got {self.random_baseline}"
            )
        if self.metric is not None and self.metric not in METRICS:
            raise TaskFileError(f"task {self.name!r}: metric must be one of {METRICS}, got {self.metric!r}")
        if self.num_fewshot < 0:
            raise TaskFileError(f"task {self.name!r}: num_fewshot must be >= 0, got {self.num_fewshot}")

    @property
    def scored_metric(self) -> str:
        if self.metric is not None:
            return self.metric
        return "acc_norm" if self.kind == "mc" else "acc"


# ---------------------------------------------------------------------------------------------------------
# Reading


def _require(condition: bool, path: str, line: int, message: str) -> None:
    if not condition:
        raise TaskFileError(f"{path}:{line}: {message}")


def _parse_record(record: object, kind: str, path: str, line: int) -> LMExample | MCExample:
    _require(isinstance(record, dict), path, line, f"expected a JSON object, got {type(record).__name__}")
    if kind == "lm":
        for key in ("context", "continuation"):
            _require(key in record, path, line, f"language-modelling record lacks {key!r}")
            _require(isinstance(record[key], str), path, line, f"{key!r} must be a string")
        _require(record["continuation"] != "", path, line, "'continuation' is empty")
        return LMExample(record["context"], record["continuation"])
    has_context, has_query = "context" in record, "query" in record
    _require(
        has_context != has_query,
        path,
        line,
        "multiple-choice record needs exactly one of 'context' or 'query'",
    )
    context = record["context" if has_context else "query"]
    _require(isinstance(context, str), path, line, "'context' must be a string")
    _require("choices" in record, path, line, "multiple-choice record lacks 'choices'")
    choices = record["choices"]
    _require(
        isinstance(choices, list) and len(choices) >= 2,
        path,
        line,
        "'choices' must be a list of >= 2 strings",
    )
    _require(
        all(isinstance(c, str) and c != "" for c in choices),
        path,
        line,
        "every choice must be a non-empty string",
    )
    _require("gold" in record, path, line, "multiple-choice record lacks 'gold'")
    gold = record["gold"]
    _require(isinstance(gold, int) and not isinstance(gold, bool), path, line, "'gold' must be an integer")
    _require(0 <= gold < len(choices), path, line, f"'gold' = {gold} is outside [0, {len(choices)})")
    return MCExample(context, tuple(choices), gold)


def infer_kind(record: dict) -> str:
    """'mc' if the record has 'choices', 'lm' if it has 'continuation'."""
    if "choices" in record:
        return "mc"
    if "continuation" in record:
        return "lm"
    raise TaskFileError("cannot tell the task kind: the record has neither 'choices' nor 'continuation'")


def read_task_file(
    path: str | os.PathLike, kind: str | None = None
) -> tuple[str, list[LMExample | MCExample]]:
    """(kind, examples) of a JSONL task file; `kind=None` infers it from the first record.

    Raises TaskFileError naming `path:line` for invalid JSON, missing or mistyped fields, a gold index out of
    range, records of a different kind, or a file without examples.
    """
    path = os.fspath(path)
    examples: list[LMExample | MCExample] = []
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except OSError as error:
        raise TaskFileError(f"{path}: cannot open: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise TaskFileError(f"{path}: not UTF-8 text: {error.reason}") from error
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TaskFileError(f"{path}:{line_number}: invalid JSON: {error.msg}") from error
        if kind is None:
            _require(isinstance(record, dict), path, line_number, "expected a JSON object")
            try:
                kind = infer_kind(record)
            except ValueError as error:
                raise TaskFileError(f"{path}:{line_number}: {error}") from error
        _require(kind in TASK_KINDS, path, line_number, f"kind must be one of {TASK_KINDS}, got {kind!r}")
        examples.append(_parse_record(record, kind, path, line_number))
    if not examples:
        raise TaskFileError(f"{path}: no examples")
    return kind, examples


def load_registry(path: str | os.PathLike) -> list[TaskSpec]:
    """Task specs from a YAML or JSON registry: `{"tasks": [{name, path, kind, random_baseline?, ...}, ...]}`.

    Relative task paths are resolved against the registry's folder. Unknown fields are errors.
    """
    import yaml  # local: only registries need it

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as error:
        raise TaskFileError(f"{path}: cannot open: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise TaskFileError(f"{path}: invalid YAML/JSON: {error}") from error
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), list) or not data["tasks"]:
        raise TaskFileError(f"{path}: expected a mapping with a non-empty 'tasks' list")
    fields = {f.name for f in dataclasses.fields(TaskSpec)}
    base = os.path.dirname(os.path.abspath(path))
    specs = []
    for index, entry in enumerate(data["tasks"]):
        if not isinstance(entry, dict):
            raise TaskFileError(f"{path}: tasks[{index}] must be a mapping")
        unknown = sorted(set(entry) - fields)
        if unknown:
            raise TaskFileError(f"{path}: tasks[{index}] has unknown field(s) {unknown}")
        entry = dict(entry)
        if "path" in entry and isinstance(entry["path"], str) and not os.path.isabs(entry["path"]):
            entry["path"] = os.path.join(base, entry["path"])
        try:
            specs.append(TaskSpec(**entry))
        except (TypeError, ValueError) as error:
            raise TaskFileError(f"{path}: tasks[{index}]: {error}") from error
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise TaskFileError(f"{path}: duplicate task names")
    return specs


# ---------------------------------------------------------------------------------------------------------
# Scoring


def _gold_continuation(example: LMExample | MCExample) -> str:
    return example.continuation if isinstance(example, LMExample) else example.choices[example.gold]


def build_contexts(spec: TaskSpec, examples: Sequence[LMExample | MCExample]) -> list[str]:
    """The prompt for each example: `num_fewshot` solved demonstrations, then its own context and delimiter."""
    n = len(examples)
    if spec.num_fewshot and spec.num_fewshot > n - 1:
        raise TaskFileError(f"task {spec.name!r}: num_fewshot={spec.num_fewshot} needs more than {n} examples")
    contexts = []
    for index, example in enumerate(examples):
        prefix = ""
        if spec.num_fewshot:
            rng = np.random.default_rng([spec.seed, index])
            others = rng.choice(n - 1, size=spec.num_fewshot, replace=False)
            picks = [int(i) + (int(i) >= index) for i in others]  # skip the example itself
            prefix = "".join(
                examples[i].context
                + spec.continuation_delimiter
                + _gold_continuation(examples[i])
                + spec.example_delimiter
                for i in picks
            )
        contexts.append(prefix + example.context + spec.continuation_delimiter)
    return contexts


def _call_scorer(score_fn: ScoreFn, contexts: list[str], continuations: list[str], batch_size: int):
    results: list[tuple[float, int, bool]] = []
    for start in range(0, len(contexts), batch_size):
        batch_contexts = contexts[start : start + batch_size]
        scored = list(score_fn(batch_contexts, continuations[start : start + batch_size]))
        if len(scored) != len(batch_contexts):
            raise ValueError(f"score_fn returned {len(scored)} results for {len(batch_contexts)} inputs")
        for item in scored:
            if len(item) != 3:
                raise ValueError(
                    f"score_fn must return (sum_logprob, n_tokens, is_greedy) triples, got {item!r}"
                )
            sum_logprob, n_tokens, is_greedy = float(item[0]), int(item[1]), bool(item[2])
            if n_tokens < 1 or not math.isfinite(sum_logprob):
                raise ValueError(
                    f"score_fn returned an invalid score {item!r} (need n_tokens >= 1, finite log-prob)"
                )
            results.append((sum_logprob, n_tokens, is_greedy))
    return results


def score_examples(
    spec: TaskSpec, examples: Sequence[LMExample | MCExample], score_fn: ScoreFn, batch_size: int = 64
) -> pd.DataFrame:
    """Per-example results: one row per example with `correct` (acc) and `correct_norm` (acc_norm)."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    contexts = build_contexts(spec, examples)
    flat_contexts: list[str] = []
    flat_continuations: list[str] = []
    owners: list[int] = []
    for index, (context, example) in enumerate(zip(contexts, examples, strict=True)):
        continuations = [example.continuation] if isinstance(example, LMExample) else list(example.choices)
        flat_contexts += [context] * len(continuations)
        flat_continuations += continuations
        owners += [index] * len(continuations)
    scores = _call_scorer(score_fn, flat_contexts, flat_continuations, batch_size)
    rows = []
    cursor = 0
    for index, example in enumerate(examples):
        if isinstance(example, LMExample):
            _, _, is_greedy = scores[cursor]
            cursor += 1
            rows.append({"index": index, "n_choices": 0, "correct": is_greedy, "correct_norm": is_greedy})
            continue
        n = len(example.choices)
        chunk = scores[cursor : cursor + n]
        cursor += n
        summed = np.array([s for s, _, _ in chunk])
        per_token = np.array([s / t for s, t, _ in chunk])
        rows.append(
            {
                "index": index,
                "n_choices": n,
                "correct": int(np.argmax(summed)) == example.gold,
                "correct_norm": int(np.argmax(per_token)) == example.gold,
            }
        )
    return pd.DataFrame(rows)


def default_random_baseline(kind: str, examples: Sequence[LMExample | MCExample]) -> float:
    """MC: the mean over examples of 1/n_choices (a uniform guess's expected accuracy). LM: 0."""
    if kind == "lm":
        return 0.0
    return float(np.mean([1.0 / len(example.choices) for example in examples]))


def centered_accuracy(accuracy: float, random_baseline: float) -> float:
    """(acc - rho) / (1 - rho): 0 at chance, 1 at perfect; negative below chance."""
    if not 0.0 <= random_baseline < 1.0:
        raise TaskFileError(f"random_baseline must be in [0, 1), got {random_baseline}")
    return (accuracy - random_baseline) / (1.0 - random_baseline)


def evaluate_task(spec: TaskSpec, score_fn: ScoreFn, batch_size: int = 64) -> dict[str, object]:
    """One task's summary row: task, kind, n_examples, acc, acc_norm, metric, random_baseline, centered."""
    kind, examples = read_task_file(spec.path, spec.kind)
    per_example = score_examples(spec, examples, score_fn, batch_size)
    acc = float(per_example["correct"].mean())
    acc_norm = float(per_example["correct_norm"].mean())
    rho = (
        spec.random_baseline if spec.random_baseline is not None else default_random_baseline(kind, examples)
    )
    score = acc if spec.scored_metric == "acc" else acc_norm
    return {
        "task": spec.name,
        "kind": kind,
        "n_examples": len(examples),
        "num_fewshot": spec.num_fewshot,
        "acc": acc,
        "acc_norm": acc_norm,
        "metric": spec.scored_metric,
        "random_baseline": rho,
        "centered": centered_accuracy(score, rho),
    }


def evaluate_tasks(specs: Sequence[TaskSpec], score_fn: ScoreFn, batch_size: int = 64) -> pd.DataFrame:
    """A tidy table, one row per task (see `evaluate_task`)."""
    if not specs:
        raise UsageError("no tasks to evaluate")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise TaskFileError(f"duplicate task names in {names}")
    return pd.DataFrame([evaluate_task(spec, score_fn, batch_size) for spec in specs])


def dclm_core(results: pd.DataFrame) -> float:
    """DCLM Core: the unweighted mean of `centered` over the tasks of an `evaluate_tasks` table."""
    if results.empty or "centered" not in results:
        raise UsageError("need an evaluate_tasks table with a 'centered' column and at least one task")
    if results["task"].duplicated().any():
        raise UsageError("each task must appear once")
    return float(results["centered"].mean())

"""A synthetic Dyck in-context task in the BIG-bench `dyck_languages` format, generated locally.

One example (the paper's §8 example)::

    context:      "Complete the rest of the sequence, making sure that the parentheses are closed properly. Input: [ { ["
    continuation: " ] } ]"          (target "] } ]" after the continuation delimiter " ")

The input is a prefix of a Dyck word over the bracket pairs `() [] {} <>` (tokens separated by one space);
it may contain already-closed pairs (`< > ( [ ] (`) and always leaves at least one bracket open. The target
is the unique shortest completion: the open brackets' closers, innermost first.

A k-shot prompt joins k solved demonstrations and the query with `example_delimiter`::

    demo_1.context + " " + demo_1.target + "\\n" + ... + demo_k.target + "\\n" + query.context

and the model scores `continuation = " " + query.target` after it (text = context + continuation, verbatim;
the same convention as `smelt_jax.analysis.tasks`). Query `i` of seed `s` depends only on `(s, i)`; its
demonstrations come from a separate stream of `(s, i)`, so the first k demonstrations are the same for
every shot count >= k (a shot sweep changes only how much context each query gets).

Scoring takes per-token quantities of the continuation (the model's tokenisation is its own business):
exact match = every continuation token is the argmax; cross-entropy = mean negative log-prob per token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from smelt_jax.platform.errors import UsageError

INSTRUCTION = (
    "Complete the rest of the sequence, making sure that the parentheses are closed properly. Input:"
)
BRACKET_PAIRS: tuple[tuple[str, str], ...] = (("(", ")"), ("[", "]"), ("{", "}"), ("<", ">"))
MAX_SHOTS = 32

_CLOSER_OF = dict(BRACKET_PAIRS)
_OPENER_OF = {close: open_ for open_, close in BRACKET_PAIRS}


@dataclasses.dataclass(frozen=True)
class DyckConfig:
    """How Dyck inputs are drawn.

    Input lengths (tokens of the bracket sequence, before the target) are uniform over the feasible lengths in
    `[min_length, max_length]`; the nesting depth never exceeds `max_depth`; each opening bracket is one of the
    first `n_pair_types` pairs of `BRACKET_PAIRS`, uniformly; at a free step the walk opens with probability
    `p_open`. Every input ends with at least one open bracket (a non-empty target).
    """

    min_length: int = 3
    max_length: int = 20
    max_depth: int = 6
    n_pair_types: int = 4
    p_open: float = 0.5
    example_delimiter: str = "\n"
    continuation_delimiter: str = " "

    def __post_init__(self):
        if self.min_length < 1:
            raise UsageError(f"DyckConfig.min_length must be >= 1, got {self.min_length}")
        if self.max_length < self.min_length:
            raise UsageError(f"DyckConfig.max_length ({self.max_length}) < min_length ({self.min_length})")
        if self.max_depth < 1:
            raise UsageError(f"DyckConfig.max_depth must be >= 1, got {self.max_depth}")
        if not 1 <= self.n_pair_types <= len(BRACKET_PAIRS):
            raise UsageError(
                f"DyckConfig.n_pair_types must be in [1, {len(BRACKET_PAIRS)}], got {self.n_pair_types}"
            )
        if not 0.0 < self.p_open < 1.0:
            raise UsageError(f"DyckConfig.p_open must be in (0, 1), got {self.p_open}")
        if not self.feasible_lengths():
            raise UsageError(
                f"DyckConfig: no input length in [{self.min_length}, {self.max_length}] can end with an open "
                f"bracket at max_depth={self.max_depth} (with max_depth=1 the length must be odd)"
            )

    def feasible_lengths(self) -> tuple[int, ...]:
        return tuple(
            n for n in range(self.min_length, self.max_length + 1) if _can_finish_open(0, n, self.max_depth)
        )


@dataclasses.dataclass(frozen=True)
class DyckExample:
    """One k-shot query.

    `query` is the bracket input ("[ { ["), `target` its closing sequence ("] } ]"); `context` is the full
    prompt (demonstrations + this query's instruction and input); `continuation` is what the model must
    produce after `context` (the delimiter then the target). `demo_answer_spans` are the character spans
    `[start, end)` of every demonstration's target inside `context` (to map onto token positions for the
    Dyck-head analysis); `demos` are the (input, target) pairs shown.
    """

    query: str
    target: str
    context: str
    continuation: str
    demos: tuple[tuple[str, str], ...]
    demo_answer_spans: tuple[tuple[int, int], ...]

    def to_lm_record(self) -> dict[str, str]:
        """The example as a language-modelling JSONL record for `smelt_jax.analysis.tasks`."""
        return {"context": self.context, "continuation": self.continuation}


@functools.cache
def _can_finish_open(depth: int, remaining: int, max_depth: int) -> bool:
    """Whether a walk at `depth` with `remaining` steps can end at depth >= 1 without leaving [0, max_depth]."""
    if remaining == 0:
        return depth >= 1
    up = depth < max_depth and _can_finish_open(depth + 1, remaining - 1, max_depth)
    down = depth > 0 and _can_finish_open(depth - 1, remaining - 1, max_depth)
    return up or down


def closing_sequence(tokens: Sequence[str]) -> list[str]:
    """The shortest completion of a Dyck prefix: the closers of its open brackets, innermost first.

    Raises ValueError if `tokens` is not a valid prefix (unknown token, or a closer that does not match).
    """
    stack: list[str] = []
    for position, token in enumerate(tokens):
        if token in _CLOSER_OF:
            stack.append(token)
        elif token in _OPENER_OF:
            if not stack or stack[-1] != _OPENER_OF[token]:
                raise UsageError(f"not a Dyck prefix: {token!r} at position {position} closes nothing open")
            stack.pop()
        else:
            raise UsageError(f"not a bracket token: {token!r} at position {position}")
    return [_CLOSER_OF[token] for token in reversed(stack)]


def is_balanced(tokens: Sequence[str]) -> bool:
    """Whether `tokens` is a complete Dyck word (every bracket closed by its own kind, properly nested)."""
    try:
        return not closing_sequence(tokens)
    except ValueError:
        return False


def is_valid_example(query: str, target: str) -> bool:
    """Whether `query + target` is balanced and `target` is exactly the closing sequence of `query`.

    Both are space-separated bracket strings; an empty target is invalid (the task always asks for closers).
    """
    query_tokens, target_tokens = query.split(), target.split()
    try:
        expected = closing_sequence(query_tokens)
    except ValueError:
        return False
    return bool(target_tokens) and target_tokens == expected and is_balanced(query_tokens + target_tokens)


def sample_input(rng: np.random.Generator, config: DyckConfig) -> list[str]:
    """One bracket input (a Dyck prefix with >= 1 open bracket) drawn from `rng` under `config`."""
    lengths = config.feasible_lengths()
    length = lengths[int(rng.integers(len(lengths)))]
    pairs = BRACKET_PAIRS[: config.n_pair_types]
    stack: list[str] = []
    tokens: list[str] = []
    for step in range(length):
        remaining = length - step - 1
        depth = len(stack)
        can_open = depth < config.max_depth and _can_finish_open(depth + 1, remaining, config.max_depth)
        can_close = depth > 0 and _can_finish_open(depth - 1, remaining, config.max_depth)
        opens = can_open and (not can_close or rng.random() < config.p_open)
        if opens:
            opener = pairs[int(rng.integers(len(pairs)))][0]
            stack.append(opener)
            tokens.append(opener)
        else:
            tokens.append(_CLOSER_OF[stack.pop()])
    return tokens


def _solved_pair(rng: np.random.Generator, config: DyckConfig) -> tuple[str, str]:
    tokens = sample_input(rng, config)
    return " ".join(tokens), " ".join(closing_sequence(tokens))


def make_example(seed: int, index: int, shots: int, config: DyckConfig = DyckConfig()) -> DyckExample:
    """Query `index` of `seed` with `shots` demonstrations (0 <= shots <= MAX_SHOTS); deterministic."""
    if not 0 <= shots <= MAX_SHOTS:
        raise UsageError(f"shots must be in [0, {MAX_SHOTS}], got {shots}")
    if seed < 0 or index < 0:
        raise UsageError(f"seed and index must be non-negative, got seed={seed}, index={index}")
    query, target = _solved_pair(np.random.default_rng([seed, index, 0]), config)
    demo_rng = np.random.default_rng([seed, index, 1])
    demos: list[tuple[str, str]] = []
    rejected_in_a_row = 0
    while len(demos) < shots:
        demo = _solved_pair(demo_rng, config)
        if demo[0] != query:  # a demonstration that is the query itself would give the answer away
            demos.append(demo)
            rejected_in_a_row = 0
            continue
        rejected_in_a_row += 1
        if rejected_in_a_row == 1000:
            raise UsageError(f"{config} admits too few distinct inputs to draw demonstrations unlike the query")
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for demo_input, demo_target in demos:
        head = f"{INSTRUCTION} {demo_input}{config.continuation_delimiter}"
        start = offset + len(head)
        spans.append((start, start + len(demo_target)))
        piece = head + demo_target + config.example_delimiter
        pieces.append(piece)
        offset += len(piece)
    context = "".join(pieces) + f"{INSTRUCTION} {query}"
    return DyckExample(
        query=query,
        target=target,
        context=context,
        continuation=config.continuation_delimiter + target,
        demos=tuple(demos),
        demo_answer_spans=tuple(spans),
    )


def make_examples(
    seed: int, n_examples: int, shots: int, config: DyckConfig = DyckConfig()
) -> list[DyckExample]:
    """Queries `0 .. n_examples-1` of `seed`, each with `shots` demonstrations."""
    if n_examples < 0:
        raise UsageError(f"n_examples must be non-negative, got {n_examples}")
    return [make_example(seed, index, shots, config) for index in range(n_examples)]


def char_spans_to_token_mask(token_offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Which tokens overlap any character span: the bridge from `demo_answer_spans` to key positions.

    token_offsets: [seq, 2] character offsets [start, end) of each token in the text (a tokenizer's offset
    mapping); spans: [start, end) character ranges. Returns bool [seq].
    """
    token_offsets = np.asarray(token_offsets)
    if token_offsets.ndim != 2 or token_offsets.shape[-1] != 2:
        raise ValueError(f"token_offsets must be [seq, 2], got {token_offsets.shape}")
    mask = np.zeros(token_offsets.shape[0], dtype=bool)
    for start, end in spans:
        mask |= (token_offsets[:, 0] < end) & (token_offsets[:, 1] > start)
    return mask


# ---------------------------------------------------------------------------------------------------------
# Scoring


def exact_match(target_ids: np.ndarray, argmax_ids: np.ndarray) -> bool:
    """Correct only if every continuation token is the model's argmax.

    target_ids, argmax_ids: [n_tokens] integer token ids of the continuation and of the model's argmax at
    each of those positions (the prediction made from the preceding tokens). Empty continuations are an error.
    """
    target_ids, argmax_ids = np.asarray(target_ids), np.asarray(argmax_ids)
    if target_ids.ndim != 1 or target_ids.shape != argmax_ids.shape:
        raise ValueError(
            f"target_ids and argmax_ids must be equal 1-d shapes, got {target_ids.shape}, {argmax_ids.shape}"
        )
    if target_ids.size == 0:
        raise ValueError("empty continuation")
    return bool(np.all(target_ids == argmax_ids))


def continuation_cross_entropy(target_logprobs: np.ndarray) -> float:
    """Mean negative log-probability (nats per token) of the continuation tokens.

    target_logprobs: [n_tokens] log p(target token | prefix) at each continuation position (all <= 0).
    """
    target_logprobs = np.asarray(target_logprobs, dtype=np.float64)
    if target_logprobs.ndim != 1 or target_logprobs.size == 0:
        raise ValueError(f"target_logprobs must be a non-empty 1-d array, got shape {target_logprobs.shape}")
    if np.any(target_logprobs > 1e-6) or not np.all(np.isfinite(target_logprobs)):
        raise ValueError("target_logprobs must be finite log-probabilities (<= 0)")
    return float(-target_logprobs.mean())


def score_from_logits(logits: np.ndarray, target_ids: np.ndarray) -> tuple[bool, float]:
    """(exact match, cross-entropy) of one continuation from the logits that predict its tokens.

    logits: [n_tokens, vocab], row t predicting target_ids[t]; target_ids: [n_tokens].
    """
    logits = np.asarray(logits, dtype=np.float64)
    target_ids = np.asarray(target_ids)
    if logits.ndim != 2 or logits.shape[0] != target_ids.shape[0] or target_ids.ndim != 1:
        raise ValueError(
            f"logits must be [n_tokens, vocab] matching target_ids [n_tokens]; got {logits.shape}, {target_ids.shape}"
        )
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    target_logprobs = log_probs[np.arange(target_ids.shape[0]), target_ids]
    return exact_match(target_ids, logits.argmax(axis=-1)), continuation_cross_entropy(target_logprobs)


def summarize_scores(exact_matches: Sequence[bool], cross_entropies: Sequence[float]) -> dict[str, float]:
    """Task-level Dyck scores: exact-match accuracy and mean per-example continuation cross-entropy."""
    if len(exact_matches) != len(cross_entropies) or not exact_matches:
        raise ValueError("need equally many (and at least one) exact matches and cross-entropies")
    return {
        "n_examples": float(len(exact_matches)),
        "exact_match": float(np.mean(np.asarray(exact_matches, dtype=np.float64))),
        "cross_entropy": float(np.mean(np.asarray(cross_entropies, dtype=np.float64))),
    }

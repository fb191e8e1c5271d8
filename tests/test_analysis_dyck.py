"""The synthetic Dyck task: valid, deterministic examples in the BIG-bench format, and its scoring."""

import numpy as np
import pytest

from smelt_jax.analysis import dyck


def test_paper_example_is_valid_and_its_target_is_the_closing_sequence():
    assert dyck.closing_sequence(["[", "{", "["]) == ["]", "}", "]"]
    assert dyck.is_valid_example("[ { [", "] } ]")
    assert dyck.is_valid_example("< > ( [ ] (", ") )")
    assert not dyck.is_valid_example("[ { [", "] ] }")  # wrong order
    assert not dyck.is_valid_example("[ { [", "] }")  # incomplete
    assert not dyck.is_valid_example("( )", "")  # nothing left open
    assert not dyck.is_valid_example("( ]", ")")  # not a prefix
    assert not dyck.is_balanced(["(", "[", ")", "]"])
    assert dyck.is_balanced(["(", "[", "{", "<", ">", "}", "]", ")"])


@pytest.mark.parametrize(
    "config",
    [
        dyck.DyckConfig(),
        dyck.DyckConfig(min_length=1, max_length=9, max_depth=1),
        dyck.DyckConfig(max_length=40, max_depth=3, n_pair_types=2),
    ],
)
def test_generated_examples_are_valid_and_respect_the_config(config):
    used_pairs = {open_ for open_, _ in dyck.BRACKET_PAIRS[: config.n_pair_types]}
    for example in dyck.make_examples(seed=3, n_examples=60, shots=2, config=config):
        tokens = example.query.split()
        assert dyck.is_valid_example(example.query, example.target)
        assert config.min_length <= len(tokens) <= config.max_length
        depth, max_seen = 0, 0
        for token in tokens:
            depth += 1 if token in dict(dyck.BRACKET_PAIRS) else -1
            max_seen = max(max_seen, depth)
        assert max_seen <= config.max_depth
        assert {t for t in tokens if t in dict(dyck.BRACKET_PAIRS)} <= used_pairs
        assert example.continuation == " " + example.target
        for demo_input, demo_target in example.demos:
            assert dyck.is_valid_example(demo_input, demo_target)


def test_prompt_layout_and_demo_answer_spans():
    example = dyck.make_example(seed=0, index=5, shots=3)
    assert example.context.endswith(f"{dyck.INSTRUCTION} {example.query}")
    assert example.context.count(dyck.INSTRUCTION) == 4
    lines = example.context.split("\n")
    assert len(lines) == 4
    for line, (demo_input, demo_target), (start, end) in zip(lines, example.demos, example.demo_answer_spans):
        assert line == f"{dyck.INSTRUCTION} {demo_input} {demo_target}"
        assert example.context[start:end] == demo_target
    assert example.to_lm_record() == {"context": example.context, "continuation": example.continuation}
    zero_shot = dyck.make_example(seed=0, index=5, shots=0)
    assert zero_shot.context == f"{dyck.INSTRUCTION} {zero_shot.query}" and zero_shot.demo_answer_spans == ()


def test_deterministic_by_seed_and_shot_sweeps_share_queries_and_demos():
    first = dyck.make_examples(seed=11, n_examples=20, shots=32)
    again = dyck.make_examples(seed=11, n_examples=20, shots=32)
    other = dyck.make_examples(seed=12, n_examples=20, shots=32)
    assert first == again
    assert [e.query for e in first] != [e.query for e in other]
    fewer = dyck.make_examples(seed=11, n_examples=20, shots=4)
    for many, few in zip(first, fewer):
        assert many.query == few.query and many.demos[:4] == few.demos
        assert many.query not in [d for d, _ in many.demos]
    # the generator draws varied inputs, not one repeated example
    assert len({e.query for e in first}) > 15


def test_config_and_shot_errors():
    with pytest.raises(ValueError, match="odd"):
        dyck.DyckConfig(min_length=2, max_length=2, max_depth=1)
    with pytest.raises(ValueError, match="max_length"):
        dyck.DyckConfig(min_length=5, max_length=4)
    with pytest.raises(ValueError, match="shots"):
        dyck.make_example(0, 0, shots=33)
    only_one_input = dyck.DyckConfig(min_length=1, max_length=1, max_depth=1, n_pair_types=1)
    assert dyck.make_example(0, 0, shots=0, config=only_one_input).target == ")"
    with pytest.raises(ValueError, match="too few distinct inputs"):
        dyck.make_example(0, 0, shots=1, config=only_one_input)


def test_scoring_exact_match_and_cross_entropy():
    assert dyck.exact_match(np.array([3, 1, 4]), np.array([3, 1, 4]))
    assert not dyck.exact_match(np.array([3, 1, 4]), np.array([3, 1, 5]))
    assert dyck.continuation_cross_entropy(np.log([0.5, 0.25])) == pytest.approx((np.log(2) + np.log(4)) / 2)
    # logits: token 0 is argmax at step 0 with p = e^2/(e^2+2); at step 1 the target (2) is not the argmax
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    correct, ce = dyck.score_from_logits(logits, np.array([0, 2]))
    p0 = np.exp(2) / (np.exp(2) + 2)
    p1 = 1 / (2 + np.e)
    assert not correct
    assert ce == pytest.approx(-(np.log(p0) + np.log(p1)) / 2)
    assert dyck.score_from_logits(logits, np.array([0, 1]))[0]
    summary = dyck.summarize_scores([True, False, True, True], [0.1, 0.2, 0.3, 0.4])
    assert summary["exact_match"] == 0.75 and summary["cross_entropy"] == pytest.approx(0.25)
    with pytest.raises(ValueError):
        dyck.continuation_cross_entropy(np.array([0.5]))  # not a log-probability


def test_char_spans_to_token_mask():
    # tokens of "ab cd ef" split as "ab", " cd", " ef"
    offsets = np.array([[0, 2], [2, 5], [5, 8]])
    assert dyck.char_spans_to_token_mask(offsets, [(3, 5)]).tolist() == [False, True, False]
    assert dyck.char_spans_to_token_mask(offsets, [(0, 1), (6, 8)]).tolist() == [True, False, True]

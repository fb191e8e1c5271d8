"""The offline task runner on hand-made files with a hand-made scorer: accuracies, centered accuracy, DCLM Core."""

import json

import pytest

from smelt_jax.analysis import dyck, tasks

# Multiple choice. Per choice: (summed log-prob, n tokens). Chosen so that summed and per-token argmaxes differ:
#   Q1 gold 0: sum picks " a" (right), per-token picks " ccc" (-0.5/token; wrong)
#   Q2 gold 1: sum picks " x" (wrong),  per-token picks " y" (-0.75/token; right)
#   Q3 gold 2: sum picks " r" (right), per-token picks " s" (wrong)
MC_RECORDS = [
    {"context": "Q1:", "choices": [" a", " bb", " ccc"], "gold": 0},
    {"query": "Q2:", "choices": [" x", " y"], "gold": 1},
    {"context": "Q3:", "choices": [" p", " q", " r", " s"], "gold": 2},
]
MC_SCORES = {
    ("Q1:", " a"): (-2.0, 1),
    ("Q1:", " bb"): (-3.0, 2),
    ("Q1:", " ccc"): (-2.5, 5),
    ("Q2:", " x"): (-1.0, 1),
    ("Q2:", " y"): (-3.0, 4),
    ("Q3:", " p"): (-5.0, 1),
    ("Q3:", " q"): (-5.0, 1),
    ("Q3:", " r"): (-2.0, 1),
    ("Q3:", " s"): (-3.0, 6),
}
# Language modelling: greedy on 3 of 4.
LM_RECORDS = [{"context": f"L{i}", "continuation": f" w{i}"} for i in range(4)]
LM_GREEDY = {("L0", " w0"): True, ("L1", " w1"): False, ("L2", " w2"): True, ("L3", " w3"): True}


class FakeScorer:
    """Looks every (context, continuation) up in hand-made tables; unknown pairs fail the test."""

    def __init__(self):
        self.calls = []

    def __call__(self, contexts, continuations):
        self.calls.append(len(contexts))
        out = []
        for context, continuation in zip(contexts, continuations):
            if (context, continuation) in MC_SCORES:
                total, n = MC_SCORES[(context, continuation)]
                out.append((total, n, False))
            else:
                out.append((-1.0, 1, LM_GREEDY[(context, continuation)]))
        return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def files(tmp_path):
    return write_jsonl(tmp_path / "mc.jsonl", MC_RECORDS), write_jsonl(tmp_path / "lm.jsonl", LM_RECORDS)


def test_multiple_choice_accuracies_and_centered(files):
    mc_path, _ = files
    row = tasks.evaluate_task(tasks.TaskSpec("mc", mc_path, "mc"), FakeScorer(), batch_size=4)
    assert row["acc"] == pytest.approx(2 / 3)
    assert row["acc_norm"] == pytest.approx(1 / 3)
    rho = (1 / 3 + 1 / 2 + 1 / 4) / 3  # mean 1/n_choices = 13/36
    assert row["random_baseline"] == pytest.approx(rho)
    assert row["metric"] == "acc_norm"
    assert row["centered"] == pytest.approx((1 / 3 - rho) / (1 - rho))  # = -1/23: below chance
    by_sum = tasks.evaluate_task(
        tasks.TaskSpec("mc", mc_path, "mc", metric="acc", random_baseline=0.25), FakeScorer()
    )
    assert by_sum["centered"] == pytest.approx((2 / 3 - 0.25) / 0.75)


def test_language_modelling_exact_match_and_dclm_core(files):
    mc_path, lm_path = files
    scorer = FakeScorer()
    specs = [
        tasks.TaskSpec("mc", mc_path, "mc", metric="acc"),
        tasks.TaskSpec("lm", lm_path, "lm", random_baseline=0.5),
    ]
    table = tasks.evaluate_tasks(specs, scorer, batch_size=4)
    lm_row = table.set_index("task").loc["lm"]
    assert lm_row["acc"] == 0.75 and lm_row["random_baseline"] == 0.5
    assert lm_row["centered"] == pytest.approx(0.5)
    mc_centered = (2 / 3 - 13 / 36) / (1 - 13 / 36)
    assert tasks.dclm_core(table) == pytest.approx((mc_centered + 0.5) / 2)
    assert scorer.calls == [4, 4, 1, 4]  # 9 choices then 4 continuations, in batches of 4
    lm_default = tasks.evaluate_task(tasks.TaskSpec("lm", lm_path, "lm"), FakeScorer())
    assert lm_default["random_baseline"] == 0.0 and lm_default["centered"] == 0.75


def test_fewshot_contexts_use_other_examples_deterministically(files):
    _, lm_path = files
    _, examples = tasks.read_task_file(lm_path)
    spec = tasks.TaskSpec(
        "lm", lm_path, "lm", num_fewshot=2, continuation_delimiter="=", example_delimiter="|", seed=7
    )
    contexts = tasks.build_contexts(spec, examples)
    assert contexts == tasks.build_contexts(spec, examples)
    for index, context in enumerate(contexts):
        demos = context.split("|")
        assert demos[-1] == f"L{index}="
        assert len(demos) == 3 and len(set(demos[:2])) == 2
        for demo in demos[:2]:
            assert demo.startswith("L") and demo != f"L{index}= w{index}"
            other = int(demo[1])
            assert demo == f"L{other}= w{other}"
    with pytest.raises(ValueError, match="num_fewshot"):
        tasks.build_contexts(tasks.TaskSpec("lm", lm_path, "lm", num_fewshot=4), examples)


def test_dyck_examples_run_through_the_lm_runner(tmp_path):
    examples = dyck.make_examples(seed=0, n_examples=5, shots=2)
    path = write_jsonl(tmp_path / "dyck.jsonl", [e.to_lm_record() for e in examples])
    right = {e.query for e in examples[:2]}

    def scorer(contexts, continuations):
        return [(-0.1, 3, any(c.endswith(q) for q in right)) for c in contexts]

    row = tasks.evaluate_task(tasks.TaskSpec("dyck", path, "lm"), scorer)
    assert row["acc"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    "lines, kind, message",
    [
        ([json.dumps(MC_RECORDS[0]), "{not json"], None, r"bad\.jsonl:2: invalid JSON"),
        (
            [json.dumps(MC_RECORDS[0]), "", json.dumps({"context": "c", "choices": [" a", " b"]})],
            None,
            r":3: .*lacks 'gold'",
        ),
        (
            [json.dumps({"context": "c", "choices": [" a", " b"], "gold": 2})],
            None,
            r":1: 'gold' = 2 is outside",
        ),
        (
            [json.dumps({"context": "c", "choices": [" a"], "gold": 0})],
            None,
            r":1: 'choices' must be a list of >= 2",
        ),
        (
            [json.dumps(LM_RECORDS[0]), json.dumps(MC_RECORDS[0])],
            None,
            r":2: language-modelling record lacks 'continuation'",
        ),
        ([json.dumps({"text": "x"})], None, r":1: cannot tell the task kind"),
        ([json.dumps(["context"])], "lm", r":1: expected a JSON object"),
        ([json.dumps({"context": "c", "continuation": 3})], "lm", r":1: 'continuation' must be a string"),
        (["", "  "], None, r"bad\.jsonl: no examples"),
    ],
)
def test_malformed_files_name_the_line(tmp_path, lines, kind, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(tasks.TaskFileError, match=message):
        tasks.read_task_file(path, kind)


def test_registry_and_scorer_errors(tmp_path, files):
    mc_path, lm_path = files
    registry = tmp_path / "tasks.yaml"
    registry.write_text(
        "tasks:\n  - {name: mc, path: mc.jsonl, kind: mc, random_baseline: 0.25}\n  - {name: lm, path: lm.jsonl, kind: lm}\n"
    )
    specs = tasks.load_registry(registry)
    assert [s.path for s in specs] == [mc_path, lm_path] and specs[0].random_baseline == 0.25
    registry.write_text("tasks:\n  - {name: mc, path: mc.jsonl, kind: mc, weight: 2}\n")
    with pytest.raises(tasks.TaskFileError, match="unknown field"):
        tasks.load_registry(registry)
    registry.write_text("tasks:\n  - {name: mc, path: mc.jsonl, kind: mc, random_baseline: 25}\n")
    with pytest.raises(tasks.TaskFileError, match=r"random_baseline must be in \[0, 1\)"):
        tasks.load_registry(registry)
    with pytest.raises(ValueError, match="returned 0 results"):
        tasks.evaluate_task(tasks.TaskSpec("lm", lm_path, "lm"), lambda contexts, continuations: [])
    with pytest.raises(ValueError, match="n_tokens >= 1"):
        tasks.evaluate_task(tasks.TaskSpec("lm", lm_path, "lm"), lambda c, k: [(0.0, 0, True)] * len(c))


def test_centered_accuracy_bounds():
    assert tasks.centered_accuracy(0.25, 0.25) == 0.0
    assert tasks.centered_accuracy(1.0, 0.25) == 1.0
    with pytest.raises(ValueError):
        tasks.centered_accuracy(0.5, 1.0)

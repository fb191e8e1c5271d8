"""Evaluation and analyses on real (tiny) models: length buckets, the model scorer, a trained run end to end."""

import json

import jax
import numpy as np
import pandas as pd
import pytest
from flax import nnx

from smelt_jax.analysis import evaluate as ev
from smelt_jax.analysis import run_analysis as ra
from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.model import Decoder
from tests.data_helpers import build_tiny_corpus

MODEL = ModelConfig(vocab=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                    n_experts=4, top_k=2, expert_ffn=32, loop_start=1, loop_length=1,
                    loop_repeats=2, seq_len=32)
SCHEDULE = Schedule(batch_size=4, seq_len=32, stable_steps=2, fork_steps=(2,), decay_steps=2,
                    warmup_steps=1, peak_lr=3e-3)


# ---------------------------------------------------------------------------------------------------------
# Pure pieces


def test_length_buckets_on_a_constructed_case():
    lengths = np.array([1, 32, 33, 64, 65, 4096, 5000, 100])
    losses = np.array([1.0, 3.0, 2.0, 4.0, 10.0, 7.0, 9.0, 20.0])
    docs = np.array([0, 1, 2, 3, 4, 5, 6, 4])  # ids only count documents: two tokens of "doc 4" in 128
    table = ev.loss_by_length_bucket(losses, lengths, docs).set_index("bucket")
    assert list(table.index) == [32, 64, 128, 256, 512, 1024, 2048, 4096, np.inf]
    assert table.loc[32, "loss"] == 2.0 and table.loc[32, "n_tokens"] == 2  # lengths 1 and 32
    assert table.loc[64, "loss"] == 3.0  # lengths 33 and 64
    assert table.loc[128, "loss"] == 15.0 and table.loc[128, "n_documents"] == 1
    assert table.loc[4096, "loss"] == 7.0 and table.loc[np.inf, "loss"] == 9.0
    assert table.loc[256, "n_tokens"] == 0 and np.isnan(table.loc[256, "loss"])
    assert table["n_tokens"].sum() == lengths.size
    no_overflow = ev.loss_by_length_bucket(losses[:6], lengths[:6])
    assert np.inf not in set(no_overflow["bucket"]) and "n_documents" not in no_overflow
    with pytest.raises(ValueError, match="one entry per token"):
        ev.loss_by_length_bucket(losses, lengths[:3])
    with pytest.raises(ValueError, match=">= 1"):
        ev.length_bucket(np.array([0]))


def test_validation_document_lengths_follow_the_stream():
    lengths = np.array([3, 5, 2])  # stream: 0 0 0 1 1 1 1 1 2 2
    cumulative = np.concatenate([[0], np.cumsum(lengths)])
    index, length = ev.validation_document_lengths(cumulative, lengths, np.array([0, 1, 2]), seq_len=4)
    np.testing.assert_array_equal(index, [[0, 0, 0, 1], [1, 1, 1, 1], [2, 2, -1, -1]])
    np.testing.assert_array_equal(length, [[3, 3, 3, 5], [5, 5, 5, 5], [2, 2, 0, 0]])


def test_analysis_captures_renumber_visits_and_drop_extra_ones():
    model_captures = {(0, 0): {"topk_ids": np.zeros((1, 2, 2)), "residual": np.ones(1)},
                      (1, 0): {"dx_attn": np.ones(3)}, (1, 1): {"dx_attn": np.ones(3)},
                      (1, 2): {"dx_attn": np.ones(3)}}
    out = ra.analysis_captures(model_captures)
    assert sorted(out) == [(0, 1), (1, 1), (1, 2)]
    assert "residual" not in out[(0, 1)] and "topk_ids" in out[(0, 1)]


# ---------------------------------------------------------------------------------------------------------
# The model scorer


@pytest.fixture(scope="module")
def random_model():
    return Decoder(MODEL, rngs=nnx.Rngs(3))


@nnx.jit
def _logits(model, tokens, segment_ids, positions):
    return model(tokens, segment_ids, positions)[0]


def _manual_score(model, context, continuation):
    ids = np.concatenate([[DEFAULT_TOKENIZER.bos_id], DEFAULT_TOKENIZER.encode(context),
                          DEFAULT_TOKENIZER.encode(continuation)]).astype(np.int32)
    n = ids.size
    logits = _logits(model, ids[None], np.ones((1, n), np.int32), np.arange(n, dtype=np.int32)[None])
    row = np.asarray(logits[0], np.float64)
    log_probs = row - row.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    m = len(DEFAULT_TOKENIZER.encode(continuation))
    positions = np.arange(n - m - 1, n - 1)  # position i predicts ids[i + 1]
    picked = log_probs[positions, ids[positions + 1]]
    greedy = np.all(np.asarray(logits[0]).argmax(-1)[positions] == ids[positions + 1])
    return picked.sum(), m, bool(greedy)


def test_model_score_fn_equals_a_manual_log_prob_computation(random_model):
    contexts = ["Input: [ {", "x", "a longer context with some more bytes in it ("]
    continuations = [" } ]", "yz", " )"]
    score_fn = ev.make_score_fn(random_model, max_len=128, batch_size=2)  # 3 pairs: a padded batch
    scores = score_fn(contexts, continuations)
    for (total, n, greedy), context, continuation in zip(scores, contexts, continuations):
        want_total, want_n, want_greedy = _manual_score(random_model, context, continuation)
        assert n == want_n
        assert total == pytest.approx(want_total, abs=1e-4)
        assert total < 0
        assert greedy == want_greedy


def test_score_fn_greedy_flag_and_truncation(random_model):
    # the model's own greedy continuation must be flagged greedy
    context = "abc"
    ids = np.concatenate([[DEFAULT_TOKENIZER.bos_id], DEFAULT_TOKENIZER.encode(context)]).astype(np.int32)
    logits, _ = random_model(ids[None], np.ones((1, ids.size), np.int32),
                             np.arange(ids.size, dtype=np.int32)[None])
    next_id = int(np.asarray(logits[0, -1]).argmax())
    if next_id < 256:  # a byte: expressible as a continuation string only if valid UTF-8 on its own
        text = bytes([next_id]).decode("latin-1")
        if len(text.encode("utf-8")) == 1:
            assert ev.make_score_fn(random_model, max_len=64)([context], [text])[0][2]
    ids, m = ev.encode_pair("0123456789", "ab", DEFAULT_TOKENIZER, max_len=6)
    assert m == 2 and DEFAULT_TOKENIZER.decode(ids) == "6789ab" and ids[0] != DEFAULT_TOKENIZER.bos_id
    with pytest.raises(ValueError, match="does not fit"):
        ev.encode_pair("c", "abcdefgh", DEFAULT_TOKENIZER, max_len=6)


def test_head_ablation_removes_exactly_that_heads_output(random_model):
    ablated = ra.ablate_head(random_model, layer=1, head=1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (1, 16)).astype(np.int32)
    segments, positions = np.ones_like(tokens), np.arange(16, dtype=np.int32)[None]
    capture = ra._capture_fn()
    original = ra.analysis_captures(capture(random_model, tokens, segments, positions))
    removed = ra.analysis_captures(capture(ablated, tokens, segments, positions))
    wo = np.asarray(random_model.loop.attention.wo[...])[0]  # [h, hd, d]
    for visit in (1, 2):
        pv = removed[(1, visit)]["pv"]
        np.testing.assert_allclose(removed[(1, visit)]["attn_out"],
                                   np.einsum("bse,ed->bsd", pv[:, :, 0], wo[0]), atol=1e-5)
    # the prefix layer runs before any ablated head: identical; the original's head 1 is not silent
    np.testing.assert_array_equal(original[(0, 1)]["attn_out"], removed[(0, 1)]["attn_out"])
    assert np.abs(np.einsum("bse,ed->bsd", original[(1, 1)]["pv"][:, :, 1], wo[1])).max() > 1e-4
    assert float(np.abs(np.asarray(random_model.loop.attention.wo[...])[0, 1]).sum()) > 0  # untouched
    with pytest.raises(ValueError, match="outside the looped span"):
        ra.ablate_head(random_model, layer=0, head=0)


# ---------------------------------------------------------------------------------------------------------
# A trained run, end to end


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from smelt_jax.train.trainer import TrainOptions, train
    root = tmp_path_factory.mktemp("runs")
    corpus = build_tiny_corpus(tmp_path_factory.mktemp("corpus"))
    run = RunSpec(suite="unit", scale="tiny", sparsity_label="s50", arch="smelt", model=MODEL,
                  schedule=SCHEDULE, control=MODEL.replace(n_experts=2), pair_id="unit-tiny")
    train(run, root=root, corpus=corpus,
          options=TrainOptions(log_every=1, checkpoint_every=2, progress=False, peak_flops=1e12, devices=1))
    return run, root, corpus


def test_eval_of_a_trained_run_matches_the_trainer_and_is_consistent(trained, tmp_path):
    from smelt_jax.train.step import make_eval_step
    from smelt_jax.train.trainer import TrainOptions, evaluate
    run, root, corpus = trained
    loaded = ev.load_model(run.id, root=root)
    assert loaded.step == 2 and loaded.branch is None
    by_path = ev.load_model(str(root / "unit" / run.id / "stable" / "checkpoints" / "2"))
    assert by_path.step == 2
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in [
        {"context": "ab", "choices": [" c", " d", " e"], "gold": 0},
        {"context": "x", "choices": [" y", " zz"], "gold": 1}]) + "\n")
    report = ev.evaluate_model(loaded.model, corpus, seq_len=32, eval_tokens=256, task_paths=[str(task)],
                               dyck_shots=(0, 1), dyck_examples=3, max_len=512, batch_size=4)
    graphdef, params = nnx.split(loaded.model)
    reference = evaluate(jax.jit(make_eval_step(graphdef, MODEL)), params, corpus, 32,
                         TrainOptions(eval_tokens=256, eval_batch_size=4))
    validation = report["validation"]
    assert validation["overall"] == pytest.approx(reference["overall"], rel=1e-5)
    by_source = validation["by_source"].set_index("source")["loss"]
    for source, loss in by_source.items():
        assert loss == pytest.approx(reference[source], rel=1e-5)
    by_length = validation["by_length"]
    assert by_length["n_tokens"].sum() == validation["n_tokens"]
    used = by_length[by_length["n_tokens"] > 0]
    weighted = (used["loss"] * used["n_tokens"]).sum() / used["n_tokens"].sum()
    assert weighted == pytest.approx(validation["overall"], rel=1e-9)
    assert set(by_length["bucket"]) >= set(map(float, ev.LENGTH_BUCKETS))
    dyck = report["dyck"]
    assert list(dyck["shots"]) == [0, 1] and (dyck["n_examples"] == 3).all()
    assert dyck["exact_match"].between(0, 1).all() and (dyck["cross_entropy"] > 0).all()
    tasks = report["tasks"]
    assert list(tasks["task"]) == ["task"] and tasks.loc[0, "n_examples"] == 2
    assert report["dclm_core"] == pytest.approx(tasks.loc[0, "centered"])
    payload = ev.report_to_json(report)
    json.dumps(payload)  # plain JSON (no NaN objects)
    assert payload["validation"]["by_length"][0]["bucket"] == 32


def test_cli_eval_json_and_analyze_csvs(trained, tmp_path, capsys):
    from smelt_jax.cli import main
    run, root, corpus = trained
    code = main(["eval", run.id, "--runs-dir", str(root), "--data-dir", str(corpus.root), "--json",
                 "--dyck-shots", "1", "--dyck-examples", "2", "--eval-tokens", "128", "--max-len", "512"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["step"] == 2 and payload["dyck"][0]["shots"] == 1
    assert payload["validation"]["overall"] > 0
    assert main(["eval", run.id, "--runs-dir", str(root), "--branch", "0", "--no-validation"]) == 2
    assert "no checkpoints" in capsys.readouterr().err


def test_analyses_end_to_end_on_the_trained_looped_model(trained, tmp_path):
    run, root, corpus = trained
    model = ev.load_model(run.id, root=root).model
    tables = ra.analysis_tables(model, corpus, n_tokens=256, seq_len=32, batch_size=4, attention_rows=4,
                                gu_rows_count=4, dyck_shots=1, dyck_examples=2)
    overlap = tables["routing_overlap"]
    assert list(overlap["layer"]) == [1] and overlap.loc[0, "n_tokens"] == 256
    assert 0 <= overlap.loc[0, "mean_overlap"] <= MODEL.top_k
    assert overlap.loc[0, "random_reference"] == MODEL.top_k ** 2 / MODEL.n_experts
    ratios = tables["residual_write_ratios"]
    assert len(ratios) == 3 and (ratios["ratio"] > 0).all()
    np.testing.assert_allclose(ratios["ratio"], ratios["norm_visit2"] / ratios["norm_visit1"])
    assert tables["residual_write_cosines"]["mean_cosine"].between(-1, 1).all()
    stages = tables["attention_stage_cosines"]
    assert list(stages["stage"]) == ["normed_input", "q", "k", "v", "pv", "attn_out"]
    assert stages["mean_cosine"].between(-1, 1 + 1e-9).all()
    assert stages.set_index("stage").loc["q", "n_vectors"] == 256 * MODEL.n_heads
    attended = tables["attended_token_overlap"]
    assert set(attended["pair"]) == {"same_head", "control_head"}
    assert attended["mean_overlap"].between(0, 1).all() and (attended["n_queries"] == 4 * (32 - 7)).all()
    sinks = tables["attention_sink_mass"]
    assert len(sinks) == (MODEL.n_layers + MODEL.loop_length) * MODEL.n_heads
    assert sinks["sink_mass"].between(0, 1).all()
    gu = tables["gu_sink_rate"].set_index("scope")
    assert list(gu.index) == ["all", "visit 1", "visit 2"] and gu["sink_rate"].between(0, 1).all()
    assert gu.loc["all", "n_heads"] == (MODEL.n_layers + MODEL.loop_length) * MODEL.n_heads
    ablation = tables["dyck_head_ablation"]
    assert len(ablation) == MODEL.loop_length * MODEL.n_heads and list(ablation["rank"]) == [0, 1]
    assert ablation["loss_increase"].is_monotonic_decreasing
    heads = tables["dyck_head_attention"]
    assert list(heads["visit"]) == [1, 2]
    np.testing.assert_allclose(heads[["bos_mass", "demo_answer_mass", "other_mass"]].sum(axis=1), 1, atol=1e-5)
    assert (heads[["bos_mass", "demo_answer_mass"]] >= 0).all().all()
    paths = ra.write_tables(tables, tmp_path / "out")
    assert len(paths) == len(tables)
    assert pd.read_csv(tmp_path / "out" / "routing_overlap.csv").shape == overlap.shape


# ---------------------------------------------------------------------------------------------------------
# Cheap defaults and the estimate printed before an evaluation (issue 26 E)


def _eval_args(*argv):
    from smelt_jax.cli import build_parser
    return build_parser().parse_args(["eval", "some-run", *argv])


def test_eval_defaults_are_cheap():
    """Dyck (0/1/4/32 shots x 64 at --max-len 4096) took 15 min and 11 GB on a smoke model: it runs
    only when asked, and texts stop at the run's training context."""
    from smelt_jax.cli.eval import parse_shots
    args = _eval_args()
    assert parse_shots(args.dyck_shots) == ()
    assert args.max_len is None and ev.effective_max_len(args.max_len, 256) == 256
    assert parse_shots(_eval_args("--dyck-shots", "0", "1", "4", "32").dyck_shots) == ev.DEFAULT_DYCK_SHOTS
    assert ev.effective_max_len(512, 256) == 512


def test_estimate_counts_the_passes_the_evaluation_runs(trained, monkeypatch):
    """The estimate's Dyck widths are the ones the scorer pads to, batch by batch; its validation
    batches are the ValidationSets'."""
    from smelt_jax.analysis.eval_estimate import estimate_eval
    from smelt_jax.data.pipeline import validation_sets
    run, root, corpus = trained
    model = ev.load_model(run.id, root=root).model
    kwargs = dict(seq_len=32, eval_tokens=256, dyck_shots=(0, 4), dyck_examples=5, max_len=128, batch_size=2)
    estimate = estimate_eval(MODEL, corpus, rate=1e10, **kwargs)
    used = []
    real = ev._padded_length
    monkeypatch.setattr(ev, "_padded_length", lambda n, limit: used.append(real(n, limit)) or used[-1])
    ev.evaluate_model(model, corpus, **kwargs)
    sets = validation_sets(corpus, batch_size=2, seq_len=32, max_tokens=256, host_index=0, host_count=1)
    assert estimate.validation_passes == sum(len(v) for v in sets.values()) > 0
    assert estimate.dyck_passes == len(used) == 2 * 3  # 5 examples in chunks of 2, per shot count
    assert set(estimate.widths) == set(used) | {32}
    assert estimate.tokens == 2 * (32 * estimate.validation_passes + sum(used))
    assert estimate.programs == 1 + len(set(used))
    assert "estimated ~" in estimate.line() and "GB peak memory" in estimate.line()
    cheap = estimate_eval(MODEL, corpus, rate=1e10, **{**kwargs, "dyck_shots": ()})
    assert cheap.dyck_passes == 0 and cheap.seconds < estimate.seconds


def test_estimate_flags_the_old_defaults_on_a_smoke_model():
    """On the smoke model the issue measured (2.5M parameters): the default evaluation is estimated
    under 1 GB; the old one (Dyck at 0/1/4/32 shots, 4096 tokens) at several GB and far longer."""
    import experiments
    from smelt_jax.analysis.eval_estimate import estimate_eval
    cfg = experiments.find_run("smoke-xs-s85-baseline-4e0a0a85").model
    new = estimate_eval(cfg, seq_len=256, eval_tokens=16_384, dyck_shots=(), dyck_examples=64,
                        max_len=None, batch_size=8, rate=5e10)
    old = estimate_eval(cfg, seq_len=256, eval_tokens=16_384, dyck_shots=ev.DEFAULT_DYCK_SHOTS,
                        dyck_examples=64, max_len=4096, batch_size=8, rate=5e10)
    assert new.peak_bytes < 2**30 < 3 * 2**30 < old.peak_bytes
    assert old.seconds > 10 * max(new.seconds, 1.0) and max(old.widths) >= 2048


@pytest.mark.integration
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_smelt_eval_defaults_print_the_estimate_and_stay_small(trained, tmp_path):
    """`smelt eval RUN` with defaults in a child process: the estimate on stderr before the tables,
    no Dyck, and a peak RSS under 1 GB (the child's VmHWM; Linux)."""
    import os
    import subprocess
    import sys
    run, root, corpus = trained
    # VmHWM: the peak RSS of the process since its exec (getrusage's ru_maxrss would also count the
    # forked copy of this pytest process before the exec)
    script = ("import sys; from smelt_jax.cli import main; "
              f"code = main(['eval', {run.id!r}, '--runs-dir', {str(root)!r}, '--data-dir', "
              f"{str(corpus.root)!r}, '--json']); "
              "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr); "
              "sys.exit(code)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user has
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "estimated ~" in proc.stderr and "Dyck" not in proc.stderr.split("estimated")[0]
    payload = json.loads(proc.stdout)
    assert payload["dyck"] is None and payload["validation"]["overall"] > 0
    peak_kib = int(proc.stderr.split("VmHWM:")[1].split()[0])
    assert 0 < peak_kib * 1024 < 2**30, f"peak RSS {peak_kib / 1024:.0f} MiB"

"""Data is part of a run: run.json and every checkpoint's metadata record the token store's digest and
the tokenizer's sha256; a resume or a branch without --data-dir trains on the recorded store and refuses
another one (one line, exit 2); old runs without the record keep working; the local sweep passes its
--data-dir to every job; `smelt sweep status` shows each run's data."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from data_helpers import build_tiny_corpus

from smelt_jax.run_files import run_data
from smelt_jax.run_files.checkpoint_format import committed_steps, step_metadata
from smelt_jax.cli import main
from smelt_jax.run_files.rundir import run_dir
from tests.custom_run_helpers import TINY_SPEC, saved_run, skip_training, tiny_run, write_spec_file


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two different tiny token stores (fewer source files: other tokens, another digest)."""
    base = tmp_path_factory.mktemp("stores")
    a = build_tiny_corpus(base / "a")
    from data_helpers import tiny_config, write_fake_tree

    from smelt_jax.data.corpus import build_corpus
    from smelt_jax.data.token_store import TokenStore
    b = TokenStore(build_corpus(base / "b" / "corpus", tiny_config(write_fake_tree(base / "b", 16)),
                                progress=False).folder)
    assert a.digest != b.digest
    return a, b


def _train(*args: str) -> int:
    return main(["train", *args, "--quiet", "--no-tensorboard", "--log-every", "1"])


@pytest.mark.integration
def test_trained_run_records_its_data_and_resumes_on_it(tmp_path, stores, capsys):
    """End to end (compiles the tiny model: ~20-60 s on a busy 2-core CPU)."""
    a, b = stores
    spec, runs = write_spec_file(tmp_path / "run.json", TINY_SPEC), tmp_path / "runs"
    run = tiny_run()
    assert _train("--config", str(spec), "--runs-dir", str(runs), "--data-dir", a.root,
                  "--stop-after", "2") == 42
    rd = run_dir(run.suite, run.id, runs)
    data = json.loads(rd.spec_file.read_text())["data"]
    assert data == {"store_digest": a.digest, "tokenizer_sha256": a.tokenizer.sha256, "path": a.root}
    step = committed_steps(rd.checkpoints(None))[-1]
    meta = step_metadata(rd.checkpoints(None), step)
    assert meta["data_digest"] == a.digest and meta["tokenizer_sha256"] == a.tokenizer.sha256
    assert meta["step"] == step == 2
    # run.json rewritten to name store b: the checkpoint's own record still refuses b on restore
    record = json.loads(rd.spec_file.read_text())
    rd.spec_file.write_text(json.dumps({**record, "data": run_data.describe(b)}))
    capsys.readouterr()
    assert _train(run.id, "--runs-dir", str(runs), "--data-dir", b.root, "--stop-after", "3") == 2
    err = capsys.readouterr().err
    assert "its checkpoint at step 2" in err and a.digest[:12] in err and b.digest[:12] in err, err
    assert committed_steps(rd.checkpoints(None))[-1] == 2  # nothing trained, nothing moved aside
    rd.spec_file.write_text(json.dumps(record))
    assert _train(run.id, "--branch", "0", "--runs-dir", str(runs), "--data-dir", b.root) == 2
    assert "refusing" in capsys.readouterr().err
    # no --data-dir: the recorded store (the embedded corpus is never built in the tests)
    assert _train(run.id[:26], "--runs-dir", str(runs)) == 0
    assert _train(run.id, "--branch", "0", "--runs-dir", str(runs)) == 0
    assert rd.endpoint(0).is_file()
    assert step_metadata(rd.checkpoints(0), 4)["data_digest"] == a.digest
    # eval without --data-dir reads the recorded store too (the embedded corpus is not built here)
    capsys.readouterr()
    assert main(["eval", run.id, "--branch", "0", "--runs-dir", str(runs), "--eval-tokens", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["validation"]["n_tokens"] > 0


def test_resume_and_branch_use_the_recorded_store_and_refuse_another(tmp_path, stores, capsys,
                                                                      monkeypatch):
    a, b = stores
    phases = skip_training(monkeypatch)
    spec, runs = write_spec_file(tmp_path / "run.yaml", TINY_SPEC), tmp_path / "runs"
    run = tiny_run()
    assert _train("--config", str(spec), "--runs-dir", str(runs), "--data-dir", a.root) == 0
    assert phases[-1].corpus.root == a.root
    assert json.loads(run_dir(run.suite, run.id, runs).spec_file.read_text())["data"]["path"] == a.root
    capsys.readouterr()
    # another store: refused before any work, one line naming both digests and both paths
    for branch in ([], ["--branch", "0"]):
        assert _train(run.id, *branch, "--runs-dir", str(runs), "--data-dir", b.root) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert a.digest[:12] in err and b.digest[:12] in err and a.root in err and b.root in err
    assert len(phases) == 1
    # no --data-dir: the recorded store (the embedded corpus would fail: it is never built here)
    assert _train(run.id[:26], "--branch", "0", "--runs-dir", str(runs)) == 0
    assert phases[-1].corpus.root == a.root and phases[-1].branch == 0
    assert phases[-1].data["store_digest"] == a.digest
    # the same store at another path is the same data: accepted
    copy = tmp_path / "copy"
    shutil.copytree(a.root, copy)
    assert _train(run.id, "--branch", "1", "--runs-dir", str(runs), "--data-dir", str(copy)) == 0
    assert phases[-1].corpus.root == str(copy)


def test_eval_and_analyze_read_the_recorded_store_unless_told_otherwise(tmp_path, stores, capsys):
    from smelt_jax.data.corpus import open_dataset

    a, b = stores
    run = tiny_run()
    spec = saved_run(tmp_path / "runs", run, data=run_data.describe(a))  # run.json as a trainer writes it
    assert run_data.evaluation_data(run.id, spec, data_dir=None, open_store=open_dataset).root == a.root
    assert capsys.readouterr().err == ""
    # another store is allowed for evaluation, and said once, naming both
    assert run_data.evaluation_data(run.id, spec, data_dir=b.root, open_store=open_dataset).root == b.root
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and a.digest[:12] in err and b.digest[:12] in err
    # nothing recorded: the given store, or the embedded default (open_store(None))
    spec = saved_run(tmp_path / "runs", run)
    assert run_data.evaluation_data(run.id, spec, data_dir=None,
                                    open_store=lambda path: path or "default") == "default"


def test_an_old_run_without_a_record_is_not_checked(tmp_path, stores, capsys, monkeypatch):
    a, b = stores
    phases = skip_training(monkeypatch)
    run, runs = tiny_run(dict(TINY_SPEC, scale="old")), tmp_path / "runs"
    spec_file = saved_run(runs, run)  # run.json as trainers wrote it before runs recorded their data
    before = spec_file.read_text()
    write_spec_file(tmp_path / "run.json", dict(TINY_SPEC, scale="old"))
    for data_dir in (a.root, b.root):
        assert _train(run.id, "--runs-dir", str(runs), "--data-dir", data_dir) == 0
    assert [p.corpus.root for p in phases] == [a.root, b.root]
    err = capsys.readouterr().err
    assert err.count("records no token store") == 1, err
    assert spec_file.read_text() == before  # run.json is kept as it was


def test_check_names_both_sides():
    recorded = {"store_digest": "a" * 64, "tokenizer_sha256": "t" * 64, "path": "/data/a"}
    same = {**recorded, "path": "/elsewhere/a"}
    run_data.check_same_data("r1", recorded, same)  # same digest elsewhere: the same data
    with pytest.raises(run_data.DataChanged) as err:
        run_data.check_same_data("r1", recorded, {**recorded, "store_digest": "b" * 64, "path": "/data/b"})
    text = str(err.value)
    assert "\n" not in text and "aaaaaaaaaaaa" in text and "bbbbbbbbbbbb" in text and "/data/b" in text
    run_data.check_same_data("r1", None, same)  # nothing recorded: no check


def test_a_checkpoint_saved_on_other_data_is_refused():
    current = {"store_digest": "a" * 64, "tokenizer_sha256": "t" * 64, "path": "/data/a"}
    run_data.check_checkpoint_data("r1", 7, {"data_digest": "a" * 64, "tokenizer_sha256": "t" * 64}, current)
    run_data.check_checkpoint_data("r1", 7, {"step": 7}, current)  # saved before checkpoints recorded data
    with pytest.raises(run_data.DataChanged) as err:
        run_data.check_checkpoint_data("r1", 7, {"data_digest": "b" * 64, "tokenizer_sha256": "u" * 64}, current)
    text = str(err.value)
    assert "its checkpoint at step 7" in text and "bbbbbbbbbbbb" in text and "aaaaaaaaaaaa" in text
    assert "tokenizer" in text and "\n" not in text


def test_local_sweep_passes_the_store_to_every_job(tmp_path, monkeypatch):
    from smelt_jax.sweep import local
    from smelt_jax.sweep.graph import suite_graph

    seen = {}
    monkeypatch.setattr(local.LocalBackend, "submit",
                        lambda self, graph: seen.update(commands=[local.job_command(j, self.settings)
                                                                  for j in graph.jobs]) or 0)
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "local", "--runs-dir",
                 str(tmp_path), "--data-dir", "/stores/tiny", "--quiet"]) == 0
    assert len(seen["commands"]) == len(suite_graph("smoke").jobs)
    assert all(c[-2:] == ["--data-dir", "/stores/tiny"] for c in seen["commands"])
    job = suite_graph("smoke").jobs[0]
    assert "--data-dir" not in local.job_command(job, local.LocalSettings(command=(sys.executable,)))


def test_sweep_status_shows_each_runs_data(tmp_path, capsys):
    import experiments
    first, second = experiments.load_suite("smoke")[:2]
    runs = tmp_path / "runs"
    rd = run_dir(first.suite, first.id, runs)
    rd.root.mkdir(parents=True)
    rd.spec_file.write_text(json.dumps({**first.to_dict(), "data": {
        "store_digest": "c0ffee" * 10 + "abcd", "tokenizer_sha256": "f" * 64, "path": "/stores/x"}}))
    old = run_dir(second.suite, second.id, runs)
    old.root.mkdir(parents=True)
    old.spec_file.write_text(json.dumps(second.to_dict()))
    assert main(["sweep", "status", "--suite", "smoke", "--runs-dir", str(runs), "--all"]) == 0
    out = capsys.readouterr().out
    assert "data c0ffeec0ffee (/stores/x): 1 run" in out
    assert "data not recorded: 1 run" in out
    assert "data of runs not started" in out
    from smelt_jax.sweep.graph import job_name
    name = job_name(first, None)
    assert "c0ffeec0ffee" in next(line for line in out.splitlines() if line.startswith(name + " "))

"""What data a run trains on: the tokenizer its suite states (`RunSpec.tokenizer`), checked by
`RunSpec.check_data` in the trainer before anything is written, and named to cloud jobs by
`smelt sweep submit --data-dir`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from data_helpers import build_tiny_corpus

import experiments
from smelt_jax.data.hf_tokenizer import BytesTokenizer
from smelt_jax.design.descriptors import DataMismatch
from smelt_jax.sweep import base


def _hf(vocab: int) -> SimpleNamespace:
    """The three attributes check_data reads, as a Hugging Face tokenizer.json of `vocab` ids has them."""
    return SimpleNamespace(kind="hf", vocab_size=vocab, sha256="ab" * 32)


def test_suites_state_their_tokenizer():
    for suite, kind in (("smelt16", "hf"), ("ablations200m", "hf"), ("micro", ""), ("smoke", ""),
                        ("ablationsmicro", "")):
        assert {run.tokenizer for run in experiments.load_suite(suite)} == {kind}, suite
    assert all(run.model.vocab == 65_536 for run in experiments.load_suite("smelt16"))


def test_smelt16_refuses_data_of_another_tokenizer():
    run = experiments.load_suite("smelt16")[0]
    run.check_data(_hf(65_536))  # a 64k tokenizer.json: accepted
    with pytest.raises(DataMismatch) as err:
        run.check_data(BytesTokenizer(), "the embedded corpus")
    message = str(err.value)
    assert "the embedded corpus was prepared with a bytes tokenizer of 512 ids" in message
    assert "expects a hf tokenizer of exactly 65,536 ids" in message
    assert "smelt data tokenizer train --vocab-size 65536" in message
    with pytest.raises(DataMismatch, match="of 32,000 ids"):
        run.check_data(_hf(32_000))
    with pytest.raises(DataMismatch, match="more than run"):
        run.check_data(_hf(100_000))


def test_micro_trains_on_any_tokenizer_whose_ids_fit():
    run = experiments.load_suite("micro")[0]
    run.check_data(BytesTokenizer())
    run.check_data(_hf(300))  # fewer ids than the model's 512 rows
    with pytest.raises(DataMismatch, match="--override vocab=N"):
        run.check_data(_hf(4096))


def test_train_refuses_before_writing_anything(tmp_path, capsys):
    """`smelt train` of a smelt16 run on the embedded-format byte corpus: one line, exit 2, no run folder."""
    from smelt_jax.cli import main

    corpus = build_tiny_corpus(tmp_path / "corpus")
    run = experiments.load_suite("smelt16")[0]
    runs = tmp_path / "runs"
    # a layout these 8 fake devices can form, so the data is what is refused (the mesh is checked first)
    assert main(["train", run.id, "--runs-dir", str(runs), "--data-dir", corpus.root, "--quiet",
                 "--layout", "data=-1,fsdp=1,expert=1,tensor=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expects a hf tokenizer of exactly 65,536 ids" in err
    assert not runs.exists() or not any(runs.rglob("*"))


def test_cloud_jobs_name_the_token_store(tmp_path, monkeypatch, capsys):
    """The rendered trainer command carries --data-dir; --submit of smelt16 without it is refused."""
    from smelt_jax.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(base.subprocess, "run", lambda *a, **k: pytest.fail("must not submit"))
    real = ["--image", "us-docker.pkg.dev/p/smelt/smelt-jax:v1", "--bucket", "gs://b/smelt", "--project", "p",
            "--zone", "us-east5-a", "--cluster", "c"]
    assert main(["sweep", "submit", "--suite", "smelt16", "--backend", "xpk", "--submit", *real]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "smelt16 runs train on a token store" in err and "--data-dir" in err
    store = "gs://b/smelt/data/smelt16"
    for backend in ("xpk", "tpu-vm"):
        out = tmp_path / backend
        assert main(["sweep", "submit", "--suite", "smelt16", "--backend", backend, "--out", str(out), *real,
                     "--data-dir", store]) == 0
        # Every job's trainer command (224: 32 runs x the stable phase and 6 branches) names the store.
        scripts = [p.read_text() for p in Path(out).rglob("*") if p.is_file() and p.suffix != ".yaml"]
        trainer_lines = [line for text in scripts for line in text.splitlines() if "smelt_jax train" in line]
        assert len(trainer_lines) == 224, backend
        assert all(f"--data-dir {store} " in line for line in trainer_lines), backend
    capsys.readouterr()
    assert main(["sweep", "submit", "--suite", "smelt16", "--backend", "xpk", *real, "--data-dir",
                 "/local/store"]) == 2
    assert "gs:// token store" in capsys.readouterr().err

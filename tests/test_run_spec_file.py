"""A run's run.json is read through one function (`smelt_jax.run_files.run_spec_file`) by train, eval, the lookup
and the sweep status: a truncated or edited file is one line saying what is wrong, checkpoints untouched."""

from __future__ import annotations

import json

import pytest

import experiments
from smelt_jax.run_files import run_lookup
from smelt_jax.cli import main
from smelt_jax.run_files.run_data import recorded_data
from smelt_jax.run_files.run_spec_file import RunSpecDamaged, read_run_record, read_run_spec, spec_digest
from smelt_jax.run_files.rundir import run_dir
from tests.custom_run_helpers import tiny_run


def _saved(root, run, edit=None, digest=True) -> dict:
    rd = run_dir(run.suite, run.id, root)
    (rd.checkpoints(None) / "4").mkdir(parents=True)
    spec = run.to_dict()
    record = {**spec, "metadata": {"spec_digest": spec_digest(spec)} if digest else {}}
    if edit:
        edit(record)
    rd.spec_file.write_text(json.dumps(record))
    return record


def test_a_healthy_run_json_reads_back(tmp_path):
    run = tiny_run()
    _saved(tmp_path, run)
    rd = run_dir(run.suite, run.id, tmp_path)
    assert read_run_spec(rd.spec_file, run.id) == run
    assert recorded_data(rd.spec_file) == (True, None)


def test_a_truncated_run_json_is_one_line_and_checkpoints_stay(tmp_path, capsys):
    run = tiny_run()
    _saved(tmp_path, run)
    rd = run_dir(run.suite, run.id, tmp_path)
    rd.spec_file.write_text(rd.spec_file.read_text()[:100])
    for argv in (["eval", run.id, "--runs-dir", str(tmp_path)], ["train", run.id, "--runs-dir", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "damaged" in err and "run.json of" in err, err
    assert (rd.checkpoints(None) / "4").is_dir() and sorted(p.name for p in rd.checkpoints(None).iterdir()) == ["4"]


def test_an_edited_suite_run_names_the_field(tmp_path, capsys):
    run = experiments.load_suite("nano")[0]

    def edit(record):
        record["config"]["d_model"] = record["config"]["d_model"] * 2
    _saved(tmp_path, run, edit)
    with pytest.raises(RunSpecDamaged, match=r"was edited: model.d_model \d+ != \d+ of its id"):
        read_run_record(run_dir(run.suite, run.id, tmp_path).spec_file, run.id)
    assert main(["train", run.id, "--runs-dir", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was edited: model.d_model" in err and "code" not in err, err


def test_an_edited_config_run_is_told_from_an_id_code_change(tmp_path):
    run = tiny_run()

    def edit(record):
        record["schedule"]["seed"] = 99
    _saved(tmp_path, run, edit)
    with pytest.raises(RunSpecDamaged, match="was edited after its trainer wrote it"):
        run_lookup.find_run(run.id, tmp_path)
    other = tmp_path / "old"
    _saved(other, run, edit, digest=False)  # written before the digest was recorded: either cause named
    with pytest.raises(RunSpecDamaged, match="the code that computes ids changed since it was written, or the file"):
        run_lookup.find_run(run.id, other)

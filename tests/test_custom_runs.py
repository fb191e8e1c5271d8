"""Custom runs are first-class: a run defined by a config file (`smelt train --config run.yaml`) or by
`--override` keeps its spec in the runs folder (run.json), and every command finds it by id or unique
prefix through one lookup (`smelt_jax.run_files.run_lookup.find_run`: the suites, then the runs folder)."""

from __future__ import annotations

import json

import pytest
from data_helpers import build_tiny_corpus

import experiments
from smelt_jax.run_files import run_lookup
from smelt_jax.cli import main
from smelt_jax.design.config import ConfigError
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.platform.errors import UnknownName
from smelt_jax.run_files.rundir import run_dir
from tests.custom_run_helpers import TINY_SPEC, skip_training, tiny_run, write_spec_file


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("store"))


def _train(*args: str) -> int:
    return main(["train", *args, "--quiet", "--no-tensorboard", "--log-every", "1"])


def test_every_suite_run_round_trips_through_its_dict():
    for name in experiments.SUITE_NAMES:
        for run in experiments.load_suite(name):
            again = RunSpec.from_dict(json.loads(json.dumps(run.to_dict())))
            assert again == run and again.id == run.id, run.id


def test_a_config_file_needs_only_model_and_schedule():
    run = tiny_run()
    assert run.suite == "custom" and run.control == run.model and run.variant == ""
    assert run.id.startswith("custom-tiny-s50-smelt-")
    as_shown = {k: v for k, v in TINY_SPEC.items() if k != "model"} | {"config": TINY_SPEC["model"]}
    assert RunSpec.from_dict(as_shown) == run  # `smelt experiments show` names the model `config`
    with pytest.raises(ConfigError, match="not both"):
        RunSpec.from_dict({**TINY_SPEC, "config": TINY_SPEC["model"]})


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, "unknown field(s) ['colour']"),
    ({"model": {**TINY_SPEC["model"], "d_modle": 8}}, "d_modle"),
    ({"model": {**TINY_SPEC["model"], "d_model": "wide"}}, "d_model"),
    ({"schedule": {**TINY_SPEC["schedule"], "stable_steps": -3}}, "stable_steps"),
    ({"arch": "Smelt!"}, "RunSpec.arch"),
    ({"model": None}, "model"),
    ({"parallelism": {"data": 1, "pipes": 2}}, "pipes"),
])
def test_bad_config_files_are_one_line(tmp_path, capsys, change, message):
    spec = {k: v for k, v in {**TINY_SPEC, **change}.items() if v is not None}
    path = write_spec_file(tmp_path / "bad.yaml", spec)
    assert _train("--config", str(path), "--runs-dir", str(tmp_path / "runs")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and str(path) in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("run.json"))


@pytest.mark.parametrize("text, message", [
    ("model: [1, 2\n", "not valid YAML"), ("- 1\n- 2\n", "a mapping"), ("", "a mapping")])
def test_unreadable_config_files_are_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert _train("--config", str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert _train("--config", str(tmp_path / "missing.json")) == 2
    assert "missing.json" in capsys.readouterr().err
    assert _train("--config", str(path), "smoke-s") == 2  # an id and a config file: one or the other
    assert "not both" in capsys.readouterr().err


def test_config_run_is_saved_and_found_by_every_command(tmp_path, store, capsys, monkeypatch):
    phases = skip_training(monkeypatch)
    runs = tmp_path / "runs"
    path = write_spec_file(tmp_path / "run.yaml", TINY_SPEC)
    run = tiny_run()
    assert _train("--config", str(path), "--runs-dir", str(runs), "--data-dir", store.root) == 0
    rd = run_dir(run.suite, run.id, runs)
    saved = json.loads(rd.spec_file.read_text())
    assert saved["id"] == run.id and RunSpec.from_dict(saved) == run  # run.json is the spec
    prefix = run.id[:len("custom-tiny-s50-smelt-") + 3]
    assert run_lookup.find_run(prefix, runs) == run
    with pytest.raises(UnknownName, match="no run with id"):
        run_lookup.find_run("custom-nothing", runs)
    with pytest.raises(UnknownName, match="nor is it saved under"):
        run_lookup.find_run(prefix, tmp_path / "elsewhere")
    # smelt train: by prefix, a branch
    assert _train(prefix, "--branch", "0", "--runs-dir", str(runs)) == 0
    assert (phases[-1].run, phases[-1].branch) == (run, 0)
    # smelt eval / smelt analyze: their run-folder lookup
    from smelt_jax.analysis.evaluate import _find_run_root
    assert _find_run_root(prefix, runs) == (rd.root, None, None)
    # smelt results collect --run PREFIX
    from smelt_jax.train.endpoint import write_endpoint
    write_endpoint(run, 0, {"overall": 2.5, "code": 2.0}, root=runs, rd=rd)
    for name in ("results.parquet", "results.csv"):
        (runs / run.suite / name).unlink()
    capsys.readouterr()
    assert main(["results", "collect", "--run", prefix, "--runs-dir", str(runs)]) == 0
    assert "custom: 1 endpoints, 1 rows appended" in capsys.readouterr().out
    # smelt experiments list / show
    assert main(["experiments", "list", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert run.id in out and "1 saved run under" in out
    assert main(["experiments", "list", "--suite", "custom", "--runs-dir", str(runs)]) == 0
    assert capsys.readouterr().out.count("custom-tiny") == 1
    assert main(["experiments", "show", prefix, "--runs-dir", str(runs)]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == run.id


@pytest.mark.integration
def test_config_run_trains_and_evaluates_end_to_end(tmp_path, store):
    """The tiny run trained for real (compiles: ~20-60 s on a busy 2-core CPU), found by prefix."""
    runs = tmp_path / "runs"
    path = write_spec_file(tmp_path / "run.yaml", TINY_SPEC)
    run = tiny_run()
    prefix = run.id[:len("custom-tiny-s50-smelt-") + 3]
    assert _train("--config", str(path), "--runs-dir", str(runs), "--data-dir", store.root) == 0
    assert _train(prefix, "--branch", "0", "--runs-dir", str(runs)) == 0
    from smelt_jax.analysis.evaluate import load_model
    loaded = load_model(prefix, 0, root=runs)
    assert loaded.run["id"] == run.id and loaded.step == 4


def test_override_run_is_saved_and_found(tmp_path, store, monkeypatch):
    skip_training(monkeypatch)
    runs = tmp_path / "runs"
    path = write_spec_file(tmp_path / "run.json", TINY_SPEC)
    assert _train("--config", str(path), "--override", "schedule.seed=7", "--runs-dir", str(runs),
                  "--data-dir", store.root) == 0
    from smelt_jax.run_files.overrides import apply_overrides
    run = apply_overrides(tiny_run(), ["schedule.seed=7"])
    assert run.id != tiny_run().id and run_dir(run.suite, run.id, runs).spec_file.is_file()
    assert run_lookup.find_run(run.id, runs) == run
    with pytest.raises(UnknownName):
        run_lookup.find_run(run.id)  # not a suite run: only the runs folder knows it


def test_a_runs_folder_spec_that_does_not_give_its_id_is_refused(tmp_path):
    run = tiny_run()
    rd = run_dir(run.suite, run.id, tmp_path)
    rd.root.mkdir(parents=True)
    rd.spec_file.write_text(json.dumps({**run.to_dict(), "schedule": {**run.schedule.to_dict(),
                                                                       "seed": 99}}))
    with pytest.raises(ConfigError, match="describes run"):
        run_lookup.find_run(run.id, tmp_path)

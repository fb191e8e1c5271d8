"""Check everything, then write (issue 53, item 2): a run's whole description (model, schedule,
parallelism, data) is validated before the first byte is written, whatever it came from (a config
file, --layout, overrides, a saved run.json); a run.json that no longer validates is one line naming
the field and how to repair it, never a traceback.
"""

from __future__ import annotations

import json

import pytest

from smelt_jax.cli import main
from smelt_jax.design.descriptors import RunSpec
from tests.custom_run_helpers import TINY_SPEC, saved_run, skip_training, tiny_run, write_spec_file


def _train(*args: str) -> int:
    return main(["train", *args, "--quiet", "--no-tensorboard", "--log-every", "1"])


def _written(root) -> list:
    return sorted(p for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("parallelism, field", [
    ({"remat": "ABC"}, "remat"),  # was a traceback from model construction, after run.json existed
    ({"data": 0}, "data"),  # was refused only after the run folder was written
    ({"fsdp": -2}, "fsdp"),
])
def test_a_bad_parallelism_section_is_one_line_and_writes_nothing(tmp_path, capsys, parallelism, field):
    path = write_spec_file(tmp_path / "run.yaml", {**TINY_SPEC, "parallelism": parallelism})
    runs = tmp_path / "runs"
    assert _train("--config", str(path), "--runs-dir", str(runs)) == 2
    assert _written(runs) == []  # no run folder, no run.json
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"parallelism.{field}" in err and str(path) in err, err


def test_a_layout_the_devices_cannot_form_is_refused_before_anything_is_written(
        tmp_path, capsys, monkeypatch):
    skip_training(monkeypatch)
    path = write_spec_file(tmp_path / "run.yaml", TINY_SPEC)
    runs = tmp_path / "runs"
    runs.mkdir()
    assert _train("--config", str(path), "--runs-dir", str(runs), "--layout", "data=3,fsdp=1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs 3 devices" in err, err
    assert _written(runs) == []


def test_an_expert_axis_the_experts_do_not_split_over_is_refused_before_anything_is_written(
        tmp_path, capsys, monkeypatch):
    """expert=8 over 4 experts was refused by the expert exchange, after run.json was written."""
    skip_training(monkeypatch)
    path = write_spec_file(tmp_path / "run.yaml", {**TINY_SPEC, "parallelism": {"data": 1, "expert": 8}})
    runs = tmp_path / "runs"
    runs.mkdir()
    assert _train("--config", str(path), "--runs-dir", str(runs)) == 2
    assert _written(runs) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4 experts" in err and "expert axis of size 8" in err, err


@pytest.mark.parametrize("field, value", [("remat", "ABC"), ("data", 0)])
def test_a_saved_run_json_that_no_longer_validates_names_the_field_and_the_repair(
        tmp_path, capsys, field, value):
    run = tiny_run()
    spec = saved_run(tmp_path, run)
    record = json.loads(spec.read_text())
    record["parallelism"][field] = value  # an edit, or an older version's file
    spec.write_text(json.dumps(record))
    assert _train(run.id, "--runs-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"parallelism.{field}" in err, err
    assert "no longer validates" in err and f"edit that field in {spec}" in err, err


def test_a_suite_runs_stale_run_json_says_to_delete_it(tmp_path, capsys):
    import experiments
    run = experiments.load_suite("micro")[0]
    spec = saved_run(tmp_path, run)
    record = json.loads(spec.read_text())
    record["parallelism"]["remat"] = "ABC"
    spec.write_text(json.dumps(record))
    assert main(["sweep", "status", "--suite", "micro", "--runs-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"skipped {spec}" in out and "parallelism.remat" in out and f"delete {spec}" in out, out


def test_parallelism_is_checked_wherever_it_is_made():
    from smelt_jax.parallel.layout import parse_layout
    with pytest.raises(ValueError, match="parallelism.remat"):
        RunSpec.from_dict({**TINY_SPEC, "parallelism": {"remat": "ABC"}})
    with pytest.raises(ValueError, match="Parallelism.data"):
        parse_layout("data=0", tiny_run().parallelism)

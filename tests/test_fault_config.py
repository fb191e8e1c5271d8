"""Issue 53, item 4: the config readers agree. A `.json` config and the same text as `.yaml` are read by
the same rules (a key given twice refused, YAML merge keys read), nesting is bounded (one line, never a
RecursionError, for a config file and for run.json), and list-valued path options go through the name
check as single ones do. Each refusal is one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smelt_jax.cli import main
from smelt_jax.design.config import ConfigError
from smelt_jax.run_files.config_text import MAX_DEPTH, parse_yaml
from smelt_jax.run_files.run_lookup import load_spec_file
from smelt_jax.run_files.run_spec_file import RunSpecDamaged, read_run_record
from tests.custom_run_helpers import TINY_SPEC, saved_run, tiny_run

SPEC_TEXT = json.dumps(TINY_SPEC, indent=1)
TWICE = SPEC_TEXT.replace('"suite": "custom",', '"suite": "custom", "suite": "other",', 1)


def _one_line_refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("smelt: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    monkeypatch.setenv("SMELT_RUNS_DIR", str(root))
    return root


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_key_given_twice_is_refused_in_json_as_in_yaml(tmp_path, runs, capsys, suffix):
    assert TWICE != SPEC_TEXT
    path = tmp_path / f"run{suffix}"
    path.write_text(TWICE)
    with pytest.raises(ConfigError, match="suite given twice"):
        load_spec_file(path)
    err = _one_line_refusal(capsys, ["train", "--config", str(path)])
    assert "given twice" in err and str(path) in err
    assert not runs.exists()  # nothing written


def test_yaml_merge_keys_are_read_as_safe_load_reads_them(tmp_path):
    spec = {k: v for k, v in TINY_SPEC.items() if k != "schedule"}
    merged = {**TINY_SPEC["schedule"], "fork_steps": [9], "decay_steps": 7}
    text = "\n".join([*(f"{k}: {json.dumps(v)}" for k, v in spec.items()),
                      "schedule:",
                      "  <<: &defaults " + json.dumps(merged),  # an anchor, merged in
                      "  fork_steps: [2, 4]",
                      "  decay_steps: 2", ""])
    path = tmp_path / "merge.yaml"
    path.write_text(text)
    import yaml
    assert yaml.safe_load(text)["schedule"] == TINY_SPEC["schedule"]  # explicit keys win in safe_load
    assert load_spec_file(path) == tiny_run()
    alias = "base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  y: 3\nlist:\n  <<: [*b, {z: 4}]\n"
    assert parse_yaml(alias, "a.yaml") == yaml.safe_load(alias) == {
        "base": {"x": 1, "y": 2}, "use": {"x": 1, "y": 3}, "list": {"x": 1, "y": 2, "z": 4}}


def test_an_explicit_key_twice_beside_a_merge_is_still_refused(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("a: &a {x: 1}\nb:\n  <<: *a\n  y: 1\n  y: 2\n")
    with pytest.raises(ConfigError, match="y given twice"):
        load_spec_file(path)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 50_000])
def test_a_deeply_nested_config_is_one_line(tmp_path, runs, capsys, suffix, depth):
    path = tmp_path / f"deep{suffix}"
    path.write_text(SPEC_TEXT[:-1] + ', "metadata": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ConfigError, match="nested more than"):
        load_spec_file(path)
    err = _one_line_refusal(capsys, ["train", "--config", str(path)])
    assert "nested more than" in err
    assert not runs.exists()


@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 50_000])
def test_a_deeply_nested_run_json_is_one_line(tmp_path, depth):
    spec_file = saved_run(tmp_path, tiny_run())
    record = spec_file.read_text()
    spec_file.write_text(record[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(RunSpecDamaged, match="nested more than"):
        read_run_record(spec_file, tiny_run().id)


def test_a_run_json_with_a_key_twice_is_refused(tmp_path):
    spec_file = saved_run(tmp_path, tiny_run())
    spec_file.write_text(spec_file.read_text().replace('"suite": "custom"', '"suite": "custom", "suite": "custom"', 1))
    with pytest.raises(RunSpecDamaged, match="given twice"):
        read_run_record(spec_file, tiny_run().id)


LONG = "x" * 300


@pytest.mark.parametrize("argv", [
    ["data", "prepare", "--input", "ok.jsonl", f"dir/{LONG}.jsonl", "--out", "store"],
    ["data", "prepare", "--input", "bad\0name", "--out", "store"],
    ["data", "tokenizer", "train", "--input", "ok.jsonl", f"{LONG}.jsonl", "--vocab-size", "300",
     "--out", "tok.json"],
])
def test_list_valued_path_options_go_through_the_name_check(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    err = _one_line_refusal(capsys, argv)
    assert "--input" in err
    assert list(tmp_path.iterdir()) == []  # nothing written

"""Readers that skip and name (issue 53, item 1): a command that walks many runs reads each item through
one function (`smelt_jax.run_files.readers`); a bad item is one line naming its path, the others are
processed, and the exit status says some were skipped (`exit_codes.SKIPPED`). Foreign folders of a
runs root are left alone with a note.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from smelt_jax.cli import main
from smelt_jax.platform.exit_codes import SKIPPED
from smelt_jax.run_files.results import read_results
from smelt_jax.run_files.rundir import results_dir, run_dir
from tests.test_reliability_results import SUITE, _branches, _keys, _write_endpoints

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "runs"


def _three(root: Path) -> tuple[list, list]:
    jobs = _branches()[:3]
    return jobs, _write_endpoints(root, jobs)


def _lines(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


# results collect ---------------------------------------------------------------------------------

def test_foreign_folders_in_the_runs_root_are_noted_and_every_suite_is_collected(root, capsys):
    """`lost+found` (a mounted disk) and `smoke-old` (a renamed suite) refused the whole runs root."""
    _, keys = _three(root)
    (root / "lost+found").mkdir()
    (root / "smoke-old").mkdir()
    assert main(["results", "collect", "--runs-dir", str(root)]) == 0  # notes only: nothing left out
    out = capsys.readouterr().out
    for name in ("lost+found", "smoke-old"):
        assert len(_lines(out, f"skipped {root / name}: not a suite folder")) == 1, out
    assert _keys(read_results(results_dir(SUITE, root))) == keys


def test_a_foreign_folder_holding_endpoints_is_named_and_the_status_says_so(root, capsys):
    _, keys = _three(root)
    old = root / "smoke-old" / "smoke-old-x-1" / "branch0"
    old.mkdir(parents=True)
    (old / "endpoint.json").write_text("{}")
    assert main(["results", "collect", "--runs-dir", str(root)]) == SKIPPED
    out = capsys.readouterr().out
    line, = _lines(out, f"skipped {root / 'smoke-old'}")
    assert "endpoint files are not collected" in line, out
    assert _keys(read_results(results_dir(SUITE, root))) == keys


@pytest.mark.parametrize("suite_flag", [False, True])
@pytest.mark.parametrize("damage", ["non_utf8", "folder"])
def test_an_unreadable_endpoint_file_is_named_and_the_others_collect(root, capsys, damage, suite_flag):
    """Non-UTF-8 bytes were a UnicodeDecodeError traceback; a folder stopped collection with nothing
    collected."""
    jobs, keys = _three(root)
    bad = run_dir(SUITE, jobs[1].run.id, root).endpoint(jobs[1].branch)
    bad.unlink()
    if damage == "non_utf8":
        bad.write_bytes(b'{"run_id": "\xff\xfe"}')
    else:
        bad.mkdir()
    argv = ["results", "collect", "--runs-dir", str(root)] + (["--suite", SUITE] if suite_flag else [])
    assert main(argv) == SKIPPED
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    line, = _lines(captured.out, "not collected")
    assert str(bad) in line and ("UTF-8" in line if damage == "non_utf8" else "a folder" in line), line
    assert _keys(read_results(results_dir(SUITE, root))) == [k for k in keys
                                                            if k != (jobs[1].run.id, jobs[1].branch)]


# sweep status ------------------------------------------------------------------------------------

def _spec_file(root: Path, job) -> Path:
    spec = run_dir(SUITE, job.run.id, root).spec_file
    spec.parent.mkdir(parents=True, exist_ok=True)
    return spec


@pytest.mark.parametrize("damage", ["damaged", "folder", "non_utf8"])
def test_sweep_status_names_a_bad_run_json_and_reports_the_rest(root, capsys, damage):
    """A damaged run.json stopped `sweep status` (exit 2, no counts); a run.json that is a folder was
    silently "not started"."""
    jobs, _ = _three(root)
    good = _spec_file(root, _branches()[-1])
    good.write_text(json.dumps({**_branches()[-1].run.to_dict(), "metadata": {}}))
    spec = _spec_file(root, jobs[0])
    if damage == "damaged":
        spec.write_text('{"suite": "mic')
    elif damage == "folder":
        spec.mkdir()
    else:
        spec.write_bytes(b"\xff\xfe{}")
    assert main(["sweep", "status", "--suite", SUITE, "--runs-dir", str(root)]) == SKIPPED
    out = capsys.readouterr().out
    line, = _lines(out, "skipped")
    assert line.startswith(f"skipped {spec}: "), out
    assert "endpoints: 3 written" in out and "data not recorded: 1 run" in out, out


# experiments list --------------------------------------------------------------------------------

@pytest.mark.parametrize("suite", [SUITE, "cfg"])
def test_experiments_list_names_a_run_json_that_is_a_folder_and_lists_the_rest(root, capsys, suite):
    """A run.json that is a folder was an IsADirectoryError traceback."""
    folder = root / suite / (f"{suite}-x-0000" if suite == "cfg" else _branches()[0].run.id) / "run.json"
    folder.mkdir(parents=True)
    assert main(["experiments", "list", "--suite", SUITE, "--runs-dir", str(root)]) == SKIPPED
    captured = capsys.readouterr()
    line, = _lines(captured.err, "skipped")
    assert f"skipped {folder}: a folder" in line, captured.err
    assert _branches()[0].run.id in captured.out  # the suite's runs are still listed


# the notebooks' loaders ---------------------------------------------------------------------------

def test_training_curves_notebook_names_a_bad_metrics_file_and_plots_the_rest(tmp_path, monkeypatch, capsys):
    good = tmp_path / "smoke" / "smoke-a-1" / "stable" / "metrics.jsonl"
    good.parent.mkdir(parents=True)
    good.write_text('{"step": 1, "tokens": 100, "loss": 3.0}\n')
    bad = tmp_path / "smoke" / "smoke-b-1" / "stable" / "metrics.jsonl"
    bad.mkdir(parents=True)
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path))
    monkeypatch.setenv("SMELT_SUITE", "smoke")
    scope = runpy.run_path(str(REPO / "notebooks" / "training_curves.py"))
    assert list(scope["curves"]["run_id"]) == ["smoke-a-1"]
    assert f"skipped {bad}: a folder" in capsys.readouterr().out


# the reader itself -------------------------------------------------------------------------------

def test_the_one_reader_returns_the_item_or_a_named_reason(tmp_path):
    from smelt_jax.design.config import ConfigError
    from smelt_jax.run_files.readers import Skipped, read_item

    def parse(text):
        if text == "bad":
            raise ConfigError("no good")
        return text

    (tmp_path / "ok").write_text("fine")
    (tmp_path / "bad").write_text("bad")
    (tmp_path / "bytes").write_bytes(b"\xff")
    assert read_item(tmp_path / "ok", parse) == "fine"
    assert read_item(tmp_path / "bad", parse) == Skipped(str(tmp_path / "bad"), "no good")
    assert read_item(tmp_path / "bytes", parse).line().startswith(f"skipped {tmp_path / 'bytes'}: not a UTF-8")
    with pytest.raises(FileNotFoundError):
        read_item(tmp_path / "absent", parse)


def test_a_damaged_local_sweep_state_is_named_once_and_status_reads_the_run_folders(root, capsys):
    """A damaged sweeps/<suite>/state.json was a JSONDecodeError traceback in `sweep status`."""
    from smelt_jax.sweep.local import sweep_dir
    _three(root)
    state = sweep_dir(SUITE, root) / "state.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text('{"jobs": {"a": ')
    assert main(["sweep", "status", "--suite", SUITE, "--runs-dir", str(root)]) == 0
    captured = capsys.readouterr()
    line, = _lines(captured.err, "skipped")
    assert f"skipped {state}: damaged" in line, captured.err
    assert "endpoints: 3 written" in captured.out


def test_a_results_table_that_is_a_folder_is_named_and_collect_rebuilds_it(root, tmp_path, capsys):
    """results.parquet as a folder read as an empty table (export: "no endpoint rows"), and collect
    failed naming a temporary file."""
    _, keys = _three(root)
    assert main(["results", "collect", "--runs-dir", str(root)]) == 0
    table = results_dir(SUITE, root) / "results.parquet"
    table.unlink()
    table.mkdir()
    capsys.readouterr()
    out = tmp_path / "out.csv"
    assert main(["results", "export", "--suite", SUITE, "--runs-dir", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{table} is a folder" in err, err
    assert main(["results", "collect", "--runs-dir", str(root)]) == 0
    assert "set aside" in capsys.readouterr().out
    assert _keys(read_results(results_dir(SUITE, root))) == keys


def test_sweep_status_names_an_endpoint_file_that_is_a_folder(root, capsys):
    """A folder in place of endpoint.json counted as a written endpoint."""
    jobs, _ = _three(root)
    bad = run_dir(SUITE, jobs[1].run.id, root).endpoint(jobs[1].branch)
    bad.unlink()
    bad.mkdir()
    assert main(["sweep", "status", "--suite", SUITE, "--runs-dir", str(root)]) == SKIPPED
    out = capsys.readouterr().out
    line, = _lines(out, "skipped")
    assert line.startswith(f"skipped {bad}: a folder"), out
    assert "endpoints: 2 written" in out, out

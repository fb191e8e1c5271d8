"""The results store: rows, idempotent re-append, atomic writes, concurrent writers from two processes."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pandas as pd
import pytest

from smelt_jax.run_files import results
from smelt_jax.run_files.results import EndpointResult, append_result, read_results


def _result(run_id: str, branch: int = 0, loss: float = 2.5, **changes) -> EndpointResult:
    fields = {"run_id": run_id, "branch": branch, "pair_id": "p-" + run_id, "suite": "micro", "arch": "smelt",
                  "scale": "100M", "sparsity_label": "S85", "sparsity": 0.85, "flops_per_token": 6.0e8,
                  "params": 70_000_000, "tokens": 1_000_000 * (branch + 1), "cumulative_flops": 6e14 * (branch + 1),
                  "val_loss": loss, "losses_by_source": {"python": loss - 0.5, "prose": loss + 0.5},
                  "git_commit": "abc123"}
    fields.update(changes)
    return EndpointResult(**fields)


def test_rows_columns_and_csv_export(tmp_path):
    assert read_results(tmp_path).empty
    append_result(_result("run-b", 1), tmp_path)
    table = append_result(_result("run-a", 0, losses_by_source={"c": 2.0}), tmp_path)
    assert list(table[["run_id", "branch"]].itertuples(index=False, name=None)) == [("run-a", 0), ("run-b", 1)]
    for column in ("pair_id", "suite", "arch", "scale", "sparsity_label", "sparsity", "flops_per_token",
                   "params", "tokens", "cumulative_flops", "val_loss", "git_commit", "time",
                   "loss_python", "loss_prose", "loss_c"):
        assert column in table.columns, column
    # A source missing from a row is NaN there, not a made-up value.
    row_a = table[table.run_id == "run-a"].iloc[0]
    assert row_a.loss_c == 2.0 and np.isnan(row_a.loss_python)
    assert row_a.time.endswith("Z")
    read = read_results(tmp_path)
    pd.testing.assert_frame_equal(read, table)
    csv = pd.read_csv(tmp_path / results.CSV_NAME)
    assert list(csv.columns) == list(table.columns) and len(csv) == 2
    assert np.allclose(csv.val_loss, table.val_loss)


def test_reappending_an_endpoint_replaces_it(tmp_path):
    append_result(_result("run-a", 0, loss=3.0), tmp_path)
    append_result(_result("run-a", 1, loss=2.9), tmp_path)
    append_result(_result("run-a", 0, loss=2.7), tmp_path)
    table = read_results(tmp_path)
    assert len(table) == 2
    assert table.set_index("branch").loc[0, "val_loss"] == 2.7


def test_bad_rows_are_rejected(tmp_path):
    for bad in ({"val_loss": float("nan")}, {"sparsity": 1.0}, {"branch": -1}, {"params": 0},
                {"losses_by_source": {"bad name": 1.0}}, {"losses_by_source": {"x": float("inf")}}):
        with pytest.raises(ValueError):
            _result("run", **bad)
    with pytest.raises(ValueError):
        _result("")


def test_failed_write_leaves_the_old_table(tmp_path, monkeypatch):
    append_result(_result("keep"), tmp_path)
    before = (tmp_path / results.TABLE_NAME).read_bytes()

    def crash(self, path, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"PAR1 half a table")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", crash)
    with pytest.raises(OSError, match="disk full"):
        append_result(_result("lost"), tmp_path)
    monkeypatch.undo()
    assert (tmp_path / results.TABLE_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [results.TABLE_NAME, results.CSV_NAME, results.LOCK_NAME])
    assert list(read_results(tmp_path).run_id) == ["keep"]


def _writer(folder: str, prefix: str, count: int) -> None:
    for i in range(count):
        append_result(_result(f"{prefix}-{i:03d}", loss=2.0 + i / 100), folder)
        append_result(_result("shared", branch=0, loss=1.0 + i / 100), folder)  # same key from both


def test_two_processes_appending_lose_nothing(tmp_path):
    count = 25
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold JAX threads
    workers = [context.Process(target=_writer, args=(str(tmp_path), name, count)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    table = read_results(tmp_path)
    expected = {f"{p}-{i:03d}" for p in "ab" for i in range(count)} | {"shared"}
    assert set(table.run_id) == expected and len(table) == len(expected)
    assert (table.run_id == "shared").sum() == 1
    csv = pd.read_csv(tmp_path / results.CSV_NAME)
    assert len(csv) == len(expected)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]

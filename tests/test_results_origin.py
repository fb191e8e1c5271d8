"""Results carry where a run came from (`run_lookup.run_origin`: grid, override, config); a suite's export
and its fit take only the suite's own grid runs unless `--include-custom`, and say how many they left out."""

from __future__ import annotations

import pandas as pd

import experiments
from smelt_jax.cli import main
from smelt_jax.run_files.overrides import apply_overrides
from smelt_jax.run_files.results import EndpointResult, append_result
from smelt_jax.run_files.run_lookup import run_origin
from smelt_jax.run_files.rundir import results_dir
from smelt_jax.scaling.suite_fits import off_grid_rows, read_suite_results
from tests.custom_run_helpers import TINY_SPEC, tiny_run


def _row(run, origin: str, loss: float) -> EndpointResult:
    b = run.budget()
    return EndpointResult(run_id=run.id, branch=0, pair_id=run.pair_id, suite=run.suite, arch=run.arch,
                          scale=run.scale, sparsity_label=run.sparsity_label, sparsity=max(0.0, b.sparsity or 0.0),
                          flops_per_token=b.train_flops_per_token, params=b.params_total, tokens=1000,
                          cumulative_flops=1e9, val_loss=loss, origin=origin)


def test_the_origin_of_grid_override_and_config_runs():
    grid = experiments.load_suite("smoke")[0]
    assert run_origin(grid) == "grid"
    assert run_origin(apply_overrides(grid, ["schedule.peak_lr=0.01"])) == "override"
    assert run_origin(tiny_run()) == "config"
    assert run_origin(tiny_run({**TINY_SPEC, "suite": "smoke"})) == "config"  # no smoke run at its coordinates


def test_export_takes_only_the_grid_unless_asked(tmp_path, capsys):
    grid = experiments.load_suite("smoke")[0]
    changed = apply_overrides(grid, ["schedule.peak_lr=0.01"])
    root = tmp_path / "runs"
    folder = results_dir("smoke", root)
    append_result(_row(grid, "grid", 3.0), folder)
    append_result(_row(changed, "override", 2.0), folder)
    out = tmp_path / "fits" / "results.csv"
    assert main(["results", "export", "--suite", "smoke", "--runs-dir", str(root), "--out", str(out)]) == 0
    assert "1 endpoint rows" in capsys.readouterr().out.replace("1 off-grid", "")
    table = pd.read_csv(out)
    assert list(table["run_id"]) == [grid.id] and "origin" not in table.columns
    assert main(["results", "export", "--suite", "smoke", "--runs-dir", str(root), "--out", str(out),
                 "--include-custom"]) == 0
    assert "2 endpoint rows" in capsys.readouterr().out
    table = pd.read_csv(out).set_index("run_id")
    assert table.loc[grid.id, "origin"] == "grid" and table.loc[changed.id, "origin"] == "override"
    assert off_grid_rows(out.parent) == 1
    assert list(read_suite_results(out.parent)["run_id"]) == [grid.id]
    assert len(read_suite_results(out.parent, include_custom=True)) == 2


def test_export_says_how_many_it_left_out(tmp_path, capsys):
    grid = experiments.load_suite("smoke")[0]
    root = tmp_path / "runs"
    append_result(_row(grid, "grid", 3.0), results_dir("smoke", root))
    append_result(_row(apply_overrides(grid, ["d_model=64"]), "override", 2.5), results_dir("smoke", root))
    assert main(["results", "export", "--suite", "smoke", "--runs-dir", str(root), "--out",
                 str(tmp_path / "r.csv")]) == 0
    assert "1 off-grid rows left out" in capsys.readouterr().out


def test_a_suite_of_only_custom_runs_is_refused_without_include_custom(tmp_path, capsys):
    run = tiny_run()
    root = tmp_path / "runs"
    append_result(_row(run, "config", 3.0), results_dir(run.suite, root))
    assert main(["results", "export", "--suite", run.suite, "--runs-dir", str(root), "--out",
                 str(tmp_path / "r.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--include-custom" in err and not (tmp_path / "r.csv").exists()

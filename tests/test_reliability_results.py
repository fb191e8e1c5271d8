"""The results table and its endpoint files under damage (issue 27, item 6 and the endpoint cases of 9):
a damaged results.parquet is rebuilt by `smelt results collect` from the endpoint files (and never
stops an endpoint's append), a bad endpoint file is named and the others still collect, and a
read-only runs folder can still be read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from smelt_jax.cli import main
from smelt_jax.run_files.results import (
    TABLE_NAME,
    EndpointResult,
    ResultsDamaged,
    append_result,
    read_results,
)
from smelt_jax.run_files.rundir import results_dir, run_dir
from smelt_jax.sweep.collect import collect
from smelt_jax.sweep.graph import suite_graph

REPO = Path(__file__).resolve().parents[1]
SUITE = "micro"


def _row(run_id: str, branch: int, loss: float = 3.0) -> dict:
    return EndpointResult(run_id=run_id, branch=branch, pair_id="p", suite=SUITE, arch="smelt", scale="1M",
                          sparsity_label="S0", sparsity=0.0, flops_per_token=6e6, params=1_000_000,
                          tokens=1000 * (branch + 1), cumulative_flops=6e9 * (branch + 1), val_loss=loss,
                          losses_by_source={"code": loss + 0.1}, git_commit="abc").to_row()


def _branches() -> list:
    return [job for job in suite_graph(SUITE).jobs if not job.is_stable]


def _write_endpoints(root: Path, jobs) -> list[tuple[str, int]]:
    keys = []
    for i, job in enumerate(jobs):
        path = run_dir(SUITE, job.run.id, root).endpoint(job.branch)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_row(job.run.id, job.branch, 3.0 + i / 10)))
        keys.append((job.run.id, job.branch))
    return sorted(keys)


def _keys(table: pd.DataFrame) -> list[tuple[str, int]]:
    return sorted(zip(table["run_id"], table["branch"].astype(int)))


@pytest.fixture
def runs(tmp_path) -> tuple[Path, list[tuple[str, int]]]:
    root = tmp_path / "runs"
    keys = _write_endpoints(root, _branches()[:4])
    assert collect(root)[0].appended == 4
    return root, keys


@pytest.mark.parametrize("damage", [b"", b"PAR1 garbage", "truncate"])
def test_damaged_results_table_is_named_then_rebuilt_by_collect(runs, damage, capsys):
    root, keys = runs
    table = results_dir(SUITE, root) / TABLE_NAME
    table.write_bytes(table.read_bytes()[:len(table.read_bytes()) // 2] if damage == "truncate" else damage)
    with pytest.raises(ResultsDamaged, match=f"{table} is damaged .*smelt results collect"):
        read_results(results_dir(SUITE, root))
    args = ["sweep", "status", "--suite", SUITE, "--runs-dir", str(root)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged" in err and "results collect" in err

    assert main(["results", "collect", "--runs-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "set aside" in out and "4 rows appended" in out
    assert _keys(read_results(results_dir(SUITE, root))) == keys
    assert len(list(table.parent.glob(f"{TABLE_NAME}.damaged-*"))) == 1
    assert main(args) == 0
    assert "4 in the results store" in capsys.readouterr().out


def test_an_endpoint_append_on_a_damaged_table_keeps_its_row(runs):
    """The end of `train --branch K` appends its row: a damaged table is set aside, not a traceback
    (the trainer writes endpoint.json after the append, so a failure there would lose the endpoint)."""
    root, keys = runs
    folder = results_dir(SUITE, root)
    (folder / TABLE_NAME).write_bytes(b"not parquet")
    job = _branches()[4]
    with pytest.warns(UserWarning, match="is damaged .*set aside"):
        table = append_result(EndpointResult(**{k: v for k, v in _row(job.run.id, job.branch).items()
                                                 if not k.startswith("loss_")}), folder)
    assert _keys(table) == [(job.run.id, job.branch)]
    collect(root)  # the rows of the other endpoint files come back
    assert _keys(read_results(folder)) == sorted(keys + [(job.run.id, job.branch)])


def test_a_read_error_is_not_damage(runs, monkeypatch):
    import pandas

    root, _ = runs

    def denied(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied", str(results_dir(SUITE, root) / TABLE_NAME))
    monkeypatch.setattr(pandas, "read_parquet", denied)
    with pytest.raises(PermissionError):
        read_results(results_dir(SUITE, root))
    with pytest.raises(PermissionError):
        collect(root)
    assert (results_dir(SUITE, root) / TABLE_NAME).exists()  # nothing set aside


@pytest.mark.parametrize("bad", ["nan", "missing", "json"])
def test_a_bad_endpoint_file_is_named_and_the_others_still_collect(tmp_path, bad, capsys):
    root = tmp_path / "runs"
    jobs = _branches()[:3]
    keys = _write_endpoints(root, jobs)
    path = run_dir(SUITE, jobs[1].run.id, root).endpoint(jobs[1].branch)
    row = json.loads(path.read_text())
    if bad == "nan":
        row["val_loss"] = math.nan
        path.write_text(json.dumps(row))  # json writes NaN
    elif bad == "missing":
        path.write_text(json.dumps({k: row[k] for k in ("run_id", "branch", "val_loss")}))
    else:
        path.write_text(json.dumps(row)[:40])
    assert main(["results", "collect", "--runs-dir", str(root)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    problems = [line for line in captured.out.splitlines() if "not collected" in line]
    assert len(problems) == 1 and str(path) in problems[0], captured.out
    want = {"nan": "val_loss must be a finite number", "missing": "endpoint file lacks pair_id, suite",
            "json": "damaged endpoint file"}[bad]
    assert want in problems[0]
    assert _keys(read_results(results_dir(SUITE, root))) == [k for k in keys if k != (jobs[1].run.id,
                                                                                      jobs[1].branch)]


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.integration
@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_a_read_only_runs_folder_can_be_read(runs, tmp_path):
    """`sweep status` and `results export` on a read-only bind mount of the runs folder (issue 27 item 9:
    both failed on the results lock)."""
    root, keys = runs
    out = tmp_path / "out" / "results.csv"
    out.parent.mkdir()
    smelt = f"{sys.executable} -m smelt_jax"
    shell = (f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
             f"{smelt} sweep status --suite {SUITE} --runs-dir {root} && "
             f"{smelt} results export --suite {SUITE} --runs-dir {root} --out {out}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 in the results store" in result.stdout and f"{len(keys)} endpoint rows" in result.stdout
    assert len(pd.read_csv(out)) == len(keys)


def test_a_local_sweep_names_an_endpoint_it_cannot_collect_once(tmp_path, capsys):
    """The local backend's collection reports a damaged endpoint.json on stderr (once per sweep) instead
    of dropping it silently."""
    from smelt_jax.sweep.local import _collect

    bad = tmp_path / "smoke" / "smoke-xs-s85-baseline-00000000" / "branch0" / "endpoint.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    reported: set[str] = set()
    _collect("smoke", tmp_path, reported)
    _collect("smoke", tmp_path, reported)
    err = capsys.readouterr().err
    assert err.count("not collected") == 1 and str(bad) in err

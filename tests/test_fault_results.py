"""Results that cannot lie (issue 53, item 6): `smelt eval` refuses a damaged final checkpoint unless told
which step to use and says which step it evaluated; fits the data cannot identify are flagged; every write
error names its path; a symlink loop in the runs root and an unwritable `analyze --out` are one line.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from smelt_jax.cli import main
from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files import checkpoint_format as fmt
from smelt_jax.run_files.rundir import run_dir

MODEL = ModelConfig(vocab=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                    n_experts=4, top_k=2, expert_ffn=32, loop_start=1, loop_length=1,
                    loop_repeats=2, seq_len=32)
SCHEDULE = Schedule(batch_size=4, seq_len=32, stable_steps=4, fork_steps=(4,), decay_steps=2,
                    warmup_steps=1, peak_lr=3e-3)
RUN = RunSpec(suite="unit", scale="tiny", sparsity_label="s50", arch="smelt", model=MODEL,
              schedule=SCHEDULE, control=MODEL.replace(n_experts=2), pair_id="unit-tiny")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "Warning" not in err and len(lines) == 1, err
    return lines[0]


# eval -------------------------------------------------------------------------------------------------
def _fake_checkpoints(root: Path, steps=(2, 4)) -> Path:
    """run.json and sealed (checksummed) step folders that only the damage check reads."""
    from smelt_jax.train.endpoint import write_spec

    rd = run_dir(RUN.suite, RUN.id, root)
    rd.root.mkdir(parents=True)
    write_spec(RUN, rd)
    folder = rd.checkpoints(None)
    for step in steps:
        (folder / str(step) / "state").mkdir(parents=True)
        (folder / str(step) / "state" / "data").write_bytes(bytes(range(256)) * 8)
        (folder / str(step) / fmt.ORBAX_COMMIT_FILE).write_text("{}")
        fmt.seal(folder / str(step))
    return folder


def test_eval_refuses_a_damaged_newest_checkpoint_and_names_the_whole_ones(tmp_path, capsys):
    """Before: the damaged step 4 was skipped with a raw Python warning and an older step evaluated."""
    folder = _fake_checkpoints(tmp_path / "runs")
    data = folder / "4" / "state" / "data"
    data.write_bytes(data.read_bytes()[:100])  # truncated
    assert main(["eval", RUN.id, "--runs-dir", str(tmp_path / "runs"), "--no-validation"]) == 2
    line = _one_line(capsys)
    assert f"the newest checkpoint, step 4 in {folder}, is damaged (state/data has 100 bytes" in line
    assert "nothing evaluated: evaluate an older one with --step N (whole: 2)" in line


@pytest.mark.integration
def test_eval_says_its_step_and_a_same_size_damage_is_refused_unless_a_step_is_named(tmp_path, capsys):
    """A real run (checkpoints at steps 2 and 4): the damaged newest is refused, `--step 2` evaluates
    step 2 and says so."""
    from smelt_jax.train.trainer import TrainOptions, train
    from tests.data_helpers import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus")
    runs = tmp_path / "runs"
    train(RUN, root=runs, corpus=corpus,
          options=TrainOptions(log_every=1, checkpoint_every=2, progress=False, peak_flops=1e12, devices=1))
    folder = run_dir(RUN.suite, RUN.id, runs).checkpoints(None)
    assert fmt.committed_steps(folder)[-2:] == [2, 4]
    args = ["eval", RUN.id, "--runs-dir", str(runs), "--data-dir", str(corpus.root), "--eval-tokens", "64"]
    assert main(args) == 0
    assert f"evaluating {RUN.id} stable step 4" in capsys.readouterr().err
    biggest = max((p for p in (folder / "4").rglob("*") if p.is_file() and p.name != fmt.CHECKSUM_FILE),
                  key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the same size: only the checksums see it
    biggest.write_bytes(bytes(raw))
    assert main(args) == 2
    line = _one_line(capsys)
    assert "step 4" in line and "changed since the save" in line, line
    assert main(args + ["--step", "2"]) == 0
    captured = capsys.readouterr()
    assert f"evaluating {RUN.id} stable step 2" in captured.err and "Warning" not in captured.err


# fits the data cannot identify ----------------------------------------------------------------------
CONSTANT_FIT = {"law": "smelt", "arch": None, "E": 3.0, "A": 0.805266, "K": 1.08129e9, "a": 1.62613,
                "b": 0.313749, "c": 9.24347, "n_points": 36, "converged": True, "grad_norm": 9.1e-11,
                "rmse": 3.96e-11, "compute_range": [1e13, 3e15]}


def _constant_table(path: Path) -> Path:
    import itertools

    import pandas as pd

    rows = [{"arch": "smelt", "F": F, "S": S, "D": D, "loss": 3.0, "cell": f"c{i % 12}"}
            for i, (F, S, D) in enumerate(itertools.product([1e6, 3e6, 1e7, 3e7], [0.5, 0.75, 0.875],
                                                            [1e7, 3e7, 1e8]))]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_health_flags_constant_loss_and_absurd_exponents():
    from smelt_jax.scaling.health import assess_fit

    assert any("degenerate: constant loss (36 points, all 3 within 0" in p
               for p in assess_fit(CONSTANT_FIT, losses=[3.0] * 36))
    for value in (1e10, 1e23):
        problems = assess_fit({**CONSTANT_FIT, "c": value})
        assert [p for p in problems if p.startswith(f"fit: degenerate: exponent c = {value:.3g} (absurd")]
    assert assess_fit({**CONSTANT_FIT, "a": 0.4, "c": 0.5}, losses=[3.0, 3.1, 2.9] * 12) == []


def test_tables_draws_a_constant_loss_fit_as_degenerate(tmp_path, monkeypatch, capsys):
    """`smelt tables` on what `smelt fit` wrote for a constant-loss table (coefficients as it fitted
    them): the figure's title names a degenerate fit. Before: no title at all."""
    import json

    from smelt_jax.scaling import figures

    fit = tmp_path / "fit"
    fit.mkdir()
    (fit / "coefficients.json").write_text(json.dumps(CONSTANT_FIT))
    _constant_table(fit / "points.csv")
    titles = []
    original = figures._mark_problems

    def spy(ax, problems):
        original(ax, problems)
        titles.append(ax.get_title())
    monkeypatch.setattr(figures, "_mark_problems", spy)
    monkeypatch.setattr(figures, "save_figure", lambda fig, out_dir, stem: [])  # the title is the point
    assert main(["tables", str(fit)]) == 0
    assert titles == ["degenerate fit: not a measurement"], titles


@pytest.mark.integration
def test_fit_of_a_constant_loss_table_warns(tmp_path, capsys):
    """`smelt fit` still writes the fit (exit 0) and says on stderr that the data cannot identify it."""
    table = _constant_table(tmp_path / "constant.csv")
    assert main(["fit", "--law", "smelt", "--input", str(table), "--out", str(tmp_path / "fit")]) == 0
    err = capsys.readouterr().err
    assert "warning: fit: degenerate: constant loss (36 points" in err, err


# every write error names its path ------------------------------------------------------------------
def _unshare_works() -> bool:
    import shutil
    import subprocess

    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


def _results_store(root: Path) -> None:
    import experiments
    from smelt_jax.run_files.results import EndpointResult, append_result
    from smelt_jax.run_files.rundir import results_dir

    run = experiments.load_suite("smoke")[0]
    b = run.budget()
    append_result(EndpointResult(run_id=run.id, branch=0, pair_id=run.pair_id, suite=run.suite, arch=run.arch,
                                 scale=run.scale, sparsity_label=run.sparsity_label,
                                 sparsity=max(0.0, b.sparsity or 0.0), flops_per_token=b.train_flops_per_token,
                                 params=b.params_total, tokens=1000, cumulative_flops=1e9, val_loss=3.0,
                                 origin="grid"), results_dir("smoke", root))


@pytest.mark.integration  # a subprocess: ~30 s on a loaded core
@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_results_export_on_a_full_disk_names_the_file(tmp_path):
    """A real full tmpfs. Before: `smelt: error: cannot write: No space left on device` (no path)."""
    import os
    import subprocess
    import sys

    _results_store(tmp_path / "runs")
    small = tmp_path / "small"
    small.mkdir()
    cli = (f"{sys.executable} -m smelt_jax results export --suite smoke --runs-dir runs "
           f"--out {small}/results.csv")
    fill = "head -c 1048576 /dev/zero > small/fill 2>/dev/null; "
    result = subprocess.run(["unshare", "-rm", "sh", "-c",
                             f"mount -t tmpfs -o size=64k none {small} && {fill}{cli}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip()
    assert line == f"smelt: error: cannot write {small}/results.csv: No space left on device", line


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")  # as write() raises it: no file name


def test_fit_on_a_full_disk_names_the_file(tmp_path, monkeypatch, capsys):
    """The fit itself is stubbed (its writes are the point). Before: no path in the line."""
    from smelt_jax.scaling import pipeline

    monkeypatch.setattr(pipeline, "fit_table", lambda table, law, **kw: (dict(CONSTANT_FIT), None))
    monkeypatch.setattr(Path, "write_text", _full_disk)
    table = _constant_table(tmp_path / "constant.csv")
    out = tmp_path / "fit"
    assert main(["fit", "--law", "smelt", "--input", str(table), "--out", str(out)]) == 2
    assert _one_line(capsys) == f"smelt: error: cannot write {out}/coefficients.json: No space left on device"


def test_tables_on_a_full_disk_names_the_file(tmp_path, monkeypatch, capsys):
    import json

    fit = tmp_path / "fit"
    fit.mkdir()
    (fit / "coefficients.json").write_text(json.dumps({**CONSTANT_FIT, "a": 0.4, "c": 0.5}))
    monkeypatch.setattr(Path, "write_text", _full_disk)
    assert main(["tables", str(fit)]) == 2
    assert _one_line(capsys) == f"smelt: error: cannot write {fit}/coefficients.md: No space left on device"


# a symlink loop in the runs root; analyze into a folder it cannot write -----------------------------
def test_train_in_a_runs_root_with_a_symlink_loop_is_one_line(tmp_path, capsys):
    """Before: an ELOOP traceback from the lock's mkdir."""
    import experiments

    run = experiments.load_suite("micro")[0]
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "micro").symlink_to(runs / "micro")  # a loop where the suite's folder should be
    assert main(["train", run.id, "--runs-dir", str(runs), "--quiet"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"smelt: error: cannot access {runs}/micro/") and \
        line.endswith("Too many levels of symbolic links"), line


def test_analyze_into_a_folder_it_cannot_write_is_refused_before_the_analysis(tmp_path, monkeypatch, capsys):
    """--out under a file: refused in one line naming it before the run is even restored (here its
    checkpoints are fakes that no restore could read). Before: a traceback after the whole analysis."""
    _fake_checkpoints(tmp_path / "runs")
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "analysis"
    assert main(["analyze", RUN.id, "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert line == f"smelt: error: cannot access {out}: Not a directory", line
    assert not out.exists()


def test_analyze_probe_leaves_no_folder_behind(tmp_path):
    from smelt_jax.analysis.run_analysis import check_writable

    check_writable(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []

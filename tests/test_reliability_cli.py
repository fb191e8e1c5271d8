"""Issue 15: one trainer per run (the lock, and two real `smelt train` processes), every option checked
before start-up, user-fixable filesystem errors as one line, gains/fits/results input checks."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from smelt_jax.cli import CliError, main
from smelt_jax.cli import filesystem_errors
from smelt_jax.run_files.overrides import apply_overrides
from smelt_jax.design.config import ConfigError
from smelt_jax.train.lock import LOCK_NAME, LocalLock, LockHeld, holding
from smelt_jax.train.trainer import TrainOptions

REPO = Path(__file__).resolve().parents[1]
SMOKE_ID = __import__("experiments").load_suite("smoke")[0].id


# The lock --------------------------------------------------------------------------------------

def test_second_holder_is_refused_with_one_line_naming_the_first(tmp_path):
    first = LocalLock(tmp_path, description="run-a stable")
    first.acquire()
    second = LocalLock(tmp_path, description="run-a stable")
    with pytest.raises(LockHeld) as err:
        second.acquire()
    line = str(err.value)
    assert "\n" not in line and f"pid {os.getpid()}" in line and socket.gethostname() in line
    assert "run-a stable" in line
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second.acquire()  # free again
    second.release()


def test_lock_of_a_dead_process_is_taken_over_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"pid": int(dead.stdout), "host": socket.gethostname(), "token": "old"}))
    lock = LocalLock(tmp_path, stale_after=3600)
    lock.acquire()
    assert lock.took_over["token"] == "old"
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()


def test_lock_without_heartbeat_is_stale_after_the_stated_time(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "old"}))
    with pytest.raises(LockHeld, match="elsewhere"):
        LocalLock(tmp_path, stale_after=60).acquire()  # fresh heartbeat: held
    past = time.time() - 120
    os.utime(tmp_path / LOCK_NAME, (past, past))
    lock = LocalLock(tmp_path, stale_after=60)
    lock.acquire()  # 120 s without heartbeat > 60 s: taken over
    assert lock.took_over["host"] == "elsewhere"
    lock.release()


def test_empty_lock_file_is_stale_after_a_short_grace(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")  # its writer died between O_EXCL and the write
    with pytest.raises(LockHeld):
        LocalLock(tmp_path).acquire()
    past = time.time() - 60
    os.utime(tmp_path / LOCK_NAME, (past, past))
    lock = LocalLock(tmp_path)
    lock.acquire()
    lock.release()


def test_heartbeat_refreshes_and_a_taken_over_holder_knows(tmp_path):
    lock = LocalLock(tmp_path, stale_after=60)
    with holding(lock, heartbeat_every=0.05):
        past = time.time() - 30
        os.utime(tmp_path / LOCK_NAME, (past, past))
        time.sleep(0.3)
        assert time.time() - (tmp_path / LOCK_NAME).stat().st_mtime < 5  # refreshed
        # another process decided we were dead and took the lock over
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "new"}))
        time.sleep(0.3)
        assert lock.lost
    assert (tmp_path / LOCK_NAME).exists()  # not ours any more: left alone on release


LEASE_CONTENDER = """
import sys, time
sys.path.insert(0, {repo!r})
from smelt_jax.train.lock import GcsLease, LockHeld
lease = GcsLease({folder!r}, description="run stable")
lease.info["host"] = "elsewhere"  # judged by its heartbeat, as on another host of a pod
while time.time() < {start!r}:
    pass
try:
    lease.acquire()
    print("WON", lease.token)
except LockHeld:
    print("HELD")
"""


@pytest.mark.integration  # real processes
def test_lease_race_between_processes_has_one_winner(tmp_path):
    """The lease that guards gs:// runs, raced by six real processes at one instant on a local folder
    (tensorstore's file kvstore gives the same generation-conditional writes as Cloud Storage): exactly
    one wins and the lock names it."""
    folder = tmp_path / "stable"
    start = time.time() + 6.0  # every process imported and waiting by then
    script = LEASE_CONTENDER.format(repo=str(REPO), folder=str(folder), start=start)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outputs = [proc.communicate(timeout=120)[0].split() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert time.time() > start
    winners = [out[1] for out in outputs if out[0] == "WON"]
    assert len(winners) == 1 and sum(out == ["HELD"] for out in outputs) == 5
    assert json.loads((folder / LOCK_NAME).read_text())["token"] == winners[0]


TWO_TRAINERS = """
import sys
sys.path.insert(0, {repo!r})
import experiments
from smelt_jax.data.token_store import TokenStore
import smelt_jax.train.trainer as trainer
from tests.test_trainer import _run
run = _run()
run = run.__class__(**{{**run.__dict__, "schedule": run.schedule.replace(stable_steps=40,
                                                                          fork_steps=(40,))}})
experiments.find_run = lambda run_id: run
trainer._load_corpus = lambda: TokenStore({corpus!r})
from smelt_jax.cli import main
sys.exit(main(["train", run.id, "--quiet", "--log-every", "1", "--checkpoint-every", "10"]))
"""


@pytest.mark.integration  # real processes
def test_two_trainers_of_one_run_one_trains_the_other_exits_2_at_once(tmp_path, corpus):
    """Issue item 3: the second trainer used to die after its start-up with an orbax TimeoutError
    traceback, having logged step 10 twice. Real processes, started together."""
    script = TWO_TRAINERS.format(repo=str(REPO), corpus=str(corpus.root))
    env = {**os.environ, "SMELT_RUNS_DIR": str(tmp_path)}
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    ended = {}
    while len(ended) < 2 and time.monotonic() - started < 600:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.05)
    outputs = [proc.communicate() for proc in procs]
    codes = sorted(proc.returncode for proc in procs)
    assert codes == [0, 2], outputs
    loser = next(i for i, proc in enumerate(procs) if proc.returncode == 2)
    winner = 1 - loser
    stderr = outputs[loser][1]
    lines = [line for line in stderr.splitlines() if line.startswith("smelt:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"pid {procs[winner].pid}" in lines[0] and "is being trained" in lines[0]
    print(f"second trainer exited 2 after {ended[loser]:.1f} s; the first trained for "
          f"{ended[winner]:.1f} s")
    assert ended[loser] < 60 and ended[loser] < ended[winner]
    metrics = next(tmp_path.glob("unit/*/stable/metrics.jsonl"))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 41))  # nothing logged twice
    assert not list(tmp_path.glob(f"unit/*/stable/{LOCK_NAME}"))  # released


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.data_helpers import build_tiny_corpus
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


# Options and overrides ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [{"log_every": 0}, {"checkpoint_every": 0}, {"checkpoint_every": -5},
                                 {"stop_after": -1}, {"stop_after": 0}, {"eval_every": -1},
                                 {"max_to_keep": 0}, {"log_every": 2.5}])
def test_bad_train_options_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).replace("_", "-")):
        TrainOptions(**bad)


@pytest.mark.parametrize("argv", [["--log-every", "0"], ["--checkpoint-every", "0"],
                                  ["--stop-after", "-1"], ["--checkpoint-every", "-5"],
                                  ["--override", "peak_lr=fast"], ["--override", "d_model=12.5"],
                                  ["--override", "fork_steps=[20,\"x\"]"]])
def test_bad_train_arguments_are_one_line_and_exit_2_before_start_up(argv, capsys):
    """Issue item 4: ZeroDivisionError after start-up, TypeError; -1 and -5 were accepted."""
    started = time.monotonic()
    assert main(["train", SMOKE_ID, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("smelt: error:"), err
    assert time.monotonic() - started < 20


def test_override_types_follow_the_field():
    import experiments
    run = experiments.find_run(SMOKE_ID)
    assert apply_overrides(run, ["schedule.peak_lr=1e-3"]).schedule.peak_lr == 1e-3
    assert apply_overrides(run, ["peak_lr=1"]).schedule.peak_lr == 1.0
    with pytest.raises(ConfigError, match="peak_lr.*number"):
        apply_overrides(run, ["peak_lr=fast"])


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
@pytest.mark.parametrize("command", [["train", SMOKE_ID], ["sweep", "submit", "--suite", "smoke", "--backend",
                                                            "local", "--quiet"]])
def test_read_only_runs_root_is_one_line_and_exit_2(tmp_path, command):
    """Issue item 4: `smelt train` and `smelt sweep submit` on a read-only runs root gave an OSError 30
    traceback. A real read-only bind mount in a private mount namespace."""
    root = tmp_path / "ro"
    root.mkdir()
    shell = (f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
             f"exec {sys.executable} -m smelt_jax " + " ".join(command))
    env = {**os.environ, "SMELT_RUNS_DIR": str(root), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("smelt:")]
    assert len(lines) == 1 and "Read-only file system" in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_filesystem_errors_the_user_can_fix_become_cli_errors():
    def full(_args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x")

    def bug(_args):
        raise OSError(errno.EBADF, "Bad file descriptor")

    with pytest.raises(CliError, match="cannot write /runs/x: No space left"):
        filesystem_errors(full)(None)
    with pytest.raises(OSError):
        filesystem_errors(bug)(None)  # a bug stays a traceback


# Fits, gains, results ----------------------------------------------------------------------------

def test_fit_out_naming_a_file_is_one_line(tmp_path, capsys):
    """Issue item 4: FileExistsError traceback."""
    from scaling_synthetic import paper_pair_table
    table = tmp_path / "t.csv"
    paper_pair_table(noise=0.002, seed=5).to_csv(table, index=False)
    out = tmp_path / "a_file"
    out.write_text("x")
    assert main(["fit", "--law", "smelt", "--input", str(table), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err


@pytest.mark.parametrize("compute", ["-5", "0", "1e300", "nan", "inf"])
def test_gain_rejects_non_positive_or_non_finite_compute(tmp_path, compute, capsys):
    """Issue item 6: exit 0 with 100.00% for C=-5, nan for 0, -inf% for 1e300."""
    coefficients = {"law": "smelt", "E": 1.5, "A": 1500.0, "K": 2e6, "a": 0.37, "b": 0.15, "c": 0.66}
    for name, a in (("ref", 0.37), ("tgt", 0.39)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "coefficients.json").write_text(json.dumps({**coefficients, "a": a}))
    code = main(["gain", "--reference", str(tmp_path / "ref"), "--target", str(tmp_path / "tgt"),
                 "--compute", "1e21", compute, "--sparsity", "0.9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "compute" in err, err


def test_gain_rows_check_compute_for_tables_too():
    from smelt_jax.scaling import gains
    from smelt_jax.scaling.laws import law_from_dict
    law = law_from_dict("smelt", {"E": 1.5, "A": 1500.0, "K": 2e6, "a": 0.37, "b": 0.15, "c": 0.66})
    with pytest.raises(ValueError, match="positive and finite"):
        gains.gain_rows(law, law, [0.0], [0.9])
    assert len(gains.gain_rows(law, law, [1e21], [0.9])) == 1


def test_fit_input_duplicates_warn_and_huge_values_name_the_column():
    """Issue item 8: duplicated rows were accepted silently; D=1e300 failed without naming D."""
    from scaling_synthetic import paper_pair_table

    from smelt_jax.scaling import io
    table = paper_pair_table(noise=0.002, seed=5)
    table = table[table["arch"] == "baseline"].reset_index(drop=True)
    doubled = pd.concat([table, table.iloc[:3]], ignore_index=True)
    with pytest.warns(io.DuplicateRowsWarning, match="3 row"):
        io.validate(doubled, "smelt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        io.validate(table, "smelt")  # no duplicates: no warning
    huge = table.copy()
    huge.loc[2, "D"] = 1e300
    with pytest.raises(ValueError, match=r"column 'D'.*rows \[2\]"):
        io.validate(huge, "smelt")


def _row(run_id: str, branch: int = 0):
    from smelt_jax.run_files.results import EndpointResult
    return EndpointResult(run_id=run_id, branch=branch, pair_id="p", suite="s", arch="baseline",
                          scale="tiny", sparsity_label="S0", sparsity=0.0, flops_per_token=1e6,
                          params=10 ** 6, tokens=512, cumulative_flops=5.12e8, val_loss=2.0)


def test_results_files_are_group_readable_and_collect_rewrites_the_csv(tmp_path):
    """Issue item 8: results files were 0600 and a truncated results.csv survived `results collect`."""
    from smelt_jax.run_files.results import CSV_NAME, TABLE_NAME, append_result, read_results
    from smelt_jax.sweep.collect import collect_suite
    suite_dir = tmp_path / "s"
    old = os.umask(0o022)
    try:
        append_result(_row("a"), suite_dir)
        append_result(_row("b"), suite_dir)
    finally:
        os.umask(old)
    for name in (TABLE_NAME, CSV_NAME):
        assert (suite_dir / name).stat().st_mode & 0o044 == 0o044, oct((suite_dir / name).stat().st_mode)
    csv = suite_dir / CSV_NAME
    csv.write_bytes(csv.read_bytes()[:40])  # truncated
    collect_suite("s", tmp_path)
    rewritten = pd.read_csv(csv)
    assert list(rewritten["run_id"]) == list(read_results(suite_dir)["run_id"]) == ["a", "b"]
    np.testing.assert_allclose(rewritten["val_loss"], 2.0)


# metrics.jsonl ------------------------------------------------------------------------------------

def test_torn_metrics_line_does_not_swallow_the_next_record_and_the_notebook_reads_it(
        tmp_path, monkeypatch):
    """Issue item 7: garbage with no newline at the end swallowed the next record, and the curves
    notebook crashed with UnicodeDecodeError."""
    import runpy

    from smelt_jax.train.metrics_log import MetricsWriter, TornLineWarning, read_metrics
    metrics = tmp_path / "smoke" / "smoke-xs-s85-baseline-0000" / "stable" / "metrics.jsonl"
    with MetricsWriter(metrics) as log:
        for step in (1, 2):
            log.write({"step": step, "tokens": 100 * step, "step_tokens": 99, "loss": 3.0 / step})
    with open(metrics, "ab") as handle:
        handle.write(b'{"step": 3, "lo\xff')  # killed mid-write
    with MetricsWriter(metrics) as log:  # the resumed trainer
        log.write({"step": 3, "tokens": 300, "step_tokens": 99, "loss": 1.0})
        log.write({"step": 3, "eval": {"overall": 1.5}})
    with pytest.warns(TornLineWarning, match=r"skipped 1 .*\[3\]"):
        records = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 3]
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path))
    monkeypatch.setenv("SMELT_SUITE", "smoke")
    with pytest.warns(TornLineWarning):
        scope = runpy.run_path(str(REPO / "notebooks" / "training_curves.py"))
    assert list(scope["curves"]["tokens"]) == [100, 200, 300]
    assert list(scope["evals"]["overall"]) == [1.5]


def test_a_phase_that_fails_before_its_first_record_leaves_no_empty_metrics_file(tmp_path):
    """Issue item 9: a store damaged under a running trainer (found only when a batch is read) left an
    empty metrics.jsonl. The writer now creates the file with its first record."""
    from smelt_jax.train.metrics_log import MetricsWriter
    metrics = tmp_path / "stable" / "metrics.jsonl"
    with pytest.raises(RuntimeError), MetricsWriter(metrics):
        raise RuntimeError("cannot read tokens 0..65535: the store is damaged")
    assert not metrics.exists()
    with MetricsWriter(metrics) as log:
        log.write({"step": 1, "loss": 2.0})
    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n'


def test_metrics_writer_writes_each_line_in_one_call(tmp_path, monkeypatch):
    """Line-atomic: one os.write per record (O_APPEND), never a buffered partial line."""
    from smelt_jax.train import metrics_log
    calls = []
    real_write = os.write

    def spy(fd, data):
        calls.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(metrics_log.os, "write", spy)
    with metrics_log.MetricsWriter(tmp_path / "m.jsonl") as log:
        log.write({"step": 1, "loss": 2.0, "pad": "x" * 20000})
    assert len(calls) == 1 and calls[0].endswith(b"\n") and calls[0].count(b"\n") == 1


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_smelt_train_on_a_full_tmpfs_stops_at_the_failed_save_with_one_line(tmp_path, corpus):
    """Issue item 2 through the CLI on a real full filesystem: the checkpoint folder is a 64 kB tmpfs.
    Before, the failed save was noticed only at the next save (37 tracebacks, temporary folder left
    behind)."""
    from tests.test_trainer import _run
    run = _run()
    run = run.__class__(**{**run.__dict__, "schedule": run.schedule.replace(stable_steps=40,
                                                                            fork_steps=(40,))})
    folder = tmp_path / "unit" / run.id / "stable" / "checkpoints"
    folder.mkdir(parents=True)
    script = tmp_path / "train.py"
    script.write_text(TWO_TRAINERS.format(repo=str(REPO), corpus=str(corpus.root)))
    shell = f"mount -t tmpfs -o size=64k none {folder} && exec {sys.executable} {script}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=REPO, capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "SMELT_RUNS_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and line[:2] not in ("I1", "W1")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "step 10" in lines[0] and "No space left on device" in lines[0]
    assert "no checkpoint of this phase is saved, so the run starts the phase again" in lines[0]
    metrics = next(tmp_path.glob("unit/*/stable/metrics.jsonl"))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert 10 <= max(steps) < 20, steps  # stopped right after the failed save, not at the next one


def test_null_override_only_for_optional_fields():
    import dataclasses

    import experiments
    run = experiments.find_run(SMOKE_ID)
    optional = next(f.name for f in dataclasses.fields(run.model) if "None" in str(f.type))
    assert getattr(apply_overrides(run, [f"model.{optional}=null"]).model, optional) is None
    with pytest.raises(ConfigError, match="peak_lr"):
        apply_overrides(run, ["peak_lr=null"])


@pytest.mark.integration  # real processes
def test_lock_of_a_killed_trainer_is_taken_over_by_the_next_one(tmp_path, corpus):
    """kill -9 leaves trainer.lock behind; the next `smelt train` of the run takes it over at once
    (same host, dead pid) and finishes."""
    import signal
    script = TWO_TRAINERS.format(repo=str(REPO), corpus=str(corpus.root))
    env = {**os.environ, "SMELT_RUNS_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        found = list(tmp_path.glob("unit/*/stable/metrics.jsonl"))
        if found and found[0].read_text().count("\n") >= 3:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    lock = next(tmp_path.glob(f"unit/*/stable/{LOCK_NAME}"))
    assert json.loads(lock.read_text())["pid"] == proc.pid  # left behind
    again = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                           capture_output=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"took over the stale lock of pid {proc.pid}" in again.stderr
    assert not lock.exists()

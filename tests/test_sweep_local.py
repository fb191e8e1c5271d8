"""The local backend against a fake trainer (tests/sweep_fake_trainer.py): a full sweep, exit-42
restarts, failures, a sweep SIGKILLed mid-way and restarted, endpoint rows repaired by collect."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from experiments import load_suite
from smelt_jax.run_files.results import read_results
from smelt_jax.run_files.rundir import results_dir, run_dir
from smelt_jax.sweep.collect import collect
from smelt_jax.sweep.graph import JobStatus, artifact_statuses, build_graph
from smelt_jax.sweep.summary import summarize
from smelt_jax.sweep.local import (
    LocalBackend,
    LocalSettings,
    SweepError,
    load_state,
    run_local,
)

FAKE = Path(__file__).parent / "sweep_fake_trainer.py"
REPO = Path(__file__).resolve().parents[1]
N_RUNS = 2  # 2 stable + 4 branch jobs of the smoke suite (each fake start costs ~1 s)


def graph():
    return build_graph(load_suite("smoke")[:N_RUNS])


@pytest.fixture
def env(tmp_path, monkeypatch):
    log = tmp_path / "trainer.log"
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("FAKE_TRAINER_LOG", str(log))
    monkeypatch.setenv("FAKE_TRAINER_SLEEP", "0.02")
    for knob in ("FAKE_TRAINER_INTERRUPT", "FAKE_TRAINER_FAIL", "FAKE_TRAINER_NO_ROW"):
        monkeypatch.delenv(knob, raising=False)
    return tmp_path / "runs", log


def settings(root, parallel=2):
    return LocalSettings(root=root, command=(sys.executable, str(FAKE)), parallel=parallel,
                         progress=False, poll_seconds=0.05)


def events(log: Path) -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def test_full_sweep_then_nothing_to_redo(env):
    root, log = env
    g = graph()
    statuses = run_local(g, settings(root))
    assert set(statuses.values()) == {JobStatus.DONE}
    table = read_results(results_dir(g.suite, root))
    assert len(table) == 2 * N_RUNS
    assert sorted(zip(table.run_id, table.branch)) == sorted(
        (j.run.id, j.branch) for j in g.jobs if not j.is_stable)
    starts = Counter((e[1], e[2]) for e in events(log) if e[0] == "start")
    assert len(starts) == len(g.jobs) and set(starts.values()) == {1}
    # every branch started only after its fork checkpoint existed: the fake exits 4 otherwise
    assert all(e["exit_code"] == 0 for e in load_state(g.suite, root)["jobs"].values())
    before = len(events(log))
    assert set(run_local(g, settings(root)).values()) == {JobStatus.DONE}
    assert len(events(log)) == before  # a second sweep runs nothing


def test_exit_42_is_restarted(env, monkeypatch):
    root, log = env
    g = graph()
    stable = g.jobs[0]
    monkeypatch.setenv("FAKE_TRAINER_INTERRUPT", f"{stable.run.id}:stable")
    statuses = run_local(g, settings(root, parallel=1))
    assert set(statuses.values()) == {JobStatus.DONE}
    entry = load_state(g.suite, root)["jobs"][stable.name]
    assert entry["restarts"] == 1 and entry["attempts"] == 2
    assert ("interrupted", stable.run.id, "stable") in events(log)


def test_failure_is_reported_and_dependents_wait(env, monkeypatch):
    root, _ = env
    g = graph()
    bad = g.jobs[0]
    monkeypatch.setenv("FAKE_TRAINER_FAIL", f"{bad.run.id}:stable")
    statuses = run_local(g, settings(root))
    assert statuses[bad.name] == JobStatus.FAILED
    assert {statuses[j.name] for j in g.jobs if j.run.id == bad.run.id and not j.is_stable} == {JobStatus.PENDING}
    assert {statuses[j.name] for j in g.jobs if j.run.id != bad.run.id} == {JobStatus.DONE}
    assert LocalBackend(settings(root)).status(g)[bad.name] == JobStatus.FAILED
    assert LocalBackend(settings(root)).submit(g) == 1


def test_run_suite_locally_raises_naming_the_failed_job(env, monkeypatch):
    from smelt_jax.sweep import local
    root, _ = env
    g = graph()
    monkeypatch.setattr(local, "suite_graph", lambda suite: g)
    monkeypatch.setenv("FAKE_TRAINER_FAIL", f"{g.jobs[3].run.id}:b0")
    with pytest.raises(SweepError, match=f"{g.jobs[4].name}.*failed: exit code 3"):  # b0 of run 2
        local.run_suite_locally("smoke", root=root, command=[sys.executable, str(FAKE)],
                                progress=False)
    monkeypatch.delenv("FAKE_TRAINER_FAIL")
    statuses = local.run_suite_locally("smoke", root=root, command=[sys.executable, str(FAKE)],
                                       progress=False)  # the retry finishes the suite
    assert set(statuses.values()) == {JobStatus.DONE}


def test_endpoint_without_row_is_collected_not_retrained(env, monkeypatch):
    """A trainer killed between endpoint.json and the store's append: collect restores the row."""
    root, _ = env
    g = graph()
    stable, branch = g.jobs[0], g.jobs[1]
    fake = [sys.executable, str(FAKE), *branch.train_args()]
    subprocess.run([sys.executable, str(FAKE), *stable.train_args()], check=True)
    proc = subprocess.run(fake, check=False, env={**os.environ, "FAKE_TRAINER_NO_ROW": f"{branch.run.id}:b0"})
    assert proc.returncode == 9
    assert artifact_statuses(g, root)[branch.name] == JobStatus.READY  # endpoint alone: not done
    before = summarize(g, artifact_statuses(g, root), root)  # what `smelt sweep status` prints
    assert (before.endpoints_written, before.endpoints_in_store, before.endpoints_expected) == (1, 0, 2 * N_RUNS)
    reports = collect(root, ["smoke"])
    assert (reports[0].endpoints, reports[0].appended) == (1, 1)
    assert artifact_statuses(g, root)[branch.name] == JobStatus.DONE
    after = summarize(g, artifact_statuses(g, root), root)
    assert (after.endpoints_written, after.endpoints_in_store, after.counts["done"]) == (1, 1, 2)
    assert collect(root, ["smoke"])[0].appended == 0  # idempotent
    row = json.loads(run_dir(g.suite, branch.run.id, root).endpoint(0).read_text())
    table = read_results(results_dir(g.suite, root))
    assert len(table) == 1
    assert table.val_loss[0] == row["val_loss"] and table.loss_web[0] == row["loss_web"]


def test_sweep_repairs_a_lost_row_instead_of_retraining(env, monkeypatch):
    root, log = env
    g = graph()
    branch = g.jobs[1]
    monkeypatch.setenv("FAKE_TRAINER_NO_ROW", f"{branch.run.id}:b0")
    statuses = run_local(g, settings(root))
    assert set(statuses.values()) == {JobStatus.DONE}  # exit 9, but its endpoint is collected
    starts = [e for e in events(log) if e[:3] == ("start", branch.run.id, "b0")]
    assert len(starts) == 1
    assert len(read_results(results_dir(g.suite, root))) == 2 * N_RUNS


DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from experiments import load_suite
from smelt_jax.sweep.graph import build_graph
from smelt_jax.sweep.local import LocalSettings, run_local
graph = build_graph(load_suite("smoke")[:{n}])
run_local(graph, LocalSettings(root=Path({root!r}), command=(sys.executable, {fake!r}),
                               parallel=2, progress=False, poll_seconds=0.05))
"""


def test_killed_sweep_resumes_without_redoing_or_losing(env, monkeypatch):
    root, log = env
    g = graph()
    monkeypatch.setenv("FAKE_TRAINER_SLEEP", "0.3")
    driver = DRIVER.format(repo=str(REPO), n=N_RUNS, root=str(root), fake=str(FAKE))
    sweep = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while sum(e[0] == "end" for e in events(log)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    time.sleep(0.5)  # the trainers get SIGTERM from the parent-death signal
    done_before = {n for n, s in artifact_statuses(g, root).items() if s == JobStatus.DONE}
    assert 2 <= len(done_before) < len(g.jobs)
    assert JobStatus.RUNNING not in LocalBackend(settings(root)).status(g).values()  # sweep dead
    rows_before = set(zip(*[read_results(results_dir(g.suite, root))[c] for c in ("run_id", "branch")]))

    n_events = len(events(log))
    monkeypatch.setenv("FAKE_TRAINER_SLEEP", "0.02")
    assert set(run_local(g, settings(root)).values()) == {JobStatus.DONE}
    by_name = g.by_name
    restarted = {(e[1], e[2]) for e in events(log)[n_events:] if e[0] == "start"}
    redone = {n for n in done_before if (by_name[n].run.id, by_name[n].phase) in restarted}
    assert redone == set()  # nothing finished before the kill ran again
    table = read_results(results_dir(g.suite, root))
    rows = set(zip(table.run_id, table.branch))
    assert rows_before <= rows and len(rows) == len(table) == 2 * N_RUNS  # no row lost or doubled


def test_second_sweep_on_the_same_suite_is_refused(env):
    root, _ = env
    g = graph()
    from smelt_jax.sweep.local import _sweep_lock
    with _sweep_lock(g.suite, root), pytest.raises(SweepError, match="another sweep"):
        run_local(g, settings(root))

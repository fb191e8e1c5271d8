"""The `local` backend: runs a suite's jobs as subprocesses on this machine, `parallel` at a time.

    <runs root>/<suite>/.sweep/sweep.lock    held (flock) by the live sweep; released when it dies
    <runs root>/<suite>/.sweep/state.json    per job: status, pid, exit code, attempts, restarts, log
    <runs root>/<suite>/.sweep/logs/<job>.log

What to run comes from the artifacts (graph.artifact_statuses), so a sweep killed at any point and
started again skips finished jobs and reruns only the rest; trainers resume from their own committed
checkpoints. The state file only adds what artifacts cannot say: which job is running, which failed.
A trainer exiting 42 (interrupted after saving) is restarted; any other non-zero exit marks the job
failed and the sweep carries on with everything that does not depend on it. Trainer processes die
with the sweep (Linux parent-death signal), so no orphan keeps training after a kill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from smelt_jax.platform.errors import SmeltError, UsageError
from smelt_jax.run_files.rundir import runs_root
from smelt_jax.sweep.base import PlannedJob, quote
from smelt_jax.sweep.collect import collect_suite
from smelt_jax.sweep.graph import (
    Job,
    JobGraph,
    JobStatus,
    artifact_statuses,
    count_statuses,
    suite_graph,
)

from smelt_jax.platform.exit_codes import PREEMPTED as RESTART_EXIT_CODE
DEFAULT_COMMAND = (sys.executable, "-m", "smelt_jax")
REFRESH_SECONDS = 2.0  # how often free slots look for branches that became ready mid-run


class SweepError(SmeltError, RuntimeError):
    """A local sweep ended with jobs that are not done."""


@dataclasses.dataclass(frozen=True)
class LocalSettings:
    root: Path | None = None  # runs root; default $SMELT_RUNS_DIR or ./runs
    command: tuple[str, ...] = DEFAULT_COMMAND  # the trainer; each job appends its train arguments
    parallel: int = 1
    max_restarts: int = 100  # exit-42 restarts of one job within one sweep
    poll_seconds: float = 0.2
    progress: bool = True
    data_dir: str | None = None  # the token store every job trains on (`--data-dir`); None: each run's own

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise UsageError(f"--parallel must be >= 1, got {self.parallel}")
        if not self.command:
            raise UsageError("the trainer command must not be empty")

    @property
    def runs_root(self) -> Path:
        return Path(self.root) if self.root is not None else runs_root()


def _collect(suite: str, root: Path, reported: set[str]) -> None:
    """Collects the suite's endpoint rows; an endpoint file that cannot be collected (damaged, NaN) is
    named on stderr once per sweep, and its branch stays done on disk: fix or delete the file."""
    for problem in collect_suite(suite, root).problems:
        if problem not in reported:
            reported.add(problem)
            print(f"sweep {suite}: not collected: {problem}", file=sys.stderr)


def sweep_dir(suite: str, root: Path) -> Path:
    return root / suite / ".sweep"


def job_command(job: Job, settings: LocalSettings) -> list[str]:
    """The trainer command of `job`: the settings' command, the job's train arguments and, when the
    sweep names one, `--data-dir STORE` (each trainer also checks it against its run's record)."""
    data = ["--data-dir", str(settings.data_dir)] if settings.data_dir else []
    return [*settings.command, *job.train_args(), *data]


# State file and lock ---------------------------------------------------------------------------

_STATE_SKIPPED: set[str] = set()


def _parse_state(text: str) -> dict:
    try:
        state = json.loads(text)
    except ValueError as err:
        raise UsageError(f"damaged ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(state, dict) or not isinstance(state.get("jobs", {}), dict):
        raise UsageError("damaged (not a sweep state object)")
    return state


def load_state(suite: str, root: Path) -> dict:
    """The sweep's state (attempts, pids, failed jobs); a damaged state.json is named once on stderr and
    read as empty: the job statuses then come from the run folders alone (`readers.read_item`)."""
    from smelt_jax.run_files.readers import Skipped, read_item
    path = sweep_dir(suite, root) / "state.json"
    if not path.exists():
        return {"jobs": {}}
    state = read_item(path, _parse_state)
    if isinstance(state, Skipped):
        if state.path not in _STATE_SKIPPED:
            _STATE_SKIPPED.add(state.path)
            print(f"smelt: {state.line()}; job statuses come from the run folders alone (the next local "
                  "sweep writes it again)", file=sys.stderr)
        return {"jobs": {}}
    return state


def _save_state(suite: str, root: Path, state: dict) -> None:
    path = sweep_dir(suite, root) / "state.json"
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(temp, path)  # readers see the old state or the new one


def sweep_alive(suite: str, root: Path) -> bool:
    """Whether a sweep holds this suite's lock (works from any process, including the holder)."""
    path = sweep_dir(suite, root) / "sweep.lock"
    if not path.exists():
        return False
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


@contextlib.contextmanager
def _sweep_lock(suite: str, root: Path) -> Iterator[None]:
    folder = sweep_dir(suite, root)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    with open(folder / "sweep.lock", "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = load_state(suite, root).get("sweep_pid", "?")
            raise SweepError(f"another sweep of suite {suite!r} is running (pid {pid}) on "
                             f"{root}; wait for it or cancel it") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _pid_runs(pid: int | None, marker: str) -> bool:
    """Whether `pid` is alive and its command line mentions `marker` (guards against pid reuse)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return marker in cmdline


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the sweep process dies (Linux; a no-op elsewhere)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# The sweep -------------------------------------------------------------------------------------

class _Progress:
    """A bar of finished jobs (a line per change off a terminal), with the running ones as its postfix."""

    def __init__(self, graph: JobGraph, done: int, enabled: bool):
        from smelt_jax.platform.progress import progress_bar
        self.bar = progress_bar(len(graph.jobs), initial=done, desc=f"sweep {graph.suite}",
                                unit="job", disable=not enabled)
        self.shown: tuple = ()

    def update(self, done: int, running: Sequence[str], failed: int) -> None:
        if (done, tuple(running), failed) == self.shown:
            return
        self.shown = (done, tuple(running), failed)
        self.bar.n = done
        self.bar.set_postfix_str(f"running {','.join(running) or '-'} failed {failed}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def run_local(graph: JobGraph, settings: LocalSettings | None = None) -> dict[str, JobStatus]:
    """Runs every job that is not done until none can run; returns each job's final status."""
    settings = settings or LocalSettings()
    root = settings.runs_root
    with _sweep_lock(graph.suite, root):
        return _sweep(graph, settings, root)


def _sweep(graph: JobGraph, settings: LocalSettings, root: Path) -> dict[str, JobStatus]:
    suite, by_name = graph.suite, graph.by_name
    state = load_state(suite, root)
    state["sweep_pid"] = os.getpid()
    entries: dict[str, dict] = state.setdefault("jobs", {})

    # Trainers of a killed sweep normally died with it; one that did not is waited for, not doubled.
    adopted = {name: e["pid"] for name, e in entries.items()
               if e.get("status") == "running" and name in by_name
               and _pid_runs(e.get("pid"), by_name[name].run.id)}
    for name, entry in entries.items():
        if entry.get("status") == "running" and name not in adopted:
            entry["status"] = "interrupted"

    reported: set[str] = set()
    _collect(suite, root, reported)  # rows lost between endpoint.json and the store's append
    statuses = artifact_statuses(graph, root)
    procs: dict[str, tuple[subprocess.Popen, object]] = {}
    failed: set[str] = set()
    exited_ok: set[str] = set()  # exited 0 in this sweep: must have left their artifacts
    restart_first: list[str] = []
    stop = {"signal": None}
    previous = {sig: signal.signal(sig, lambda s, _f: stop.update(signal=s))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    progress = _Progress(graph, sum(s == JobStatus.DONE for s in statuses.values()), settings.progress)
    last_refresh = time.monotonic()

    def launch(job: Job) -> None:
        entry = entries.setdefault(job.name, {})
        log_path = sweep_dir(suite, root) / "logs" / f"{job.name}.log"
        log = open(log_path, "ab")  # noqa: SIM115  (the child writes it; closed when it exits)
        env = {**os.environ, "SMELT_RUNS_DIR": str(root)}
        proc = subprocess.Popen(job_command(job, settings), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509  (no threads here)
        procs[job.name] = (proc, log)
        entry.update(status="running", pid=proc.pid, log=str(log_path),
                     attempts=entry.get("attempts", 0) + 1, started=time.time())

    try:
        while True:
            changed = False
            for name, (proc, log) in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                log.close()
                del procs[name]
                changed = True
                entry = entries[name]
                entry.update(status="exited", exit_code=code, ended=time.time())
                if code == RESTART_EXIT_CODE and stop["signal"] is None:
                    entry["restarts"] = entry.get("restarts", 0) + 1
                    if entry["restarts"] > settings.max_restarts:
                        entry["status"] = "failed"
                        failed.add(name)
                    else:
                        restart_first.append(name)
                elif code == 0:
                    exited_ok.add(name)
                elif code != RESTART_EXIT_CODE:
                    entry["status"] = "failed"
                    failed.add(name)
            for name, pid in list(adopted.items()):
                if not _pid_runs(pid, by_name[name].run.id):
                    del adopted[name]
                    entries[name]["status"] = "exited"
                    changed = True
            if stop["signal"] is not None:
                break

            slots = settings.parallel - len(procs) - len(adopted)
            if changed or (slots > 0 and time.monotonic() - last_refresh > REFRESH_SECONDS):
                if changed:
                    _collect(suite, root, reported)
                done = frozenset(n for n, s in statuses.items() if s == JobStatus.DONE)
                statuses = artifact_statuses(graph, root, known_done=done)
                last_refresh = time.monotonic()
                for name in exited_ok - failed:  # exit 0 must leave the job's artifacts
                    if statuses[name] != JobStatus.DONE:
                        entries[name].update(status="failed",
                                             error="exited 0 but its artifacts are missing")
                        failed.add(name)

            order = restart_first + [job.name for job in graph.jobs]
            for name in order:
                if slots <= 0:
                    break
                if (statuses[name].runnable and name not in procs and name not in adopted
                        and name not in failed):
                    launch(by_name[name])
                    slots -= 1
                    changed = True
            restart_first.clear()
            if changed:
                _save_state(suite, root, state)
            done_count = sum(s == JobStatus.DONE for s in statuses.values())
            progress.update(done_count, sorted(procs) + sorted(adopted), len(failed))
            if not procs and not adopted:
                break
            time.sleep(settings.poll_seconds)
    finally:
        for proc, _log in procs.values():  # on a signal or error: let trainers save and stop
            proc.terminate()
        for name, (proc, log) in procs.items():
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            log.close()
            entries[name].update(status="interrupted", exit_code=code, ended=time.time())
        _save_state(suite, root, state)
        progress.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    if stop["signal"] is not None:
        raise SweepError(f"sweep of {suite!r} stopped by signal {stop['signal']}; run it again to resume")
    return {name: (JobStatus.FAILED if name in failed and s != JobStatus.DONE else s)
            for name, s in statuses.items()}


def local_statuses(graph: JobGraph, root: Path) -> dict[str, JobStatus]:
    """Artifacts first; then RUNNING (a live sweep runs it) or FAILED (its last attempt failed)."""
    statuses = artifact_statuses(graph, root)
    entries = load_state(graph.suite, root).get("jobs", {})
    alive = sweep_alive(graph.suite, root)
    for name, status in statuses.items():
        entry = entries.get(name, {})
        if status == JobStatus.DONE:
            continue
        if entry.get("status") == "running" and alive:
            statuses[name] = JobStatus.RUNNING
        elif entry.get("status") == "failed":
            statuses[name] = JobStatus.FAILED
    return statuses


def failure_summary(graph: JobGraph, statuses: dict[str, JobStatus], root: Path) -> str:
    entries = load_state(graph.suite, root).get("jobs", {})
    lines = []
    for job in graph.jobs:
        status = statuses[job.name]
        if status == JobStatus.FAILED:
            entry = entries.get(job.name, {})
            why = entry.get("error") or f"exit code {entry.get('exit_code')}"
            lines.append(f"  {job.name} ({job.run.id} {job.phase}) failed: {why}; log {entry.get('log')}")
        elif status == JobStatus.DAMAGED:
            lines.append(f"  {job.name} ({job.run.id} {job.phase}) not run: a checkpoint it must "
                         f"provide is damaged (`smelt train {job.run.id}` moves it aside and retrains it)")
        elif status != JobStatus.DONE:
            lines.append(f"  {job.name} ({job.run.id} {job.phase}) not run: {status.value} "
                         f"(waits for the stable checkpoint at step {job.fork_step})")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class LocalBackend:
    settings: LocalSettings = dataclasses.field(default_factory=LocalSettings)
    name: str = "local"

    def plan(self, graph: JobGraph) -> list[PlannedJob]:
        return [PlannedJob(job.name, (quote(job_command(job, self.settings)),)) for job in graph.jobs]

    def submit(self, graph: JobGraph, *, execute: bool = True) -> int:
        """Runs the sweep in the foreground (the local backend has no dry run: `plan` is one)."""
        statuses = run_local(graph, self.settings)
        counts = count_statuses(statuses)
        print(f"sweep {graph.suite}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
        if counts["done"] != len(graph.jobs):
            print(failure_summary(graph, statuses, self.settings.runs_root), file=sys.stderr)
            return 1
        return 0

    def status(self, graph: JobGraph) -> dict[str, JobStatus]:
        return local_statuses(graph, self.settings.runs_root)

    def cancel(self, graph: JobGraph, names: list[str] | None = None, *,
               execute: bool = True) -> list[str]:
        """Stops the live sweep of the suite (SIGTERM: its trainers save and exit 42)."""
        if names:
            raise UsageError("the local backend cancels a whole sweep, not single jobs")
        root = self.settings.runs_root
        pid = load_state(graph.suite, root).get("sweep_pid")
        if not sweep_alive(graph.suite, root) or not pid:
            return []
        if execute:
            os.kill(pid, signal.SIGTERM)
        return [f"kill -TERM {pid}"]


def run_suite_locally(suite: str, *, root: Path | None = None, parallel: int = 1,
                      command: Sequence[str] | None = None,
                      progress: bool = True, data_dir: str | None = None) -> dict[str, JobStatus]:
    """Trains a whole suite here (stable runs, then their decay branches, rows in the results store) on
    the token store `data_dir` (default: each run's own); resumes where a previous call stopped.
    Returns when every job is done; raises `SweepError` naming the failed jobs and their logs
    otherwise."""
    graph = suite_graph(suite)
    settings = LocalSettings(root=root, parallel=parallel, progress=progress, data_dir=data_dir,
                             command=tuple(command) if command else DEFAULT_COMMAND)
    statuses = run_local(graph, settings)
    if any(s != JobStatus.DONE for s in statuses.values()):
        raise SweepError(f"suite {suite!r}: {sum(s != JobStatus.DONE for s in statuses.values())} "
                         f"of {len(statuses)} jobs not done\n"
                         + failure_summary(graph, statuses, settings.runs_root))
    return statuses

"""The job graph of a suite: per run one stable job and one job per decay branch.

A branch job depends on the stable job only through an artifact: it is READY as soon as the stable
run's checkpoint at its fork step is committed and whole, so it may start while the stable run
continues. A job is DONE only when its artifacts exist, never because a scheduler said so:

    stable job   the committed, whole checkpoint at `schedule.stable_steps`
    branch job   `branch<k>/endpoint.json` AND its row in the suite's results store

"Whole" is `checkpoint_format.checkpoint_damage`'s cheap check (every file the step's checksum file records is
there with its size). A stable job whose final checkpoint, or the fork checkpoint of a branch not done
yet, is damaged is DAMAGED: it must run again (its trainer moves the damaged step aside and retrains
it), and the branches forking from a damaged step stay PENDING until it has.

Job names are `<model>-<phase>-<hash>`: `model` says what trains (arch, scale, sparsity, variant),
`phase` is `stable` or `b<k>`, and `hash` digests the run id (itself a content hash) and the phase.
Resubmitting therefore reuses the same names, and two grid points never share one. Names are RFC 1123
labels (lower-case letters, digits, '-') that start with a letter and are at most `MAX_NAME_LEN`
characters, short enough for JobSet to derive its child Job and Pod names and for xpk.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from smelt_jax.design.config import content_hash
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files.checkpoint_format import checkpoint_damage, committed_steps
from smelt_jax.run_files.rundir import results_dir, run_dir, runs_root
from smelt_jax.platform import storage
from smelt_jax.platform.storage import as_path
from smelt_jax.platform.errors import UnknownName, UsageError

# JobSet names child Jobs `<jobset>-<replicated job>-<index>` and Pods add `-<index>-<5 chars>`, all
# within 63 characters; xpk also caps workload names. 40 leaves room for both.
MAX_NAME_LEN = 40
HASH_LEN = 8
_K8S_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class JobStatus(str, enum.Enum):
    PENDING = "pending"  # waiting for the stable checkpoint it forks from
    READY = "ready"      # may start now
    RUNNING = "running"  # a backend reports a live process (local backend only)
    DONE = "done"        # its artifacts exist
    FAILED = "failed"    # its last attempt exited with an error (local backend only)
    DAMAGED = "damaged"  # a stable job whose needed checkpoint is damaged: runs again to repair it

    @property
    def runnable(self) -> bool:
        """May be started now (READY, or DAMAGED: the trainer repairs the damaged checkpoint)."""
        return self in (JobStatus.READY, JobStatus.DAMAGED)


def is_valid_job_name(name: str) -> bool:
    """An RFC 1123 label that starts with a letter and fits `MAX_NAME_LEN`."""
    return len(name) <= MAX_NAME_LEN and bool(_K8S_NAME.match(name))


def _slug(text: str) -> str:
    """Lower-case letters, digits and single dashes ('1.6b' -> '1p6b')."""
    text = text.lower().replace(".", "p")
    text = re.sub(r"[^a-z0-9]+", "-", text)
    return re.sub(r"-+", "-", text).strip("-")


def model_label(run: RunSpec) -> str:
    """`<arch>-<scale>-<sparsity>[-<variant>]`; starts with the arch, hence with a letter."""
    parts = [run.arch, run.scale, run.sparsity_label] + ([run.variant] if run.variant else [])
    return _slug("-".join(parts))


def phase_label(branch: int | None) -> str:
    return "stable" if branch is None else f"b{branch}"


def job_name(run: RunSpec, branch: int | None) -> str:
    """`<model>-<phase>-<hash>`, shortened deterministically (the model label is cut, never the
    phase or the hash) to at most `MAX_NAME_LEN` characters."""
    phase = phase_label(branch)
    digest = content_hash({"run": run.id, "phase": phase}, length=HASH_LEN)
    room = MAX_NAME_LEN - len(phase) - len(digest) - 2
    model = model_label(run)[:room].rstrip("-")
    name = f"{model}-{phase}-{digest}"
    if not is_valid_job_name(name):  # cannot happen for valid RunSpecs; guards future fields
        raise ValueError(f"derived job name {name!r} is not a valid Kubernetes name")
    return name


@dataclasses.dataclass(frozen=True)
class Job:
    """One process to run: the stable phase of `run` (branch None) or its decay branch `branch`."""

    name: str
    run: RunSpec
    branch: int | None

    @property
    def phase(self) -> str:
        return phase_label(self.branch)

    @property
    def is_stable(self) -> bool:
        return self.branch is None

    @property
    def fork_step(self) -> int | None:
        return None if self.branch is None else self.run.schedule.fork_steps[self.branch]

    def train_args(self) -> list[str]:
        """Arguments after `python -m smelt_jax`: the trainer's contract."""
        args = ["train", self.run.id]
        return args if self.branch is None else args + ["--branch", str(self.branch)]


@dataclasses.dataclass(frozen=True)
class JobGraph:
    suite: str
    jobs: tuple[Job, ...]  # per run: its stable job, then its branches in fork order

    @property
    def by_name(self) -> dict[str, Job]:
        return {job.name: job for job in self.jobs}

    def stable_job(self, job: Job) -> Job:
        """The stable job a job forks from (itself for a stable job)."""
        return next(j for j in self.jobs if j.run.id == job.run.id and j.is_stable)

    def select(self, names: Iterable[str] | None) -> list[Job]:
        if names is None:
            return list(self.jobs)
        by_name = self.by_name
        unknown = sorted(set(names) - set(by_name))
        if unknown:
            raise UnknownName(f"no job(s) {unknown} in suite {self.suite!r}")
        return [by_name[n] for n in names]


def build_graph(runs: Sequence[RunSpec]) -> JobGraph:
    """The graph of a suite's runs; raises if the runs mix suites or two jobs share a name."""
    suites = sorted({run.suite for run in runs})
    if len(suites) != 1:
        raise ValueError(f"a job graph holds one suite, got {suites or 'no runs'}")
    jobs = []
    for run in runs:
        jobs.append(Job(job_name(run, None), run, None))
        jobs += [Job(job_name(run, k), run, k) for k in range(len(run.schedule.fork_steps))]
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"job names collide in suite {suites[0]!r}: {dupes} (duplicate runs?)")
    return JobGraph(suites[0], tuple(jobs))


def suite_graph(suite: str) -> JobGraph:
    from smelt_jax.design import suites  # the descriptors live at the top of the repository (experiments/)
    runs = suites.load_suite(suite)
    if not runs:
        raise UsageError(f"suite {suite!r} has no runs yet (e.g. `nano` waits for the learning rates "
                         "its `nanolr` sweep fixes: docs/nano.md)")
    return build_graph(runs)


# Artifacts -------------------------------------------------------------------------------------

def endpoint_key(row: dict) -> tuple:
    """An endpoint's identity in the results store: (run_id, branch)."""
    from smelt_jax.run_files.results import KEY
    return tuple(row[k] for k in KEY)


def stored_endpoint_keys(suite: str, root: Path) -> set[tuple]:
    """The (run_id, branch) of every row in the suite's results store (empty if none yet)."""
    from smelt_jax.run_files.results import KEY, TABLE_NAME, read_results
    folder = results_dir(suite, root)
    if not storage.exists(storage.join(folder, TABLE_NAME)):
        return set()
    table = read_results(folder)
    return {tuple(int(v) if k == "branch" else v for k, v in zip(KEY, values))
            for values in table[list(KEY)].itertuples(index=False)}


def artifact_statuses(graph: JobGraph, root: Path | None = None,
                      known_done: frozenset[str] = frozenset()) -> dict[str, JobStatus]:
    """PENDING / READY / DAMAGED / DONE for every job, from the files under the runs root alone.
    Jobs in `known_done` are not checked again (artifacts are never removed during a sweep)."""
    root = as_path(root) if root is not None else runs_root()  # a gs:// root is read directly
    storage.require_folder(root, "runs root")  # a file would read as "nothing trained yet"
    stored: set[tuple] | None = None  # read once, and only if some endpoint exists
    out: dict[str, JobStatus] = {}
    good_cache: dict[str, set[int]] = {}
    damaged_cache: dict[str, set[int]] = {}
    for job in graph.jobs:  # branches first; a stable job's status depends on theirs (below)
        if job.name in known_done:
            out[job.name] = JobStatus.DONE
            continue
        rdir = run_dir(graph.suite, job.run.id, root)
        if job.run.id not in good_cache:
            folder = rdir.checkpoints(None)
            steps = committed_steps(folder)
            damaged_cache[job.run.id] = {s for s in steps if checkpoint_damage(folder, s)}
            good_cache[job.run.id] = set(steps) - damaged_cache[job.run.id]
        good = good_cache[job.run.id]
        if job.is_stable:
            continue
        endpoint = rdir.endpoint(job.branch)
        if storage.exists(endpoint):
            if stored is None:
                stored = stored_endpoint_keys(graph.suite, root)
            if (job.run.id, job.branch) in stored:
                out[job.name] = JobStatus.DONE
                continue
        out[job.name] = JobStatus.READY if job.fork_step in good else JobStatus.PENDING
    for job in graph.jobs:
        if not job.is_stable or job.name in out:
            continue
        good, damaged = good_cache[job.run.id], damaged_cache[job.run.id]
        final = job.run.schedule.stable_steps
        needed = {final} | {j.fork_step for j in graph.jobs
                            if j.run.id == job.run.id and not j.is_stable and out[j.name] != JobStatus.DONE}
        if needed & damaged:
            out[job.name] = JobStatus.DAMAGED
        else:
            out[job.name] = JobStatus.DONE if final in good else JobStatus.READY
    return {job.name: out[job.name] for job in graph.jobs}


def count_statuses(statuses: dict[str, JobStatus]) -> dict[str, int]:
    return {s.value: sum(1 for v in statuses.values() if v == s) for s in JobStatus}

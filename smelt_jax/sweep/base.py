"""One interface for every sweep backend, and what the two cloud backends share.

    plan(graph)                 -> list[PlannedJob]: what each job would run (commands, files)
    submit(graph, execute=...)  -> runs the jobs (local) or writes + prints them; cloud backends only
                                   run them with execute=True (`--submit`)
    status(graph)               -> {job name: JobStatus}
    cancel(graph, names=None, execute=...)

Status always starts from the artifacts (graph.artifact_statuses): a scheduler's word never makes a
job done. The cloud backends submit only READY jobs, so a branch goes out once its fork checkpoint is
committed; rerunning `submit` later sends the branches that became ready (names are content-derived,
so a job already on the cluster keeps its name and the cluster rejects the duplicate).
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from smelt_jax.rundir import results_path, run_dir
from smelt_jax.sweep.graph import Job, JobGraph, JobStatus, artifact_statuses


@dataclasses.dataclass(frozen=True)
class PlannedJob:
    name: str
    commands: tuple[str, ...]                  # shell lines, in order
    files: tuple[tuple[str, str], ...] = ()    # (path relative to the output folder, text)


class Backend(Protocol):
    name: str

    def plan(self, graph: JobGraph) -> list[PlannedJob]: ...

    def submit(self, graph: JobGraph, *, execute: bool = False) -> int: ...

    def status(self, graph: JobGraph) -> dict[str, JobStatus]: ...

    def cancel(self, graph: JobGraph, names: list[str] | None = None, *,
               execute: bool = False) -> list[str]: ...


@dataclasses.dataclass(frozen=True)
class CloudSettings:
    """Where and how cloud jobs run. Placeholders make a dry run readable; `--submit` refuses them."""

    image: str = "us-docker.pkg.dev/PROJECT/smelt/smelt-jax:latest"
    bucket: str = "gs://BUCKET/smelt"  # runs root on the bucket: <bucket>/runs
    project: str = "PROJECT"
    zone: str = "ZONE"
    cluster: str = "CLUSTER"           # GKE cluster (xpk)
    max_restarts: int = 20             # restarts after preemption / exit 42, per job
    queue: str = "multislice-queue"    # Kueue LocalQueue that xpk clusters create
    out_dir: Path = Path("sweeps")
    root: Path | None = None           # local runs root read for readiness (default: $SMELT_RUNS_DIR)

    def __post_init__(self) -> None:
        if not self.bucket.startswith("gs://"):
            raise ValueError(f"--bucket must be a gs:// path, got {self.bucket!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    @property
    def runs_dir(self) -> str:
        return f"{self.bucket.rstrip('/')}/runs"

    def bucket_path(self, local_relative: Path) -> str:
        return f"{self.runs_dir}/{local_relative.as_posix()}"

    def placeholders(self) -> list[str]:
        defaults = CloudSettings()
        return [f"--{f}" for f in ("image", "bucket", "project", "zone")
                if getattr(self, f) == getattr(defaults, f)]


def job_paths(graph: JobGraph, job: Job, settings: CloudSettings) -> dict[str, str]:
    """The job's checkpoint folder and the suite's results store on the bucket."""
    rdir = run_dir(graph.suite, job.run.id, root=Path(""))
    return {"checkpoints": settings.bucket_path(rdir.checkpoints(job.branch)),
            "results": settings.bucket_path(results_path(graph.suite, root=Path("")))}


def trainer_command(job: Job) -> list[str]:
    return ["python", "-m", "smelt_jax", *job.train_args()]


def write_plan(planned: list[PlannedJob], out_dir: Path, header: str) -> Path:
    """Writes each job's files and one `submit.sh` with every command, in graph order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["#!/usr/bin/env bash", f"# {header}", "set -euo pipefail", ""]
    for job in planned:
        for relative, text in job.files:
            path = out_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        lines += [f"# {job.name}", *job.commands, ""]
    script = out_dir / "submit.sh"
    script.write_text("\n".join(lines))
    script.chmod(0o755)
    return script


def require_tool(tool: str, hint: str) -> None:
    if shutil.which(tool) is None:
        raise RuntimeError(f"`{tool}` is not installed or not on PATH; {hint}. "
                           "Without --submit nothing is run, and the commands are written out.")


def execute_ready(planned: list[PlannedJob], statuses: dict[str, JobStatus], settings: CloudSettings,
                  tool: str, hint: str) -> int:
    """Runs the commands of READY jobs; reports the others. Returns the number of failed submissions."""
    require_tool(tool, hint)
    if settings.placeholders():
        raise ValueError(f"set {', '.join(settings.placeholders())} before --submit "
                         "(the defaults are placeholders)")
    failures = 0
    for job in planned:
        state = statuses[job.name]
        if state != JobStatus.READY:
            print(f"skip {job.name}: {state.value}")
            continue
        for command in job.commands:
            print(f"+ {command}", flush=True)
            if subprocess.run(command, shell=True, check=False).returncode != 0:
                failures += 1
                print(f"submission of {job.name} failed (already on the cluster?)", file=sys.stderr)
                break
    return failures


def cloud_status(graph: JobGraph, settings: CloudSettings) -> dict[str, JobStatus]:
    """Artifact status, read from the local runs root (a copy of the bucket's small artifacts)."""
    return artifact_statuses(graph, settings.root)


def print_commands(planned: list[PlannedJob], script: Path) -> None:
    for job in planned:
        for command in job.commands:
            print(command)
    print(f"# dry run: {len(planned)} jobs written to {script.parent} (run them with --submit, "
          f"or `bash {script}`)")


def quote(args: list[str]) -> str:
    return shlex.join(args)

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
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from smelt_jax.platform import storage
from smelt_jax.run_files.rundir import results_path, run_dir
from smelt_jax.sweep.graph import Job, JobGraph, JobStatus, artifact_statuses
from smelt_jax.sweep.tpu import layout_args
from smelt_jax.platform.errors import SmeltError, UsageError


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


# The container image, named once here. `make image` builds the Dockerfile and tags it IMAGE (default
# `smelt-jax:<git short sha>`); `make push-image IMAGE=...` pushes it to the Artifact Registry repository
# `smelt` (docs/tpu-quickstart.md). DEFAULT_IMAGE is that path with its placeholders still in: a dry run
# reads well with it, and `--submit` refuses it (and any local tag) until `--image` names the pushed image.
IMAGE_NAME = "smelt-jax"
IMAGE_REPOSITORY = "smelt"
DEFAULT_IMAGE = f"REGION-docker.pkg.dev/PROJECT/{IMAGE_REPOSITORY}/{IMAGE_NAME}:TAG"
# Upper-case words that mark a value as not filled in (real project ids, buckets, zones, clusters and
# Artifact Registry paths are lower case).
# NAME and PATH are the metavars the docs print (`--queue NAME`, `--reservation NAME`, `gs://BUCKET/PATH`).
PLACEHOLDER_WORDS = ("PROJECT", "PROJECT_NUMBER", "REGION", "ZONE", "BUCKET", "CLUSTER", "TAG", "NAME", "PATH")
_PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(PLACEHOLDER_WORDS) + r")(?![A-Za-z0-9_])")


def is_placeholder(value: str) -> bool:
    """True when `value` still holds one of PLACEHOLDER_WORDS (e.g. `gs://BUCKET/smelt`)."""
    return bool(_PLACEHOLDER.search(str(value)))


# Settings that may stay empty but, when given, must not hold a placeholder: every --submit checks them
# (with its backend's required fields) through `CloudSettings.placeholders`, the one check. `root` is
# `--runs-dir` (the quick start prints `--runs-dir gs://BUCKET/smelt/runs`).
OPTIONAL_CHECKED = ("data_dir", "reservation", "queue", "root")
FLAGS = {"root": "--runs-dir"}  # a setting whose flag is not its name with dashes


# How a slice is paid for: spot (preemptible, cheapest; the jobs retry), on-demand, or reserved (a
# reservation: `--reservation NAME`, or the zone's reservation for the project).
CAPACITIES = ("spot", "on-demand", "reserved")


@dataclasses.dataclass(frozen=True)
class CloudSettings:
    """Where and how cloud jobs run. Placeholders make a dry run readable; `--submit` refuses them."""

    image: str = DEFAULT_IMAGE         # built by `make image`, pushed by `make push-image`
    bucket: str = "gs://BUCKET/smelt"  # runs root on the bucket: <bucket>/runs
    project: str = "PROJECT"
    zone: str = "ZONE"
    cluster: str = "CLUSTER"           # GKE cluster (xpk)
    max_restarts: int = 20             # restarts after preemption / exit 42, per job
    queue: str = "multislice-queue"    # Kueue LocalQueue of the JobSets (xpk clusters create this one)
    capacity: str = "spot"             # spot | on-demand | reserved (CAPACITIES)
    reservation: str = ""              # reservation name (capacity reserved); "" = the zone's
    out_dir: Path = Path("sweeps")
    root: Path | None = None           # local runs root read for readiness (default: $SMELT_RUNS_DIR)
    data_dir: str = ""                 # token store the jobs train on (gs://...); "" = the embedded corpus

    def __post_init__(self) -> None:
        if not storage.is_gcs(self.bucket):
            raise UsageError(f"--bucket must be a gs:// path, got {self.bucket!r}")
        if self.max_restarts < 0:
            raise UsageError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.capacity not in CAPACITIES:
            raise UsageError(f"--capacity must be one of {', '.join(CAPACITIES)}, got {self.capacity!r}")
        if self.reservation and self.capacity != "reserved":
            raise UsageError(f"--reservation {self.reservation} needs --capacity reserved, "
                             f"got --capacity {self.capacity}")
        if not self.queue.strip():
            raise UsageError("--queue must name a Kueue LocalQueue")
        if self.data_dir and not storage.is_gcs(self.data_dir):
            raise UsageError(f"--data-dir must be a gs:// token store the TPU hosts can read, got "
                             f"{self.data_dir!r}")

    @property
    def runs_dir(self) -> str:
        return f"{self.bucket.rstrip('/')}/runs"

    def job_env(self) -> dict[str, str]:
        """What every cloud job's trainer is given: the runs root on the bucket, and the compilation
        cache there too (`<bucket>/xla`), so that restarts, branches and the other hosts of a slice
        reuse compiled programs (minutes each for smelt16) instead of compiling them again."""
        return {"SMELT_RUNS_DIR": self.runs_dir, "SMELT_XLA_CACHE": f"{self.bucket.rstrip('/')}/xla"}

    def bucket_path(self, local_relative: Path) -> str:
        return f"{self.runs_dir}/{local_relative.as_posix()}"

    def placeholders(self, fields: tuple[str, ...] = ("image", "bucket", "project", "zone")) -> list[str]:
        """The flags among `fields` still at a placeholder (the default, or a value with PROJECT,
        BUCKET, ... left in), and every optional setting given with one left in (OPTIONAL_CHECKED:
        `--data-dir gs://BUCKET/...`, as the quick start prints it)."""
        defaults = CloudSettings()
        required = [f for f in fields if getattr(self, f) == getattr(defaults, f) or is_placeholder(getattr(self, f))]
        given = [f for f in OPTIONAL_CHECKED if f not in fields and getattr(self, f) and is_placeholder(getattr(self, f))]
        return [FLAGS.get(f, f"--{f.replace('_', '-')}") for f in required + given]

    def submit_problem(self, fields: tuple[str, ...] = ("image", "bucket", "project", "zone")) -> str | None:
        """Why these settings cannot be submitted (one line), or None."""
        missing = self.placeholders(fields)
        if missing:
            hint = (f" (--image: build and push the image with `make image push-image "
                    f"IMAGE={DEFAULT_IMAGE}` with your values, docs/tpu-quickstart.md)"
                    if "--image" in missing else "")
            return f"set {', '.join(missing)} before --submit: the defaults are placeholders{hint}"
        if "image" in fields and "/" not in self.image:
            return (f"--image {self.image} is a local tag that the TPU hosts cannot pull: push it with "
                    f"`make push-image IMAGE={DEFAULT_IMAGE}` (your values) and pass that path")
        return None


def job_paths(graph: JobGraph, job: Job, settings: CloudSettings) -> dict[str, str]:
    """The job's checkpoint folder and the suite's results store on the bucket."""
    rdir = run_dir(graph.suite, job.run.id, root=Path(""))
    return {"checkpoints": settings.bucket_path(rdir.checkpoints(job.branch)),
            "results": settings.bucket_path(results_path(graph.suite, root=Path("")))}


def trainer_command(job: Job, settings: CloudSettings) -> list[str]:
    """The trainer on a TPU slice: the layout the run's placement chose pinned by flags, the token
    store of `settings.data_dir` (none: the embedded corpus), and the checkpoint cadence the compile
    report chose for the suite's interval in minutes (`compile.checkpoint_cadence`; none listed: the
    trainer's default)."""
    from smelt_jax.compile.checkpoint_cadence import checkpoint_args

    data = ["--data-dir", settings.data_dir] if settings.data_dir else []
    return ["python", "-m", "smelt_jax", *job.train_args(), *data, *layout_args(job.run),
            *checkpoint_args(job.run)]


def data_problem(graph: JobGraph, settings: CloudSettings) -> str | None:
    """Why the graph's jobs cannot be submitted with this data (one line), or None: a run whose suite
    states a tokenizer.json (smelt16) cannot train on the embedded byte corpus, so it needs --data-dir."""
    needing = sorted({job.run.suite for job in graph.jobs if job.run.tokenizer == "hf"})
    if needing and not settings.data_dir:
        return (f"{', '.join(needing)} runs train on a token store prepared with a "
                "tokenizer.json: pass --data-dir gs://BUCKET/PATH (smelt data prepare; "
                "docs/tpu-quickstart.md section 6)")
    return None


def write_plan(planned: list[PlannedJob], out_dir: Path, header: str) -> Path:
    """Writes each job's files and one `submit.sh` with every command, in graph order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["#!/usr/bin/env bash", f"# {comment(header)}", "set -euo pipefail", ""]
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


class MissingTool(SmeltError, RuntimeError):
    """A command-line tool a backend needs (xpk, gcloud, kubectl) is not on PATH."""


def require_tool(tool: str, hint: str) -> None:
    if shutil.which(tool) is None:
        raise MissingTool(f"`{tool}` is not installed or not on PATH; {hint}. "
                          "Without --submit nothing is run, and the commands are written out.")


def check_submittable(settings: CloudSettings, tool: str, hint: str,
                      fields: tuple[str, ...] = ("image", "bucket", "project", "zone"),
                      graph: JobGraph | None = None) -> None:
    """UsageError (one line) while any of `fields` is a placeholder or the `graph`'s runs need data that
    `settings` does not name, then while `tool` is missing. A backend's `submit --submit` calls it
    before it writes its plan, so a refused submission leaves nothing behind."""
    problem = settings.submit_problem(fields) or (data_problem(graph, settings) if graph else None)
    if problem:
        raise UsageError(problem)
    require_tool(tool, hint)


def execute_ready(planned: list[PlannedJob], statuses: dict[str, JobStatus], settings: CloudSettings,
                  tool: str, hint: str,
                  fields: tuple[str, ...] = ("image", "bucket", "project", "zone"),
                  graph: JobGraph | None = None) -> int:
    """Runs the commands of READY jobs; reports the others. Returns the number of failed submissions.
    Refuses first (`check_submittable`)."""
    check_submittable(settings, tool, hint, fields, graph)
    failures = 0
    for job in planned:
        state = statuses[job.name]
        if not state.runnable:
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
    """A shell command line of `args`, each one word whatever it holds (spaces, `;`, `$(...)`, quotes,
    backticks, newlines): every value pasted into a generated script goes through here (or `word`)."""
    return shlex.join(args)


def word(value: object) -> str:
    """One shell word holding `value` unchanged (`quote` of one argument)."""
    return shlex.quote(str(value))


def comment(text: str) -> str:
    """`text` fit for a `# ...` line of a generated script: a line break in a value cannot end the
    comment and start a command."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")

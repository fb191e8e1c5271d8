"""What `smelt sweep status` reports beyond the job statuses: per-status counts, the endpoints a sweep
should produce, how many are written in run folders and how many reached the results store, and the
jobs whose checkpoint is damaged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from smelt_jax.results import read_results
from smelt_jax.rundir import results_dir, run_dir
from smelt_jax.sweep.graph import Job, JobGraph, JobStatus, count_statuses


@dataclasses.dataclass(frozen=True)
class SweepSummary:
    counts: dict[str, int]  # JobStatus value -> jobs
    jobs: int
    endpoints_expected: int  # one per decay branch of every run
    endpoints_written: int  # endpoint files in the run folders
    endpoints_in_store: int  # rows of the suite's results store for this graph's runs
    damaged: tuple[Job, ...]


def summarize(graph: JobGraph, statuses: dict[str, JobStatus], root: Path | None = None) -> SweepSummary:
    branches = [job for job in graph.jobs if not job.is_stable]
    written = sum(run_dir(graph.suite, job.run.id, root).endpoint(job.branch).exists() for job in branches)
    table = read_results(results_dir(graph.suite, root))
    wanted = {(job.run.id, job.branch) for job in branches}
    in_store = (len(wanted & set(zip(table["run_id"], table["branch"].astype(int))))
                if len(table) else 0)
    return SweepSummary(
        counts=count_statuses(statuses), jobs=len(graph.jobs), endpoints_expected=len(branches),
        endpoints_written=written, endpoints_in_store=in_store,
        damaged=tuple(job for job in graph.jobs if statuses[job.name] == JobStatus.DAMAGED))

"""What `smelt sweep status` reports beyond the job statuses: per-status counts, the endpoints a sweep
should produce, how many are written in run folders and how many reached the results store, the
jobs whose checkpoint is damaged, and the data each run trains on (its run.json's record:
`smelt_jax.run_files.run_data`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from smelt_jax.platform import storage
from smelt_jax.run_files.results import read_results
from smelt_jax.run_files.rundir import results_dir, run_dir
from smelt_jax.run_files.readers import Skipped, read_run_item
from smelt_jax.sweep.graph import Job, JobGraph, JobStatus, count_statuses


@dataclasses.dataclass(frozen=True)
class SweepSummary:
    counts: dict[str, int]  # JobStatus value -> jobs
    jobs: int
    endpoints_expected: int  # one per decay branch of every run
    endpoints_written: int  # endpoint files in the run folders
    endpoints_in_store: int  # rows of the suite's results store for this graph's runs
    damaged: tuple[Job, ...]
    # run id -> its run.json's data record; {} when run.json records none (older runs), None when the
    # run has no run.json yet (not started)
    data: dict[str, dict | None] = dataclasses.field(default_factory=dict)
    # run.json files that could not be read (damaged, edited, a folder): one line each; the rest counted
    skipped: tuple[Skipped, ...] = ()

    def data_label(self, run_id: str) -> str:
        """A run's data in one word: the store digest's first 12 hex digits, `unrecorded` or `-`."""
        record = self.data.get(run_id)
        if record is None:
            return "-"
        return str(record["store_digest"])[:12] if record.get("store_digest") else "unrecorded"

    def data_lines(self) -> list[str]:
        """One line per store the runs train on, then the runs that record none, then those not
        started."""
        groups: dict[str, list[str]] = {}
        for run_id, record in self.data.items():
            if record and record.get("store_digest"):
                key = f"data {record['store_digest'][:12]} ({record.get('path') or 'the embedded corpus'})"
            elif record is not None:
                key = "data not recorded"
            else:
                key = "data of runs not started"
            groups.setdefault(key, []).append(run_id)
        order = sorted(k for k in groups if k.startswith("data ") and "(" in k)
        order += [k for k in ("data not recorded", "data of runs not started") if k in groups]
        return [f"{key}: {len(groups[key])} run{'s' if len(groups[key]) != 1 else ''}"
                + (" (run.json written before runs recorded their data; not checked)"
                   if key == "data not recorded" else "") for key in order]


def summarize(graph: JobGraph, statuses: dict[str, JobStatus], root: Path | None = None) -> SweepSummary:
    branches = [job for job in graph.jobs if not job.is_stable]
    endpoints = [run_dir(graph.suite, job.run.id, root).endpoint(job.branch) for job in branches]
    written = sum(storage.exists(path) for path in endpoints)  # a file: a folder there is named below
    folders = [Skipped(str(path), "a folder where the endpoint file should be; remove it and retrain that "
                       "branch") for path in endpoints if not storage.is_gcs(str(path)) and path.is_dir()]
    table = read_results(results_dir(graph.suite, root))
    wanted = {(job.run.id, job.branch) for job in branches}
    in_store = (len(wanted & set(zip(table["run_id"], table["branch"].astype(int))))
                if len(table) else 0)
    data, skipped = _data(graph, root)
    return SweepSummary(
        counts=count_statuses(statuses), jobs=len(graph.jobs), endpoints_expected=len(branches),
        endpoints_written=written, endpoints_in_store=in_store,
        damaged=tuple(job for job in graph.jobs if statuses[job.name] == JobStatus.DAMAGED),
        data=data, skipped=tuple(skipped + folders))


def _data(graph: JobGraph, root: Path | None) -> tuple[dict[str, dict | None], list[Skipped]]:
    """(run id -> its run.json's data record, the run.json files skipped): each read through
    `readers.read_run_item`, so one bad file is named and the others still read."""
    out: dict[str, dict | None] = {}
    skipped: list[Skipped] = []
    for job in graph.jobs:
        if job.is_stable:
            record = read_run_item(run_dir(graph.suite, job.run.id, root).spec_file, job.run.id)
            if isinstance(record, Skipped):
                skipped.append(record)  # left out of the data lines: named on its own line
                continue
            data = record.get("data") if record is not None else None
            out[job.run.id] = (data if isinstance(data, dict) else {}) if record is not None else None
    return out, skipped

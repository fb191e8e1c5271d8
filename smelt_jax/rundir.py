"""Where a run's artifacts live. One layout, used by the trainer (writer) and the sweep (reader).

    <runs root>/<suite>/<run id>/
        run.json                      resolved descriptor + metadata (git commit, versions, mesh)
        stable/metrics.jsonl          the stable phase's metrics
        stable/checkpoints/<step>/    orbax checkpoints; a fork step's checkpoint is kept for good
        branch<k>/metrics.jsonl       decay branch k (forks at schedule.fork_steps[k])
        branch<k>/checkpoints/<step>/
        branch<k>/endpoint.json       the endpoint's results row, written last (atomically)
    <runs root>/<suite>/results.parquet   one row per finished endpoint (+ results.csv)

The runs root is `$SMELT_RUNS_DIR`, else `runs/` in the current directory. Paths may be local;
bucket paths (gs://) are handled by the sweep backends that render cloud jobs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

_ORBAX_TMP = re.compile(r"\.orbax-checkpoint-tmp")


def runs_root() -> Path:
    return Path(os.environ.get("SMELT_RUNS_DIR", "runs"))


@dataclasses.dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def spec_file(self) -> Path:
        return self.root / "run.json"

    def phase(self, branch: int | None) -> Path:
        """`stable/` for branch None, else `branch<k>/`."""
        return self.root / ("stable" if branch is None else f"branch{branch}")

    def checkpoints(self, branch: int | None) -> Path:
        return self.phase(branch) / "checkpoints"

    def metrics(self, branch: int | None) -> Path:
        return self.phase(branch) / "metrics.jsonl"

    def endpoint(self, branch: int) -> Path:
        return self.phase(branch) / "endpoint.json"


def run_dir(suite: str, run_id: str, root: Path | None = None) -> RunDir:
    return RunDir((root or runs_root()) / suite / run_id)


def results_dir(suite: str, root: Path | None = None) -> Path:
    """The folder of the suite's results store (`smelt_jax.results`: results.parquet + .csv)."""
    return (root or runs_root()) / suite


def results_path(suite: str, root: Path | None = None) -> Path:
    return results_dir(suite, root) / "results.parquet"


def committed_steps(checkpoint_dir: Path) -> list[int]:
    """Steps whose checkpoint is committed: orbax renames its temporary folder to `<step>` only
    once every file is written, so a plain integer folder name means committed."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoint_dir.iterdir()
                  if p.is_dir() and p.name.isdigit() and not _ORBAX_TMP.search(p.name))


def checkpoint_committed(checkpoint_dir: Path, step: int) -> bool:
    return step in committed_steps(checkpoint_dir)

"""Where a run's artifacts live. One layout, used by the trainer (writer) and the sweep (reader).

    <runs root>/<suite>/<run id>/
        run.json                      resolved descriptor + metadata (git commit, versions, mesh)
        stable/metrics.jsonl          the stable phase's metrics
        stable/checkpoints/<step>/    orbax checkpoints; a fork step's checkpoint is kept for good
        stable/checkpoints/<step>.damaged/   a damaged checkpoint the trainer moved aside (kept)
        stable/trainer.lock           held by the phase's live trainer (smelt_jax.train.lock)
        branch<k>/metrics.jsonl       decay branch k (forks at schedule.fork_steps[k])
        branch<k>/checkpoints/<step>/
        branch<k>/endpoint.json       the endpoint's results row, written last (atomically)
        <phase>/tensorboard/          TensorBoard event files (the metrics.jsonl records as scalars)
        <phase>/profile/              `smelt train --profile` traces (jax.profiler)
    <runs root>/<suite>/results.parquet   one row per finished endpoint (+ results.csv)

The runs root is `$SMELT_RUNS_DIR`, else `runs/` in the current directory (an empty SMELT_RUNS_DIR counts
as unset: `smelt_jax.platform.env`). It may be a bucket
(`gs://BUCKET/...`): paths under it are then `etils.epath.Path`s (`storage.as_path`), and the trainer
writes run.json, metrics.jsonl, TensorBoard files, profiles, endpoint.json and the results table there
through `smelt_jax.platform.storage` (tensorstore); orbax writes the checkpoints there itself (through
etils.epath and gcsfs). Any other URL scheme is refused (`storage.UnsupportedLocation`).

This module holds paths only; what is inside a checkpoint folder (commit markers, checksums, damaged
and temporary steps) is `smelt_jax.run_files.checkpoint_format`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from smelt_jax.run_files.path_names import check_inside, check_name, check_run_id
from smelt_jax.platform import env
from smelt_jax.platform.storage import as_path


def runs_root() -> Path:
    return as_path(env.runs_dir())


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

    def tensorboard(self, branch: int | None) -> Path:
        """TensorBoard event files of the phase (smelt_jax.train.tensorboard)."""
        return self.phase(branch) / "tensorboard"

    def profile(self, branch: int | None) -> Path:
        """`smelt train --profile` traces (jax.profiler) of the phase."""
        return self.phase(branch) / "profile"


def run_dir(suite: str, run_id: str, root: Path | None = None) -> RunDir:
    """The run's folder; `path_names.UnsafeName` (one line) unless suite and id are safe names and the
    folder lies under the root."""
    base = results_dir(suite, root)
    folder = base / check_run_id(run_id)
    return RunDir(check_inside(folder, base, f"run folder of {run_id}"))


def results_dir(suite: str, root: Path | None = None) -> Path:
    """The folder of the suite's results store (`smelt_jax.run_files.results`: results.parquet + .csv), and of its
    runs; `path_names.UnsafeName` unless `suite` is a safe name."""
    base = as_path(root or runs_root())
    return check_inside(base / check_name(suite, "suite"), base, f"folder of suite {suite}")


def results_path(suite: str, root: Path | None = None) -> Path:
    return results_dir(suite, root) / "results.parquet"

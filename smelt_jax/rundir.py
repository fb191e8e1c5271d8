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

The runs root is `$SMELT_RUNS_DIR`, else `runs/` in the current directory. It may be a bucket
(`gs://BUCKET/...`): paths under it are then `etils.epath.Path`s (see `as_path`), and the trainer
writes run.json, metrics.jsonl, TensorBoard files, profiles, endpoint.json and the results table there
through `smelt_jax.data.gcs` (tensorstore); orbax writes the checkpoints there itself (through
etils.epath and gcsfs). On gs:// orbax writes a step in place and commits it with
`<step>/commit_success.txt` (no temporary folder, no rename), and the trainer records no checksums
(Cloud Storage checks each object's CRC32C itself): a committed step is one with that file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

_ORBAX_TMP = re.compile(r"\.orbax-checkpoint-tmp")
CHECKSUM_FILE = "smelt_checksums.json"  # per committed step: {"version": 2, "files": {name: {sha256, size}}}
DAMAGED_SUFFIX = ".damaged"
ORBAX_COMMIT_FILE = "_CHECKPOINT_METADATA"


def as_path(path: str | os.PathLike) -> Path:
    """A local path as a `pathlib.Path`; a `gs://BUCKET/...` URL as an `etils.epath.Path`, which keeps
    the URL whole (a `pathlib.Path` would make it the local folder `gs:/BUCKET/...`). Joining and
    `str()` need no I/O; reading and writing a gs:// path goes through `smelt_jax.data.gcs`."""
    if str(path).startswith("gs://"):
        from etils import epath
        return epath.Path(str(path))
    return Path(path)


def is_remote(path: str | os.PathLike) -> bool:
    """True for a gs:// path."""
    return str(path).startswith("gs://")


def runs_root() -> Path:
    return as_path(os.environ.get("SMELT_RUNS_DIR", "runs"))


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
    return RunDir(as_path(root or runs_root()) / suite / run_id)


def results_dir(suite: str, root: Path | None = None) -> Path:
    """The folder of the suite's results store (`smelt_jax.results`: results.parquet + .csv)."""
    return as_path(root or runs_root()) / suite


def results_path(suite: str, root: Path | None = None) -> Path:
    return results_dir(suite, root) / "results.parquet"


GCS_COMMIT_FILE = "commit_success.txt"  # orbax's commit marker of a step on Cloud Storage


def _remote_files(checkpoint_dir) -> list[str]:
    """Paths relative to a gs:// checkpoint folder of every object under it."""
    from smelt_jax.data import gcs
    base = str(checkpoint_dir).rstrip("/") + "/"
    return [url[len(base):] for url in gcs.list_files(base)]


def committed_steps(checkpoint_dir: Path) -> list[int]:
    """Steps whose checkpoint is committed: orbax renames its temporary folder to `<step>` only
    once every file is written, so a plain integer folder name means committed (on gs://: a
    `<step>/commit_success.txt`)."""
    if is_remote(checkpoint_dir):
        return sorted({int(name.split("/")[0]) for name in _remote_files(checkpoint_dir)
                       if name.count("/") == 1 and name.endswith("/" + GCS_COMMIT_FILE)
                       and name.split("/")[0].isdigit()})
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoint_dir.iterdir()
                  if p.is_dir() and p.name.isdigit() and not _ORBAX_TMP.search(p.name))


def checkpoint_committed(checkpoint_dir: Path, step: int) -> bool:
    return step in committed_steps(checkpoint_dir)


def temporary_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Orbax's temporary folders (`<step>.orbax-checkpoint-tmp*`): saves that never committed (none
    on gs://, where orbax writes in place)."""
    if is_remote(checkpoint_dir) or not checkpoint_dir.is_dir():
        return []
    return sorted(p for p in checkpoint_dir.iterdir() if _ORBAX_TMP.search(p.name))


def damaged_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoints the trainer moved aside (`<step>.damaged[.n]`)."""
    if is_remote(checkpoint_dir):
        return sorted({as_path(str(checkpoint_dir).rstrip("/") + "/" + name.split("/")[0])
                       for name in _remote_files(checkpoint_dir)
                       if DAMAGED_SUFFIX in name.split("/")[0]}, key=str)
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p for p in checkpoint_dir.iterdir() if DAMAGED_SUFFIX in p.name)


def recorded_files(step_dir: Path) -> dict[str, dict] | None:
    """{relative path: {"sha256", "size" (None in old files)}} from a step's checksum file; None
    when the step has none (not sealed) or it cannot be read (always on gs://: not sealed)."""
    if is_remote(step_dir):
        return None
    try:
        data = json.loads((step_dir / CHECKSUM_FILE).read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and "files" in data else data
    if not isinstance(files, dict):
        return None
    return {name: (value if isinstance(value, dict) else {"sha256": value, "size": None})
            for name, value in files.items()}


def checkpoint_damage(checkpoint_dir: Path, step: int) -> str | None:
    """Why the committed checkpoint at `step` is damaged, or None if it looks whole. Cheap (no file is
    read): orbax's commit file must exist, and every file the checksum file records must exist with its
    recorded size. The trainer also compares sha256 digests before restoring."""
    if is_remote(checkpoint_dir):  # no checksums on gs:// (rundir docstring): committed or missing
        return None if step in committed_steps(checkpoint_dir) else "missing"
    step_dir = checkpoint_dir / str(step)
    if not step_dir.is_dir():
        return "missing"
    recorded = recorded_files(step_dir)
    if recorded is None:
        if (step_dir / CHECKSUM_FILE).exists():
            return f"its {CHECKSUM_FILE} is unreadable"
        return None  # not sealed (or not written by the trainer): only a restore can tell
    if not (step_dir / ORBAX_COMMIT_FILE).is_file() and ORBAX_COMMIT_FILE in recorded:
        return f"{ORBAX_COMMIT_FILE} is missing"
    problems = []
    for name, want in recorded.items():
        path = step_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{name} missing")
            continue
        if want.get("size") is not None and size != want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} when saved")
    if problems:
        return "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    return None


def good_steps(checkpoint_dir: Path) -> list[int]:
    """Committed steps that pass the cheap check of `checkpoint_damage`."""
    return [s for s in committed_steps(checkpoint_dir) if checkpoint_damage(checkpoint_dir, s) is None]

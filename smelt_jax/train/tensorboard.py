"""TensorBoard event files of a run phase, written through tensorboardX: `<phase>/tensorboard/`.

The trainer logs every record it writes to `metrics.jsonl` here too, as scalars (`train/loss`,
`train/ce`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, `train/mfu`, `train/expert_*`, ...
and `eval/<source>`, `eval/overall`), so `tensorboard --logdir <runs root>/<suite>` shows every phase
of every run while it trains. `metrics.jsonl` stays the record the suite reads; this is for watching.

Each phase's file also carries the run's hyperparameters (`run_hparams`: id, suite, scale, sparsity,
arch, phase, pair) for TensorBoard's HPARAMS tab, so that runs compare by architecture and sparsity
against `train/loss` and `eval/overall`.

Each trainer process writes a new file. A resumed phase logs again the steps after its checkpoint, so
its file starts with `session_log { status: START }` at the first step it will log (tensorboardX's
`purge_step`): TensorBoard then drops the older file's points from that step on, and the curve is the
one of `latest_per_step`.

Local folders get the records appended and flushed within FLUSH_SECONDS. On `gs://` the files go
through `smelt_jax.platform.storage` (the one Cloud Storage client of the project; tensorboardX's own `gs`
writer is replaced): Cloud Storage has no append, so the writer keeps the file's bytes in memory and
rewrites the whole object at each flush (event files are small).
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

from tensorboardX import SummaryWriter, record_writer
from tensorboardX.summary import hparams as hparams_summaries

from smelt_jax.platform import storage as gcs

FOLDER = "tensorboard"
# Keys of a metrics record that are not curves.
_SKIP = {"step", "time", "peak_flops", "peak_flops_source", "eval"}
# The curves the HPARAMS tab lists beside each run's hyperparameters.
HPARAM_METRICS = ("train/loss", "eval/overall")
# tensorboardX writes events from a background thread, and flushes what it wrote at most this often;
# write() also flushes (what the thread has written by then). close() writes and flushes everything.
FLUSH_SECONDS = 5


class _GcsRecordFile:
    """tensorboardX's record file interface (write, flush, close) over smelt_jax.platform.storage: the
    whole object rewritten at each flush."""

    def __init__(self, path: str) -> None:
        self.path, self.buffer = path, io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        gcs.write_bytes(self.path, self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _GcsFactory:
    def open(self, path: str) -> _GcsRecordFile:
        return _GcsRecordFile(path)

    def directory_check(self, path: str) -> None:  # objects need no folders
        pass


record_writer.register_writer_factory("gs", _GcsFactory())


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl record: `train/<key>` for each finite number of a
    training record, `eval/<source>` for an evaluation record."""
    if "eval" in record:
        items = [(f"eval/{k}", v) for k, v in record["eval"].items()]
    else:
        items = [(f"train/{k}", v) for k, v in record.items() if k not in _SKIP]
    return {tag: float(v) for tag, v in items
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def run_hparams(run, branch: int | None) -> dict[str, str | float]:
    """The hyperparameters a phase is compared by: `run` is a descriptors.RunSpec."""
    return {"id": run.id, "suite": run.suite, "scale": run.scale,
            "sparsity": run.sparsity_label, "arch": run.arch, "pair": run.pair_id,
            "phase": "stable" if branch is None else f"branch{branch}"}


class EventWriter:
    """Scalars of one process into one new event file under `folder` (local or gs://)."""

    _count = 0

    def __init__(self, folder, *, start_step: int | None = None,
                 hparams: dict[str, str | float | bool] | None = None) -> None:
        """`start_step`: the first step this writer will log, when it resumes a phase (TensorBoard
        then hides what earlier files logged from that step on). `hparams`: the phase's
        hyperparameters (run_hparams), shown in TensorBoard's HPARAMS tab."""
        EventWriter._count += 1
        self.folder = str(folder)
        if not gcs.is_gcs(self.folder):
            os.makedirs(self.folder, exist_ok=True)
        # tensorboardX names a file events.out.tfevents.<time>.<host><suffix>: the pid and a count
        # keep two writers of one second (a phase's training, then its evaluation) apart.
        self._writer = SummaryWriter(
            logdir=self.folder, purge_step=start_step if start_step else None,
            max_queue=100, flush_secs=FLUSH_SECONDS,
            filename_suffix=f".{os.getpid()}.{EventWriter._count:04d}")
        self._end = None
        if hparams:
            experiment, start, self._end = hparams_summaries(dict(hparams), dict.fromkeys(HPARAM_METRICS))
            self._writer.file_writer.add_summary(experiment)
            self._writer.file_writer.add_summary(start)
        self.flush()

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, int(step), walltime=wall_time)

    def write(self, record: dict[str, Any]) -> None:
        """Log one metrics.jsonl record (its scalars) and flush."""
        if "step" in record:
            self.scalars(record["step"], scalars_of(record), record.get("time"))
            self.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._end is not None:
            self._writer.file_writer.add_summary(self._end)
            self._end = None
        self._writer.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""TensorBoard event files of a run phase, written without TensorFlow: `<phase>/tensorboard/`.

The trainer logs every record it writes to `metrics.jsonl` here too, as scalars (`train/loss`,
`train/ce`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, `train/mfu`, `train/expert_*`, ...
and `eval/<source>`, `eval/overall`), so `tensorboard --logdir <runs root>/<suite>` shows every phase
of every run while it trains. `metrics.jsonl` stays the record the suite reads; this is for watching.

Format (TensorFlow's event protocol, written here by hand): a file
`events.out.tfevents.<time>.<host>.<pid>.<n>` of TFRecord records (little-endian uint64 length,
masked CRC-32C of the length, the payload, masked CRC-32C of the payload), each payload a serialized
`tensorflow.Event`: the first one carries `file_version: "brain.Event:2"`; a scalar is an Event with
`wall_time`, `step` and `summary { value { tag, simple_value } }` (float32).

Each trainer process writes a new file. A resumed phase logs again the steps after its checkpoint, so
its file starts with `session_log { status: START }` at the first step it will log: TensorBoard then
drops the older file's points from that step on, and the curve is the one of `latest_per_step`.

Local folders get the records appended (and flushed) as they come. Cloud Storage has no append: on
`gs://` the writer keeps the file's bytes in memory and rewrites the whole object at each flush (one
flush per logged step; event files are small, about 40 bytes a scalar).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from typing import Any

import google_crc32c

from smelt_jax import storage as gcs

FOLDER = "tensorboard"
FILE_VERSION = "brain.Event:2"
# Keys of a metrics record that are not curves.
_SKIP = {"step", "time", "peak_flops", "peak_flops_source", "eval"}


def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64: two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, *, summary: bytes = b"", file_version: str = "",
           session_start: bool = False) -> bytes:
    """A serialized `Event` (event.proto: wall_time=1 double, step=2 int64, file_version=3,
    summary=5, session_log=7)."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version:
        out += _bytes_field(3, file_version.encode())
    if summary:
        out += _bytes_field(5, summary)
    if session_start:
        out += _bytes_field(7, _field(1, 0) + _varint(1))  # SessionLog.status = START (1)
    return out


def _scalar_summary(values: dict[str, float]) -> bytes:
    """A serialized `Summary` of `Value { tag=1, simple_value=2 (float) }`s."""
    out = b""
    for tag, value in values.items():
        value_msg = _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", value)
        out += _bytes_field(1, value_msg)
    return out


def _record(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return (length + struct.pack("<I", _masked_crc(length)) + payload
            + struct.pack("<I", _masked_crc(payload)))


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl record: `train/<key>` for each finite number of a
    training record, `eval/<source>` for an evaluation record."""
    if "eval" in record:
        items = [(f"eval/{k}", v) for k, v in record["eval"].items()]
    else:
        items = [(f"train/{k}", v) for k, v in record.items() if k not in _SKIP]
    return {tag: float(v) for tag, v in items
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class EventWriter:
    """Scalars of one process into one new event file under `folder` (local or gs://)."""

    _count = 0

    def __init__(self, folder, *, start_step: int | None = None) -> None:
        """`start_step`: the first step this writer will log, when it resumes a phase (TensorBoard
        then hides what earlier files logged from that step on)."""
        EventWriter._count += 1
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{EventWriter._count:04d}")
        self.folder = str(folder)
        self.path = gcs.join(self.folder, name)
        self._remote = gcs.is_gcs(self.folder)
        self._buffer = bytearray()  # gs://: the whole file; local: what is not written yet
        self._handle = None
        if not self._remote:
            os.makedirs(self.folder, exist_ok=True)
            self._handle = open(self.path, "ab")
        now = time.time()
        self._buffer += _record(_event(now, 0, file_version=FILE_VERSION))
        if start_step is not None and start_step > 0:
            self._buffer += _record(_event(now, int(start_step), session_start=True))
        self.flush()

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        if values:
            self._buffer += _record(_event(time.time() if wall_time is None else wall_time,
                                           int(step), summary=_scalar_summary(values)))

    def write(self, record: dict[str, Any]) -> None:
        """Log one metrics.jsonl record (its scalars) and flush."""
        if "step" in record:
            self.scalars(record["step"], scalars_of(record), record.get("time"))
            self.flush()

    def flush(self) -> None:
        if self._remote:
            gcs.write_bytes(self.path, bytes(self._buffer))
        elif self._handle is not None and self._buffer:
            self._handle.write(self._buffer)
            self._handle.flush()
            self._buffer.clear()

    def close(self) -> None:
        if self._handle is not None:
            self.flush()
            self._handle.close()
            self._handle = None

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""`metrics.jsonl`: one JSON record per line, appended line-atomically, read back tolerantly.

Writer: every record is one `os.write` of a whole line on a file opened `O_APPEND`, so a reader or a
second writer never sees half of it unless the process dies inside that write (or the disk is full).
A file left ending in a torn line (no final newline) gets a newline first, so the torn bytes stay on
their own line and never swallow the next record.

On Cloud Storage (`gs://...`), which has no append, the writer keeps the file's bytes in memory (those
already there first) and rewrites the whole object at each record: a reader sees the object before
or after a record, never half of one (an object write is atomic). A metrics file is small (about
600 bytes a logged step), so this costs one small upload per logged step.

Reader: `read_metrics(path)` returns the records of the lines that parse as JSON objects and skips the
others (a torn line, garbage bytes) with one `TornLineWarning` naming how many and where.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from smelt_jax.platform import storage as gcs


class TornLineWarning(UserWarning):
    """Lines of a metrics file that are not JSON records were skipped."""


class MetricsWriter:
    """Append JSON records to `path`, one `os.write` per line."""

    def __init__(self, path: str | os.PathLike) -> None:
        if gcs.is_gcs(path):
            self.path, self._fd = str(path), -1
            try:
                self._object = bytearray(gcs.read_bytes(self.path))
            except FileNotFoundError:
                self._object = bytearray()
            if self._object and not self._object.endswith(b"\n"):
                self._object += b"\n"  # close a torn last line
            return
        self._object, self._fd = None, -1
        self.path = Path(path)  # opened at the first record: a phase that fails before it leaves no empty file

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as handle:
                handle.seek(size - 1)
                if handle.read(1) != b"\n":
                    self._write(b"\n")  # close a torn last line

    def _write(self, data: bytes) -> None:
        if self._object is not None:
            self._object += data
            gcs.write_bytes(self.path, bytes(self._object))
            return
        if self._fd < 0:
            self._open()
        view = memoryview(data)
        with gcs.naming(self.path):
            while view:
                written = os.write(self._fd, view)
                view = view[written:]

    def write(self, record: dict[str, Any]) -> None:
        self._write((json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullWriter:
    """What processes other than 0 log into."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullWriter:
        return self

    def __exit__(self, *exc) -> None:
        pass


def read_metrics(path: str | os.PathLike, *, warn: bool = True) -> list[dict[str, Any]]:
    """The JSON-object records of a metrics file, in order; unreadable lines are skipped (and, with
    `warn`, reported in one TornLineWarning)."""
    data = gcs.read_bytes(path) if gcs.is_gcs(path) else Path(path).read_bytes()
    records, skipped = [], []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            skipped.append(number)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped.append(number)
    if skipped and warn:
        warnings.warn(f"{path}: skipped {len(skipped)} unreadable line(s) (torn or garbage), line "
                      f"number(s) {skipped[:10]}", TornLineWarning, stacklevel=2)
    return records


def latest_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training records (with a `loss`) deduplicated by step, keeping the last one written: a resumed
    run logs again the steps after its checkpoint."""
    by_step: dict[int, dict] = {}
    for record in records:
        if "eval" not in record and "step" in record:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]

"""Reads what a W&B offline run wrote (`<WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb`) for tests.

wandb 0.31 has no public Python reader of .wandb files (its datastore is written by the Go
`wandb-core`), so this is a small one: the file is `:W&B` + magic 0xBEE1 + version 0, then LevelDB
log records (32 KiB blocks; each record 4-byte CRC, 2-byte little-endian length, 1-byte type FULL=1
FIRST=2 MIDDLE=3 LAST=4, payload), each payload a `wandb_internal_pb2.Record` decoded with wandb's
own protobuf definitions.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7  # ':W&B' + magic (2) + version (1); the first block's records start after it
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    out, pending, offset = [], b"", HEADER
    while offset + 7 <= len(data):
        room = BLOCK - offset % BLOCK
        if room < 7:  # the block's tail is padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        payload = data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:  # zero padding
            continue
        if kind == FULL:
            pending = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            pending += payload
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        out.append(record)
        pending = b""
    return out


def history(path: Path) -> list[dict]:
    """The rows `run.log` wrote, each {key: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def config(path: Path) -> dict:
    """The run's config (the last value of each key)."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else (
            record.config.update if kind == "config" else [])
        for item in items:
            out[item.key] = json.loads(item.value_json)
    return out


def run_files(wandb_dir: Path) -> list[Path]:
    return sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))

"""Reading the input shards of `smelt data prepare` and `smelt data tokenizer train`: what a shard holds
(JSONL, JSONL.zst, JSONL.gz, Parquet or plain text; local or gs://), which record is a document and which a
counted problem (`PROBLEM_KINDS`), and `PrepareConfig`, the fields and options both commands share.
Split from prepare.py (issue 52): reading a shard is one concept, turning shards into a store another."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
from collections import Counter
from collections.abc import Iterator

from smelt_jax.data import input_checks
from smelt_jax.data import store_arrays
from smelt_jax.data import token_store as tsd
from smelt_jax.platform import storage as gcs
from smelt_jax.platform.errors import SmeltError, UsageError

INPUT_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.zst", ".json.zst", ".zst", ".jsonl.gz", ".gz",
                  ".parquet", *input_checks.TEXT_SUFFIXES)
PROBLEM_KINDS = ("non_utf8", "bad_json", "missing_text", "missing_source", "bad_field", "empty")
MAX_EXAMPLES = 5


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    text_field: str = "text"
    source_field: str = "source"
    default_source: str | None = None
    val_fraction: float = 0.01
    dedup: bool = True
    layout: str = "chunks"  # of the token array: "chunks" or "sharded" (see store_arrays._zarr_spec)

    def __post_init__(self) -> None:
        if self.layout not in store_arrays.LAYOUTS:
            raise UsageError(f"layout must be one of {store_arrays.LAYOUTS}, got {self.layout!r}")
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"val_fraction must lie in (0, 1), got {self.val_fraction}")

    def part_key(self, tokenizer_identity: str) -> str:
        """What decides a part's content (the split and dedup are applied at assembly)."""
        text = json.dumps({"format": tsd.STORE_FORMAT, "tokenizer": tokenizer_identity,
                           "text_field": self.text_field, "source_field": self.source_field,
                           "default_source": self.default_source}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


class PrepareError(SmeltError, RuntimeError):
    """Nothing usable to prepare (no inputs, every shard failed, no documents)."""


# Reading one shard ----------------------------------------------------------------------------------
def _decompress(url: str, data: bytes) -> bytes:
    if url.endswith(".zst"):
        import zstandard

        pieces, rest = [], data
        while rest:  # frame by frame: a truncated frame is an error, not a short shard
            frame = zstandard.ZstdDecompressor().decompressobj()
            pieces.append(frame.decompress(rest))
            if not frame.eof:
                raise UsageError("truncated zstd stream (the last frame does not end)")
            rest = frame.unused_data
        return b"".join(pieces)
    if url.endswith(".gz"):
        return gzip.decompress(data)
    return data


def read_records(url: str, data: bytes, config: PrepareConfig | None = None) -> Iterator[tuple[int, object]]:
    """(line or row number from 1, record dict | problem kind) for one shard; raises if it cannot parse.
    A plain-text file (.txt, .md) is one record (input_checks.text_file_record, fields of `config`)."""
    if input_checks.is_text_file(url):
        config = config or PrepareConfig()
        yield 1, input_checks.text_file_record(url, data, config.text_field, config.source_field,
                                               config.default_source)
        return
    if url.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        for row in range(table.num_rows):
            yield row + 1, {name: values[row] for name, values in columns.items()}
        return
    if not url.endswith(INPUT_SUFFIXES):
        raise UsageError(f"unknown input format (expected one of {', '.join(INPUT_SUFFIXES)})")
    text = _decompress(url, data)
    for number, line in enumerate(text.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError:
            yield number, "non_utf8"
            continue
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError:
            yield number, "bad_json"
            continue
        yield number, record if isinstance(record, dict) else "bad_json"


def extract(record, config: PrepareConfig) -> tuple[str, str] | str:
    """(text, source) of a good record, else the problem kind."""
    if isinstance(record, str):
        return record
    if config.text_field not in record or record[config.text_field] is None:
        return "missing_text"
    text = record[config.text_field]
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return "non_utf8"
    if not isinstance(text, str):
        return "bad_field"
    source = record.get(config.source_field)
    if source is None:
        if config.default_source is None:
            return "missing_source"
        source = config.default_source
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if not isinstance(source, (str, int)) or not str(source).strip():
        return "bad_field"
    try:
        text.encode("utf-8")  # lone surrogates from JSON escapes
    except UnicodeEncodeError:
        return "non_utf8"
    if not text.strip():
        return "empty"
    return text, str(source).strip()


def iter_texts(urls: list[str], config: PrepareConfig, *, max_documents: int | None = None,
               max_bytes: int | None = None, problems: Counter | None = None,
               fields: dict | None = None) -> Iterator[str]:
    """Good texts of the shards in order (for tokenizer training); unreadable shards are skipped.
    `problems` counts the bad records by kind (and `records`), `fields` gathers the fields found."""
    seen_docs = seen_bytes = 0
    for url in urls:
        try:
            records = list(read_records(url, gcs.read_bytes(url), config))
        except Exception:  # noqa: BLE001 - reported by counting, like prepare does
            if problems is not None:
                problems["failed_shards"] += 1
            continue
        if fields is not None:
            input_checks.merge_fields(fields, input_checks.field_types(r for _, r in records))
        for _, record in records:
            if problems is not None:
                problems["records"] += 1
            got = extract(record, config)
            if isinstance(got, str):
                if problems is not None:
                    problems[got] += 1
                continue
            yield got[0]
            seen_docs += 1
            seen_bytes += len(got[0])
            if (max_documents and seen_docs >= max_documents) or (max_bytes and seen_bytes >= max_bytes):
                return

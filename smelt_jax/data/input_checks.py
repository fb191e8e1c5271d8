"""What `smelt data prepare` and `smelt data tokenizer train` make of a researcher's input files.

- Plain-text files (`.txt`, `.md`) are documents: one file, one document, its source label the
  `--default-source` or else the name of the folder it lies in (`text_file_record`).
- When nothing usable is left, the error says why (`no_documents_message`): the records read, the
  problems counted by kind, the fields (JSON) or columns (Parquet) found with their types, and the flag
  that fixes it (`--text-field FIELD`, naming a field that holds text; `--source-field` /
  `--default-source` when the source label is what is missing).
- A validation split under VAL_TOKENS_WARNING tokens gives a warning (`validation_warning`): its loss
  is too noisy to compare runs by.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping

TEXT_SUFFIXES = (".txt", ".md")
VAL_TOKENS_WARNING = 100_000
FIELD_SAMPLE = 100  # records per shard whose fields are listed
MAX_FIELDS = 12
# Problem kinds (input_shards.PROBLEM_KINDS) in words.
_KIND_WORDS = {"non_utf8": "not UTF-8", "bad_json": "not a JSON object", "missing_text": "without the text field",
               "missing_source": "without the source field", "bad_field": "with a field of the wrong type",
               "empty": "with an empty text", "failed_shards": "unreadable shards"}


def is_text_file(url: str) -> bool:
    return url.lower().endswith(TEXT_SUFFIXES)


def text_file_record(url: str, data: bytes, text_field: str, source_field: str,
                     default_source: str | None) -> dict | str:
    """A plain-text file as one record {text_field: its text, source_field: its label}, or the
    problem kind "non_utf8"."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "non_utf8"
    folder = posixpath.basename(posixpath.dirname(url.rstrip("/")))
    return {text_field: text, source_field: default_source or folder or "text"}


def field_types(records: Iterable[object], limit: int = FIELD_SAMPLE) -> dict[str, str]:
    """{field: type name} over the first `limit` records that are dicts (JSON objects, Parquet rows)."""
    found: dict[str, str] = {}
    for count, record in enumerate(records):
        if count >= limit:
            break
        if isinstance(record, Mapping):
            for key, value in record.items():
                kind = type(value).__name__ if value is not None else "null"
                if found.get(key) in (None, "null"):
                    found[str(key)] = kind
    return found


def merge_fields(into: dict[str, str], more: Mapping[str, str]) -> dict[str, str]:
    for key, kind in more.items():
        if into.get(key) in (None, "null"):
            into[key] = kind
    return into


def no_documents_message(problems: Mapping[str, int], fields: Mapping[str, str], *, inputs: int,
                         records: int, text_field: str = "text", source_field: str = "source",
                         prefix: str = "the inputs hold no usable documents") -> str:
    """One line: what was read, what was wrong by kind, the fields found, and the flag to pass."""
    counted = {k: int(v) for k, v in problems.items() if v}
    parts = [f"{inputs} input file(s), {records:,} record(s)"]
    if counted:
        parts.append(", ".join(f"{n:,} {_KIND_WORDS.get(k, k)} ({k})" for k, n in sorted(counted.items())))
    line = f"{prefix}: " + "; ".join(parts)
    if fields:
        shown = list(fields.items())[:MAX_FIELDS]
        more = f", ... ({len(fields) - MAX_FIELDS} more)" if len(fields) > MAX_FIELDS else ""
        line += "; fields found: " + ", ".join(f"{k} ({t})" for k, t in shown) + more
    elif records:
        line += "; no fields found (the records are not JSON objects or Parquet rows)"
    hints = []
    if counted.get("missing_text") or counted.get("bad_field") or (fields and text_field not in fields):
        texts = [k for k, t in fields.items() if t in ("str", "bytes") and k != text_field]
        example = texts[0] if texts else "FIELD"
        hints.append(f"--text-field {example} (the field holding the text; now {text_field!r})")
    if counted.get("missing_source"):
        hints.append(f"--source-field FIELD or --default-source LABEL (now {source_field!r})")
    if not records:
        hints.append(f"inputs must be JSONL (.jsonl, .json, .ndjson; .zst, .gz), Parquet, or text "
                     f"files ({', '.join(TEXT_SUFFIXES)})")
    if hints:
        line += "; pass " + ", or ".join(hints)
    return line


def validation_warning(val_tokens: int, val_fraction: float | None = None) -> str | None:
    """A warning when the validation split is under VAL_TOKENS_WARNING tokens, else None."""
    if val_tokens >= VAL_TOKENS_WARNING:
        return None
    fraction = f" (--val-fraction {val_fraction:g})" if val_fraction is not None else ""
    return (f"warning: the validation split holds {val_tokens:,} tokens{fraction}, under "
            f"{VAL_TOKENS_WARNING:,}: its loss is too noisy to compare runs; add text or raise "
            "--val-fraction")

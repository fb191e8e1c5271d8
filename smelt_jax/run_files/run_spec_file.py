"""A run's spec file (`<runs root>/<suite>/<run id>/run.json`), read through one function everywhere:
the trainer, `smelt eval`/`analyze`, the run lookup (`run_lookup`), the results and the sweep status.

    read_run_record(path, folder_id)   the file's JSON object, checked to describe run `folder_id`
    read_run_spec(path, folder_id)     the RunSpec it describes
    spec_digest(record)                what the trainer records in metadata.spec_digest when writing it

A damaged file (truncated, not JSON) or an edited one (its content no longer gives its id) is one line
(`RunSpecDamaged`, exit 2) that says what is wrong; nothing is moved or rewritten, checkpoints included.
An edit is told from a change of the id code by the digest the trainer recorded, or by the suite run of
that id (whose differing field is named); only when neither is known is a mismatch blamed on the code.
"""

from __future__ import annotations

import json

from smelt_jax.platform import storage
from smelt_jax.design.config import ConfigError, content_hash
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files.config_text import parse_json

_ADDED_BY_TRAINER = ("metadata", "data")  # keys the trainer adds to `RunSpec.to_dict` in run.json


class RunSpecDamaged(ConfigError):
    """A run.json that cannot be read, or no longer describes its run."""


def spec_digest(record: dict) -> str:
    """Digest of a run.json's spec (all but what the trainer added): written as metadata.spec_digest."""
    return content_hash({k: v for k, v in record.items() if k not in _ADDED_BY_TRAINER}, length=16)


def _which(path, folder_id: str | None) -> str:
    parts = str(path).rstrip("/").split("/")
    return f"run.json of {folder_id or (parts[-2] if len(parts) > 1 else '?')}"


def _diff(prefix: str, mine, theirs) -> list[str]:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [d for key in sorted(set(mine) | set(theirs))
                for d in _diff(f"{prefix}.{key}" if prefix else key, mine.get(key), theirs.get(key))]
    return [] if mine == theirs else [f"{prefix} {json.dumps(mine)} != {json.dumps(theirs)}"]


def _suite_run(run_id: str) -> RunSpec | None:
    from smelt_jax.design import suites
    try:
        run = suites.find_run(run_id)
    except (KeyError, suites.NoSuites):
        return None
    return run if run.id == run_id else None


def _mismatch(record: dict, run: RunSpec, expected: str, which: str) -> str:
    grid = _suite_run(expected)
    if grid is not None:
        spec = {k: v for k, v in record.items() if k in ("config", "schedule", "control", "tokenizer")}
        fields = _diff("", spec, {k: v for k, v in grid.to_dict().items() if k in spec})
        if fields:
            shown = "; ".join(d.replace("config.", "model.", 1) for d in fields[:3])
            return (f"{which} was edited: {shown} of its id; put the file back (`smelt experiments show "
                    f"{expected}` prints the spec), the checkpoints are left as they are")
    digest = (record.get("metadata") or {}).get("spec_digest") if isinstance(record.get("metadata"), dict) else None
    if digest and digest != spec_digest(record):
        return (f"{which} was edited after its trainer wrote it (it now describes run {run.id}, not "
                f"{expected}); put the file back, or train the edited spec as a new run (--config)")
    return (f"{which} describes run {run.id} under this code, not {expected} (the code that computes ids "
            "changed since it was written, or the file was edited); train it as a new run")


def _repair(run_id: str, path) -> str:
    """How to repair a run.json that no longer validates: a suite run's is written again by its trainer
    (delete it); a config-file or override run's is its only spec (edit the field named)."""
    if run_id and _suite_run(run_id) is not None:
        return f"delete {path} (`smelt train {run_id}` writes it again from its suite; checkpoints are kept)"
    return f"edit that field in {path} (its checkpoints are left as they are)"


def parse_run_record(text: str, path, folder_id: str | None = None) -> dict:
    """The JSON object of a run.json's `text` (read from `path`), checked as `read_run_record` does."""
    which = _which(path, folder_id)
    try:
        record = parse_json(text, "run.json")  # a key twice, nesting depth: config_text
    except (ValueError, RecursionError) as err:
        raise RunSpecDamaged(f"{which} is damaged ({' '.join(str(err).split())[:120]}): not a complete JSON "
                             f"file ({path}); its checkpoints are left as they are") from None
    if not isinstance(record, dict):
        raise RunSpecDamaged(f"{which} is damaged: a run spec is one JSON object ({path})")
    try:
        run = RunSpec.from_dict(record)
    except ConfigError as err:
        raise RunSpecDamaged(f"{which} no longer validates ({' '.join(str(err).split())}): "
                             f"{_repair(folder_id or str(record.get('id') or ''), path)}") from None
    for expected in dict.fromkeys(x for x in (folder_id, record.get("id")) if x):
        if run.id != expected:
            raise RunSpecDamaged(_mismatch(record, run, expected, which))
    return record


def read_run_record(path, folder_id: str | None = None) -> dict:
    """The JSON object of run.json at `path`, checked to describe run `folder_id` (the folder's name)
    and its own recorded id; RunSpecDamaged (one line) otherwise, FileNotFoundError when absent."""
    which = _which(path, folder_id)
    try:
        text = storage.read_text(path)
    except UnicodeDecodeError as err:
        raise RunSpecDamaged(f"{which} is damaged: not UTF-8 text (byte {err.start}) ({path}); its "
                             "checkpoints are left as they are") from None
    except IsADirectoryError:
        raise RunSpecDamaged(f"{which} is a folder, not a file ({path}): remove it") from None
    return parse_run_record(text, path, folder_id)


def read_run_spec(path, folder_id: str | None = None) -> RunSpec:
    """The RunSpec of run.json at `path` (`read_run_record`)."""
    return RunSpec.from_dict(read_run_record(path, folder_id))

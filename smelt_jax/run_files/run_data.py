"""The data a run trains on is part of the run: its record in run.json and every checkpoint's metadata,
and the check that a resume or a decay branch trains on the same data.

    run.json "data":          {"store_digest", "tokenizer_sha256", "path"}
    checkpoint metadata:      "data_digest", "tokenizer_sha256" (`checkpoint_format.step_metadata`)

The store digest (`token_store.store_digest`, in every store's manifest.json, the embedded corpus's
too) is the sha256 of the manifest's content: the format, the tokenizer's sha256, the split rule, the
source table and the tree digest of every array (every token, offset and split index, hashed when the
store was written). Two stores with the same digest hold the same tokens in the same documents and
splits, wherever they are; reading it costs one small file, and every open already checks that the
manifest gives its digest (`check_store`). `path` is where the store was (None: the embedded default
corpus, wherever this machine keeps it).

A phase whose run.json records data and gets no --data-dir opens the recorded store; given another
store (another digest) it stops before any work with one line naming both (`DataChanged`, exit 2). A
run.json written before runs recorded their data is not checked (said once per process). Jax-free.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from smelt_jax.platform import storage
from smelt_jax.platform.errors import UsageError

_NOT_RECORDED_SAID: set[str] = set()


class DataChanged(UsageError):
    """A resume or a branch was given a token store other than the one its run trained on."""


def _default_root() -> str:
    from smelt_jax.data.corpus import default_corpus_dir
    return storage.normalize(default_corpus_dir())


def describe(corpus) -> dict:
    """The record of the data `corpus` (a TokenStore) holds; the digest is None for in-memory data."""
    tokenizer = getattr(corpus, "tokenizer", None)
    root = getattr(corpus, "root", None)
    path = None if root is None or storage.normalize(root) == _default_root() else str(root)
    return {"store_digest": getattr(corpus, "digest", None),
            "tokenizer_sha256": getattr(tokenizer, "sha256", None), "path": path}


def _where(record: dict) -> str:
    return record.get("path") or "the embedded corpus"


def check_same_data(run_id: str, recorded: dict | None, current: dict) -> None:
    """DataChanged unless `current` is the data `recorded` names (same store digest; no check when
    nothing, or no digest, was recorded)."""
    if not recorded or not recorded.get("store_digest") or not current.get("store_digest"):
        return
    if recorded["store_digest"] == current["store_digest"]:
        return
    tokenizer = ""
    if recorded.get("tokenizer_sha256") != current.get("tokenizer_sha256"):
        tokenizer = (f", tokenizer {str(current.get('tokenizer_sha256'))[:12]} instead of "
                     f"{str(recorded.get('tokenizer_sha256'))[:12]}")
    raise DataChanged(
        f"run {run_id} trained on token store {recorded['store_digest'][:12]} ({_where(recorded)}); "
        f"{_where(current)} is token store {current['store_digest'][:12]}{tokenizer}: refusing to "
        "train it on other data (leave out --data-dir to use the recorded store, or train under "
        "another --runs-dir)")


def check_checkpoint_data(run_id: str, step: int, metadata: dict, current: dict) -> None:
    """DataChanged unless the checkpoint restored at `step` (its `metadata`) was saved training on the
    data `current` names. A checkpoint saved without a data digest, or data without one (in-memory), is
    not checked. This catches a run.json that no longer matches its checkpoints (a runs folder copied
    together from two places, a run.json rewritten by hand)."""
    recorded = {"store_digest": metadata.get("data_digest"),
                "tokenizer_sha256": metadata.get("tokenizer_sha256"), "path": f"its checkpoint at step {step}"}
    check_same_data(run_id, recorded, current)


def recorded_data(spec_file) -> tuple[bool, dict | None]:
    """(whether the run's run.json exists, its "data" record or None)."""
    from smelt_jax.run_files.run_spec_file import read_run_record
    if not storage.exists(spec_file):
        return False, None
    record = read_run_record(spec_file, Path(str(spec_file)).parent.name)  # damaged or edited: one line
    data = record.get("data")
    return True, data if isinstance(data, dict) else None


def data_for_run(run_id: str, spec_file, *, corpus=None, data_dir: str | None = None,
                 open_store: Callable[[str | None], object]) -> tuple[object, dict]:
    """(the corpus a phase of `run_id` trains on, its record). `corpus` or `data_dir` when given, else
    the store run.json records, else `open_store(None)` (the embedded corpus). DataChanged when
    run.json records another store."""
    exists, recorded = recorded_data(spec_file)
    if exists and recorded is None and run_id not in _NOT_RECORDED_SAID:
        _NOT_RECORDED_SAID.add(run_id)
        print(f"smelt: {run_id}: its run.json records no token store (written before runs recorded "
              "their data); the data is not checked", file=sys.stderr)
    if corpus is None:
        path = data_dir if data_dir is not None else (recorded or {}).get("path")
        corpus = open_store(path)
    current = describe(corpus)
    check_same_data(run_id, recorded, current)
    return corpus, current


def evaluation_data(run_id: str, spec_file, *, data_dir: str | None,
                    open_store: Callable[[str | None], object]) -> object:
    """The corpus `smelt eval` / `smelt analyze` read for a trained run: `data_dir` when given, else the
    store the run's run.json records (the embedded corpus when it records none). Evaluating on other
    data is allowed; it is said once on stderr, naming both stores."""
    _, recorded = recorded_data(spec_file)
    corpus = open_store(data_dir if data_dir is not None else (recorded or {}).get("path"))
    current = describe(corpus)
    if recorded and recorded.get("store_digest") and current.get("store_digest") not in (None, recorded["store_digest"]):
        print(f"smelt: {run_id} trained on token store {recorded['store_digest'][:12]} ({_where(recorded)}); "
              f"evaluating on token store {current['store_digest'][:12]} ({_where(current)})", file=sys.stderr)
    return corpus

"""Data that cannot lie (issue 53, item 6): a token chunk overwritten at the same size, or holding ids
outside the vocabulary, is named as damage (which store, which chunk, what is wrong) and never trains.

The store is made by `smelt data prepare` with the byte tokenizer (vocabulary 512) from ~700 KB of
random words (11 token chunks of 2**16 tokens); each test damages a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import experiments
from smelt_jax.cli import main
from smelt_jax.data.hf_tokenizer import BytesTokenizer
from smelt_jax.data.prepare import PrepareConfig, prepare
from smelt_jax.data.store_arrays import open_array
from smelt_jax.data.token_store import StoreError, TokenStore, check_store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    (base / "in").mkdir()
    with open(base / "in" / "part-0.jsonl", "w") as out:
        for _ in range(700):
            out.write(json.dumps({"text": " ".join(rng.choice(words, size=300))}) + "\n")
    result = prepare([str(base / "in")], base / "store", BytesTokenizer(),
                     PrepareConfig(val_fraction=0.1, default_source="words"), progress=False)
    return Path(result.root)


@pytest.fixture
def copy(store, tmp_path) -> Path:
    shutil.copytree(store, tmp_path / "copy")
    return tmp_path / "copy"


def _chunk(root: Path, index: int) -> Path:
    return root / "arrays" / "tokens" / "c" / str(index)


def _swap_chunks(root: Path, a: int, b: int) -> None:
    """Two chunk objects exchanged: the same count and total bytes, every chunk still decodes."""
    first, second = _chunk(root, a).read_bytes(), _chunk(root, b).read_bytes()
    _chunk(root, a).write_bytes(second)
    _chunk(root, b).write_bytes(first)


def test_the_writer_records_a_checksum_per_chunk(store):
    record = json.loads((store / "manifest.json").read_text())["arrays"]["tokens"]["chunks"]
    assert len(record["crc32"]) == 8 * record["objects"]


def test_a_chunk_overwritten_at_the_same_size_is_named_when_read(copy):
    _swap_chunks(copy, 2, 3)
    check_store(copy)  # the cheap open check cannot see it: count and bytes are unchanged
    opened = TokenStore(copy)
    opened.tokens.read(0, 2 << 16)  # chunks 0 and 1 are intact
    with pytest.raises(StoreError, match=r"token chunk .*/arrays/tokens/c/2 has CRC-32 [0-9a-f]{8}, the "
                                         r"manifest records [0-9a-f]{8}: the chunk was overwritten"):
        opened.tokens.take(np.array([5, (2 << 16) + 7]))
    with pytest.raises(StoreError, match="c/3 has CRC-32"):
        opened.split("words", "train").tokens[np.arange(3 << 16, (3 << 16) + 10)]


def _rewrite_chunk_values(root: Path, index: int, value: int) -> None:
    """Chunk `index` re-encoded with ids `value` at every 1000th position (a valid zstd object)."""
    array = open_array(root, "tokens", write=True)
    span = slice(index << 16, (index + 1) << 16)
    values = np.asarray(array[span].read().result()).copy()
    values[::1000] = value
    array[span].write(values).result()


def _without_checksums(root: Path) -> Path:
    """The store as written before checksums: a chunk record of the count only."""
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["arrays"]["tokens"]["chunks"]["crc32"]
    del manifest["arrays"]["tokens"]["chunks"]["bytes"]
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_ids_outside_the_vocabulary_are_named_as_damage_in_a_store_without_checksums(copy):
    """A store written before checksums still opens and reads; its ids are still checked against the
    vocabulary (512)."""
    _rewrite_chunk_values(_without_checksums(copy), 4, 28_286)
    opened = TokenStore(copy)
    assert opened.tokens.read(0, 4 << 16).max() < 512  # undamaged chunks read as before
    with pytest.raises(StoreError, match=r"c/4 holds ids up to 28286, the tokenizer's vocabulary has 512"):
        opened.tokens.read(4 << 16, 5 << 16)


@pytest.mark.integration
def test_train_on_ids_outside_the_vocabulary_exits_2_naming_the_chunk(copy, tmp_path, capsys):
    """Before: training read ids up to 28,286 and exited 3 blaming a non-finite loss."""
    _rewrite_chunk_values(_without_checksums(copy), 4, 28_286)
    run = experiments.load_suite("micro")[0]
    code = main(["train", run.id, "--runs-dir", str(tmp_path / "runs"), "--data-dir", str(copy),
                 "--quiet", "--stop-after", "20"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "holds ids up to 28286" in lines[-1], err

"""A damaged token store never trains (issue 27, items 1, 5 and the truncated-chunk case of 9).

The store is made here by `smelt data prepare` with the byte tokenizer from ~700 KB of random words
(11 token chunks of 2**16 tokens), so each test can damage a copy of it the way a partial copy, an
edited manifest or a truncated object would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import experiments
from smelt_jax.cli import main
from smelt_jax.data import prepare as prepare_module
from smelt_jax.data.hf_tokenizer import BytesTokenizer
from smelt_jax.data.prepare import PrepareConfig, PrepareError, prepare
from smelt_jax.data.token_store import StoreError, TokenStore, check_store, verify_store

CONFIG = PrepareConfig(val_fraction=0.1, default_source="words")


def _write_inputs(folder: Path, seed: int, documents: int = 700) -> Path:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(300)]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "part-0.jsonl", "w") as out:
        for _ in range(documents):
            out.write(json.dumps({"text": " ".join(rng.choice(words, size=300))}) + "\n")
    return folder


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("store")
    result = prepare([str(_write_inputs(base / "in", 0))], base / "store", BytesTokenizer(), CONFIG,
                     progress=False)
    assert result.manifest["arrays"]["tokens"]["chunks"]["objects"] >= 8
    return Path(result.root)


@pytest.fixture
def copy(store, tmp_path) -> Path:
    shutil.copytree(store, tmp_path / "copy")
    return tmp_path / "copy"


def _chunks(root: Path) -> list[Path]:
    return sorted((root / "arrays" / "tokens" / "c").iterdir(), key=lambda p: int(p.name))


def _train_refuses(root: Path, tmp_path: Path, capsys, expected: str) -> None:
    """`smelt train` on the store: exit 2, one line with `expected`, and nothing written."""
    run = experiments.load_suite("micro")[0]
    runs = tmp_path / "runs"
    assert main(["train", run.id, "--runs-dir", str(runs), "--data-dir", str(root), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    assert not runs.exists() or not any(runs.rglob("*"))  # no run folder, no empty metrics.jsonl


def test_intact_store_passes_the_cheap_check(store):
    manifest = check_store(store)
    assert manifest["arrays"]["tokens"]["chunks"]["bytes"] == sum(p.stat().st_size for p in _chunks(store))
    assert TokenStore(store).tokens.size == manifest["totals"]["tokens"]


def test_partial_copy_is_refused_before_training(copy, tmp_path, capsys):
    chunks = _chunks(copy)
    for path in chunks[2:]:  # 75%+ of the chunks gone, as `rm STORE/arrays/tokens/c/{100..395}`
        path.unlink()
    with pytest.raises(StoreError, match=rf"{len(chunks) - 2} of {len(chunks)} token chunks are missing"):
        TokenStore(copy)
    _train_refuses(copy, tmp_path, capsys, "token chunks are missing")


def test_a_chunk_lost_after_opening_reads_as_an_error_never_zeros(copy):
    opened = TokenStore(copy)
    expected = np.asarray(opened.tokens.read(0, 3 << 16))
    _chunks(copy)[1].unlink()
    with pytest.raises(StoreError, match="1 of .* token chunks are missing"):
        TokenStore(copy)  # the open-time check sees it; a read through a view opened before must too
    from smelt_jax.data.store_arrays import open_array
    from smelt_jax.data.token_store import TokenArray
    raw = TokenArray(open_array(copy, "tokens", cache_bytes=0), str(copy))
    with pytest.raises(StoreError, match="cannot read tokens 65536..131071.*missing"):
        raw.read(1 << 16, 2 << 16)
    with pytest.raises(StoreError, match="missing"):
        raw.take(np.array([5, (1 << 16) + 7]))
    assert np.array_equal(raw.read(0, 1 << 16), expected[:1 << 16])  # the chunks still there read


def test_edited_store_digest_is_refused(copy, tmp_path, capsys):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["store_digest"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="store_digest .* is not the digest of its content"):
        TokenStore(copy)
    _train_refuses(copy, tmp_path, capsys, "is not the digest of its content")


def test_truncated_chunk_is_refused_at_open_and_at_read(copy, tmp_path, capsys):
    from smelt_jax.data.store_arrays import open_array
    from smelt_jax.data.token_store import TokenArray

    path = _chunks(copy)[3]
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(StoreError, match="truncated or rewritten chunks"):
        TokenStore(copy)
    _train_refuses(copy, tmp_path, capsys, "truncated or rewritten chunks")
    raw = TokenArray(open_array(copy, "tokens", cache_bytes=0), str(copy))
    with pytest.raises(StoreError, match=r"cannot read tokens 196608\.\..*the store is damaged"):
        raw.read(3 << 16, 4 << 16)
    problems = str(pytest.raises(StoreError, verify_store, copy).value)
    assert "fails verification" in problems and "cannot read tokens" in problems


def test_store_without_a_chunk_record_still_needs_every_chunk(copy):
    """A store prepared before chunk records (or the embedded corpus): presence against the grid."""
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["arrays"]["tokens"]["chunks"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    TokenStore(copy)
    # Such a store's writer left out chunks equal to the fill value: the all-zero doc_source of this
    # one-source store reads as zeros there, and the store still verifies.
    (copy / "arrays" / "doc_source" / "c" / "0").unlink()
    verify_store(copy)
    _chunks(copy)[-1].unlink()
    with pytest.raises(StoreError, match="1 of .* token chunks are missing"):
        TokenStore(copy)


def test_a_missing_small_array_chunk_fails_verification(copy):
    (copy / "arrays" / "doc_source" / "c" / "0").unlink()  # every chunk is stored, even all-zero ones
    with pytest.raises(StoreError, match="cannot read doc_source.*missing"):
        verify_store(copy)


def _digest(root: Path) -> str:
    return json.loads((root / "manifest.json").read_text())["store_digest"]


def test_prepare_over_a_store_replaces_it_only_with_force_and_only_when_complete(copy, tmp_path, monkeypatch):
    before = _digest(copy)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "part-0.jsonl").write_text('{"text": "   "}\n')
    with pytest.raises(PrepareError, match="pass --force"):  # other inputs: refused, store untouched
        prepare([str(empty)], copy, BytesTokenizer(), CONFIG, progress=False)
    assert _digest(copy) == before and TokenStore(copy)
    with pytest.raises(PrepareError, match="no usable documents"):  # --force on a bad input: kept
        prepare([str(empty)], copy, BytesTokenizer(), CONFIG, progress=False, force=True)
    assert _digest(copy) == before and TokenStore(copy)

    other = _write_inputs(tmp_path / "other", seed=1, documents=300)

    def crash(task):
        raise RuntimeError("killed mid-assembly")
    monkeypatch.setattr(prepare_module, "_assemble_task", crash)
    with pytest.raises(RuntimeError, match="mid-assembly"):
        prepare([str(other)], copy, BytesTokenizer(), CONFIG, progress=False, force=True)
    assert _digest(copy) == before and TokenStore(copy)  # the old store reads on
    monkeypatch.undo()

    result = prepare([str(other)], copy, BytesTokenizer(), CONFIG, progress=False, force=True)
    assert result.prepared and _digest(copy) == result.manifest["store_digest"] != before
    assert not (copy / prepare_module.STAGING_DIR).exists()
    assert sorted(p.name for p in copy.iterdir()) == ["arrays", "manifest.json", "parts"]
    verify_store(copy)
    fresh = prepare([str(other)], tmp_path / "fresh", BytesTokenizer(), CONFIG, progress=False)
    assert fresh.manifest["store_digest"] == result.manifest["store_digest"]


def test_cli_prepare_refuses_to_replace_without_force(copy, tmp_path, capsys):
    other = _write_inputs(tmp_path / "other", seed=2, documents=50)
    before = _digest(copy)
    assert main(["data", "prepare", "--input", str(other), "--out", str(copy), "--default-source", "words",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --force" in err
    assert _digest(copy) == before

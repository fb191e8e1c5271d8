"""Hugging Face tokenizers: training a byte-level BPE, hashes, specials, loading from disk and gs://."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gcs_emulator import BUCKET, gcs_emulator  # noqa: F401 - the fixture

from smelt_jax.data.hf_tokenizer import (
    BytesTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
    token_dtype,
    train_bpe,
)
from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER

TEXTS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # the number {i}\n" for i in range(400)] + \
        ["The quick brown fox jumps over the lazy dog. Ünïcödé text, 日本語, emoji 🙂."] * 20


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe(iter(TEXTS), 384)


def test_training_is_deterministic_and_hash_is_canonical(bpe):
    again = train_bpe(iter(TEXTS), 384)
    assert again.sha256 == bpe.sha256 and len(bpe.sha256) == 64
    assert bpe.vocab_size == 384
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)
    # Formatting does not change the hash; content does.
    pretty = bpe.tokenizer.to_str(pretty=True)
    assert HFTokenizer.from_str(pretty).sha256 == bpe.sha256
    assert train_bpe(iter(TEXTS[:200]), 384).sha256 != bpe.sha256
    assert bpe.to_dict()["sha256"] == bpe.sha256 and bpe.to_dict()["vocab_size"] == 384


def test_documents_round_trip_with_bos_and_eos(bpe):
    for text in (TEXTS[3], TEXTS[-1], "bytes never seen: \x00\x7f ☃"):
        ids = bpe.encode_document(text)
        assert ids.dtype == np.uint16 and ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id
        assert bpe.decode(ids) == text
    assert bpe.encode_document(TEXTS[3]).size < len(TEXTS[3].encode()) * 0.6  # it learnt merges
    assert token_dtype(70_000) == np.uint32


def test_save_and_load_local_and_gcs(bpe, tmp_path, gcs_emulator):  # noqa: F811
    bpe.save(tmp_path / "tokenizer.json")
    assert HFTokenizer.from_file(tmp_path / "tokenizer.json").sha256 == bpe.sha256
    url = f"gs://{BUCKET}/tokenizers/bpe.json"
    bpe.save(url)
    loaded = load_tokenizer(url)
    assert loaded.sha256 == bpe.sha256
    assert np.array_equal(loaded.encode_document(TEXTS[5]), bpe.encode_document(TEXTS[5]))
    with pytest.raises(TokenizerError, match="cannot read"):
        HFTokenizer.from_file(f"gs://{BUCKET}/missing.json")


def test_specials_of_other_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "wl.json"
    path.write_text(tok.to_str())
    loaded = HFTokenizer.from_file(path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 2)  # no pad: </s> pads
    assert loaded.encode_document("hello world").tolist() == [1, 3, 4, 2]
    assert HFTokenizer.from_file(path, pad="<unk>").pad_id == 0
    bare = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(TokenizerError, match="BOS"):
        HFTokenizer.from_str(bare.to_str())
    (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(TokenizerError):
        HFTokenizer.from_file(tmp_path / "bad.json")


def test_byte_tokenizer_keeps_its_layout():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, BytesTokenizer) and tok.kind == "bytes"
    assert tok.vocab_size == DEFAULT_TOKENIZER.vocab_size == 512
    assert tok.encode_document("ab").tolist() == [256, 97, 98, 257]
    assert load_tokenizer(None).sha256 == tok.sha256

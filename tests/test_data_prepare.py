"""`smelt data prepare`: text shards -> token store, locally and on a real local Cloud Storage server.

The input is a few MB of JSONL / JSONL.zst / Parquet made here from the Python standard library's
sources (source `code`) and their module docstrings (source `prose`), with a BPE trained on it.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from gcs_emulator import BUCKET, gcs_emulator  # noqa: F401 - the fixture

from smelt_jax.cli import main
from smelt_jax.platform import storage as gcs
from smelt_jax.data.hf_tokenizer import HFTokenizer
from smelt_jax.data.pipeline import TrainPipeline, validation_sets
from smelt_jax.data.prepare import PrepareConfig, prepare
from smelt_jax.data.token_store import StoreError, TokenStore, verify_store

CONFIG = PrepareConfig(val_fraction=0.05)


def _records(limit_bytes: int = 3_000_000) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    records, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        records.append({"text": text, "source": "code", "path": path.name})
        try:
            doc = ast.get_docstring(ast.parse(text))
        except (SyntaxError, ValueError):
            doc = None
        if doc:
            records.append({"text": doc, "source": "prose"})
        size += len(text)
        if size > limit_bytes:
            break
    return records


def _jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Good shards in three formats, one shard with bad records, and a corrupt shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder = tmp_path_factory.mktemp("inputs")
    records = _records()
    for i in range(3):
        (folder / f"part-{i}.jsonl").write_bytes(_jsonl(records[i:-40:3]))
    (folder / "part-3.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(records[-40:-20])))
    tail = records[-20:]
    pq.write_table(pa.table({"text": [r["text"] for r in tail], "source": [r["source"] for r in tail]}),
                   folder / "part-4.parquet")
    (folder / "mixed.jsonl").write_bytes(
        b'{"text": "a good short document", "source": "prose"}\n'
        b'{"text": "caf\xe9 latin-1", "source": "prose"}\n'
        b'{"source": "prose"}\n'
        b'{"text": "   ", "source": "prose"}\n'
        b'{"text": "no label"}\n'
        b'this is not json\n')
    (folder / "corrupt.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(records[:5]))[:200])
    return folder


@pytest.fixture(scope="module")
def tokenizer_path(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert main(["data", "tokenizer", "train", "--input", str(inputs / "part-*.jsonl"), "--vocab-size", "768",
                 "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def local_store(inputs, tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "store"
    result = prepare([str(inputs)], out, HFTokenizer.from_file(tokenizer_path), CONFIG, progress=False)
    return result


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_prepare_counts_bad_input_and_reports_the_corrupt_shard(local_store, inputs):
    manifest = local_store.manifest
    assert [f["input"] for f in local_store.failed_shards] == [str(inputs / "corrupt.jsonl.zst")]
    assert manifest["failed_shards"][0]["input"].endswith("corrupt.jsonl.zst")
    assert manifest["problems"] == {"non_utf8": 1, "missing_text": 1, "empty": 1, "missing_source": 1,
                                    "bad_json": 1}
    mixed = next(e for e in manifest["inputs"] if e["input"].endswith("mixed.jsonl"))
    assert mixed["counts"]["documents"] == 1 and "line 2: non_utf8" in mixed["examples"]
    # The rest is prepared: every good shard, both sources, both splits.
    statuses = {Path(e["input"]).name: e["status"] for e in manifest["inputs"]}
    assert statuses["part-4.parquet"] == "tokenized" and statuses["part-3.jsonl.zst"] == "tokenized"
    assert {s["name"] for s in manifest["sources"]} == {"code", "prose"}
    for source in manifest["sources"]:
        assert source["splits"]["train"]["documents"] > 0 and source["splits"]["val"]["documents"] > 0
    totals = manifest["totals"]
    assert totals["tokens"] == totals["train"]["tokens"] + totals["val"]["tokens"] > 500_000
    verify_store(local_store.root)


def test_cli_exit_status_names_the_failed_shard(inputs, tokenizer_path, tmp_path, capsys):
    code = main(["data", "prepare", "--input", str(inputs / "mixed.jsonl"), str(inputs / "corrupt.jsonl.zst"),
                 "--out", str(tmp_path / "s"), "--tokenizer", str(tokenizer_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 1
    assert "corrupt.jsonl.zst" in out and "missing_text 1" in out


def test_store_reads_back_the_documents(local_store, tokenizer_path):
    store = TokenStore(local_store.root, expect_tokenizer=HFTokenizer.from_file(tokenizer_path).sha256)
    tok = store.tokenizer
    part = store.split("prose", "train")
    first = part.document(0)
    assert first[0] == tok.bos_id and first[-1] == tok.eos_id
    assert len(tok.decode(first)) > 20
    assert np.array_equal(np.asarray(part.tokens)[part.offsets[1]:part.offsets[2]], part.document(1))
    with pytest.raises(StoreError, match="expected"):
        TokenStore(local_store.root, expect_tokenizer="0" * 64)


def test_resume_reuses_verified_parts_and_gives_the_same_digest(local_store, inputs, tokenizer_path, tmp_path):
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(local_store.root, copy)
    parts = sorted((copy / "parts").iterdir())
    # A crash before the manifest, one shard never committed, one part damaged.
    (copy / "manifest.json").unlink()
    (parts[0] / "part.json").unlink()
    (parts[1] / "part.npz").write_bytes(b"damaged")
    tok = HFTokenizer.from_file(tokenizer_path)
    lines: list[str] = []
    # Two machines tokenize half the shards each (only the two broken parts are redone), then one
    # run assembles.
    for index in range(2):
        half = prepare([str(inputs)], copy, tok, CONFIG, subset=(index, 2), log=lines.append)
        assert half.manifest == {} and not half.prepared
    assert not (copy / "manifest.json").exists()
    assert sum(": tokenized" in line for line in lines) == 2
    assert sum(": reused" in line for line in lines) == len(parts) - 2
    result = prepare([str(inputs)], copy, tok, CONFIG, log=lines.append)
    statuses = [e["status"] for e in result.manifest["inputs"]]
    assert statuses.count("failed") == 1 and statuses.count("reused") == len(statuses) - 1
    assert result.manifest["store_digest"] == local_store.manifest["store_digest"]


def test_sharded_layout_has_the_same_digest(local_store, inputs, tokenizer_path, tmp_path):
    import dataclasses
    import shutil

    shutil.copytree(Path(local_store.root) / "parts", tmp_path / "store" / "parts")  # reused: assembly only
    config = dataclasses.replace(CONFIG, layout="sharded")
    result = prepare([str(inputs)], tmp_path / "store", HFTokenizer.from_file(tokenizer_path), config,
                     progress=False)
    assert result.manifest["store_digest"] == local_store.manifest["store_digest"]
    assert {e["status"] for e in result.manifest["inputs"]} == {"reused", "failed"}
    verify_store(result.root)
    a = TrainPipeline(TokenStore(result.root), batch_size=2, seq_len=32, seed=0, host_index=0, host_count=1)
    b = TrainPipeline(TokenStore(local_store.root), batch_size=2, seq_len=32, seed=0, host_index=0,
                      host_count=1)
    assert _equal(a.batch_at(5), b.batch_at(5))


@pytest.fixture(scope="module")
def gcs_store(gcs_emulator, inputs, tokenizer_path):  # noqa: F811
    """Inputs and tokenizer copied to the bucket, prepared there by two worker processes."""
    for path in sorted(inputs.iterdir()):
        gcs.write_bytes(f"gs://{BUCKET}/inputs/{path.name}", path.read_bytes())
    gcs.write_bytes(f"gs://{BUCKET}/tokenizer.json", tokenizer_path.read_bytes())
    remote_tok = HFTokenizer.from_file(f"gs://{BUCKET}/tokenizer.json")
    return prepare([f"gs://{BUCKET}/inputs/*"], f"gs://{BUCKET}/stores/v1", remote_tok, CONFIG, workers=2,
                   progress=False)


def test_gcs_store_matches_local_and_batches_agree(gcs_store, local_store, capsys):
    assert main(["data", "tokenizer", "info", f"gs://{BUCKET}/tokenizer.json"]) == 0
    assert local_store.manifest["tokenizer"]["sha256"] in capsys.readouterr().out
    remote_tok = HFTokenizer.from_file(f"gs://{BUCKET}/tokenizer.json")
    root, result = gcs_store.root, gcs_store
    assert [f["input"] for f in result.failed_shards] == [f"gs://{BUCKET}/inputs/corrupt.jsonl.zst"]
    assert result.manifest["store_digest"] == local_store.manifest["store_digest"]
    verify_store(root)
    # A second run retries the failed shard and reuses every other part: the same store.
    again = prepare([f"gs://{BUCKET}/inputs/*"], root, remote_tok, CONFIG, progress=False)
    assert again.manifest["store_digest"] == result.manifest["store_digest"]
    assert {e["status"] for e in again.manifest["inputs"]} == {"reused", "failed"}

    local, remote = TokenStore(local_store.root), TokenStore(root)
    a = TrainPipeline(local, batch_size=4, seq_len=64, seed=3, host_index=0, host_count=1)
    b = TrainPipeline(remote, batch_size=4, seq_len=64, seed=3, host_index=0, host_count=1)
    for step in (0, 1, 7, 500):
        assert _equal(a.batch_at(step), b.batch_at(step))
    halves = [TrainPipeline(remote, batch_size=4, seq_len=64, seed=3, host_index=h, host_count=2)
              for h in range(2)]
    whole = a.batch_at(3)
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([h.batch_at(3)[key] for h in halves]), whole[key])
    val_a = validation_sets(local, batch_size=4, seq_len=64, host_index=0, host_count=1, max_tokens=2000)
    val_b = validation_sets(remote, batch_size=4, seq_len=64, host_index=0, host_count=1, max_tokens=2000)
    assert set(val_a) == {"code", "prose"}
    for source in val_a:
        assert all(_equal(x, y) for x, y in zip(val_a[source], val_b[source]))


@pytest.mark.slow
def test_training_on_local_and_gcs_stores_gives_the_same_losses(gcs_store, local_store, tmp_path):
    """A micro run on the prepared store, read from local disk and from gs://: identical losses (~45 s)."""
    from smelt_jax.design.config import ModelConfig, Schedule
    from smelt_jax.design.descriptors import RunSpec
    from smelt_jax.train.trainer import TrainOptions, train

    local, remote = TokenStore(local_store.root), TokenStore(gcs_store.root)
    model = ModelConfig(vocab=local.tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                        head_dim=16, n_experts=4, top_k=2, expert_ffn=32, loop_start=1, loop_length=1,
                        loop_repeats=1, seq_len=32, capacity_factor=2.0)
    schedule = Schedule(batch_size=4, seq_len=32, stable_steps=6, fork_steps=(6,), decay_steps=2,
                        warmup_steps=2, peak_lr=3e-3)
    run = RunSpec(suite="unit", scale="tiny", sparsity_label="s50", arch="smelt", model=model,
                  schedule=schedule, control=model.replace(n_experts=2), pair_id="unit-tiny")
    options = TrainOptions(log_every=1, checkpoint_every=100, eval_tokens=256, eval_batch_size=4,
                           progress=False, peak_flops=1e12, devices=1)
    losses = []
    for name, store in (("local", local), ("gcs", remote)):
        train(run, root=tmp_path / name, corpus=store, options=options)
        lines = (tmp_path / name).rglob("metrics.jsonl")
        metrics = [json.loads(line) for path in lines for line in path.read_text().splitlines()]
        losses.append([m["loss"] for m in metrics if "loss" in m])
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    assert all(np.isfinite(losses[0]))


def test_gcs_store_is_checked_at_open_and_replaced_only_with_force(gcs_store, inputs, tokenizer_path):
    """Issue 27 items 1 and 5 on gs://: the staging prefix is gone after the swap, a copy missing one
    chunk object is refused at open, and other inputs do not replace the store without --force."""
    from smelt_jax.data.prepare import STAGING_DIR, PrepareError

    root = gcs_store.root
    assert not gcs.list_files(gcs.join(root, STAGING_DIR))
    assert gcs_store.manifest["arrays"]["tokens"]["chunks"]["bytes"] is None  # no sizes in a bucket listing
    copy = f"gs://{BUCKET}/stores/partial"
    for url in gcs.list_files(root):
        if "/parts/" not in url:
            gcs.write_bytes(copy + url[len(root):], gcs.read_bytes(url))
    TokenStore(copy)
    gcs.delete(f"{copy}/arrays/tokens/c/1")
    with pytest.raises(StoreError, match=r"1 of \d+ token chunks are missing \(c/1 under gs://"):
        TokenStore(copy)
    remote_tok = HFTokenizer.from_file(f"gs://{BUCKET}/tokenizer.json")
    with pytest.raises(PrepareError, match="pass --force"):
        prepare([str(inputs / "mixed.jsonl")], root, remote_tok, CONFIG, progress=False)
    assert TokenStore(root).digest == gcs_store.manifest["store_digest"]

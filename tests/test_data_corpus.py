"""The corpus build: sources, splitting, provenance, checksums, idempotence; and the byte tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import TINY_SOURCES, build_tiny_corpus, tiny_config, write_fake_tree

from smelt_jax.data import corpus as corpus_module
from smelt_jax.data.corpus import (
    CORPUS_VERSION,
    EXPECTED_FILE,
    MANIFEST_NAME,
    BuildConfig,
    CorpusError,
    DigestMismatch,
    build_corpus,
    check_expected,
    expected_record,
    open_dataset,
    verify_corpus,
)
from smelt_jax.data.inputs import PINNED_ARCHIVES
from smelt_jax.data.sources import (
    DEFAULT_SOURCES,
    FileSet,
    Roots,
    SourceSpec,
    list_files,
    split_document,
)
from smelt_jax.data.token_store import StoreError, TokenStore
from smelt_jax.data.tokenizer import ByteTokenizer


def _sources(corpus: TokenStore) -> dict[str, dict]:
    return {entry["name"]: entry for entry in corpus.manifest["sources"]}


def _origins(corpus: TokenStore, source: str, split: str) -> list[str]:
    lines = (Path(corpus.root) / "origins.txt").read_text().splitlines()
    return [lines[i] for i in corpus.document_ids(source, split)]


def _documents(corpus: TokenStore, source: str, split: str) -> list[bytes]:
    part = corpus.split(source, split)
    tok = corpus.tokenizer
    out = []
    for d in range(part.num_documents):
        ids = np.asarray(part.document(d))
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert (ids[1:-1] < 256).all()
        out.append(ids[1:-1].astype(np.uint8).tobytes())
    return out


# Tokenizer ----------------------------------------------------------------------------------------
def test_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "naïve café — ∑ x² \n\t end"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.size == len(text.encode())
    assert tok.decode(ids) == text
    doc = tok.encode_document(text)
    assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id and tok.decode(doc) == text
    assert tok.vocab_size % 128 == 0 and tok.vocab_size > tok.pad_id
    with pytest.raises(ValueError):
        ByteTokenizer(bos_id=5)
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=258)


# Source helpers ------------------------------------------------------------------------------------
def test_split_document_cuts_at_natural_boundaries():
    rng = np.random.default_rng(0)
    paragraphs = [f"word{i} " * int(rng.integers(1, 15)) for i in range(80)]  # each < 150 bytes
    text = "\n\n".join(paragraphs).encode()
    chunks = split_document(text, 300)
    assert len(chunks) > 5 and b"".join(chunks) == text
    assert all(0 < len(c) <= 300 for c in chunks)
    # A blank line always lies in the second half of a window here: every cut follows one.
    assert all(c.endswith(b"\n\n") for c in chunks[:-1])
    lines = b"".join(b"%03d " % i * 9 + b"\n" for i in range(40))  # 37-byte lines, no blank line
    assert all(c.endswith(b"\n") and len(c) <= 300 for c in split_document(lines, 300)[:-1])
    assert split_document(b"x" * 1000, 300) == [b"x" * 300] * 3 + [b"x" * 100]  # no newline: hard cut
    with pytest.raises(ValueError):
        split_document(b"abc", 0)


def test_list_files_patterns_and_excludes(tmp_path):
    for rel in ("a.py", "pkg/b.py", "pkg/tests/c.py", "pkg/d.txt", "sys/e.h", "f.h", "deep/sys/g.h"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert list_files(tmp_path, FileSet("r", ("**/*.py",), ("**/tests/**",))) == ["a.py", "pkg/b.py"]
    assert list_files(tmp_path, FileSet("r", ("*.h", "sys/*.h"))) == ["f.h", "sys/e.h"]
    assert list_files(tmp_path / "missing", FileSet("r", ("*",))) == []


# Build ---------------------------------------------------------------------------------------------
def test_tiny_build_contents_provenance_and_splits(tmp_path):
    corpus = build_tiny_corpus(tmp_path)
    manifest = corpus.manifest
    assert set(corpus.sources) == {s.name for s in TINY_SOURCES}
    src = tmp_path / "src"
    fake_py = {p.read_bytes() for p in (src / "stdlib" / "pkg").glob("mod*.py")}
    for source in corpus.sources:
        train, val = _documents(corpus, source, "train"), _documents(corpus, source, "val")
        assert train and val, f"{source}: both splits must be non-empty"
        assert not set(train) & set(val)
        meta = _sources(corpus)[source]["splits"]
        assert meta["train"]["documents"] == len(train) and meta["val"]["documents"] == len(val)
        assert len(_origins(corpus, source, "val")) == len(val)
    # Code documents are chunks (<= 512 bytes) of the fake modules; chunks of one file stay together.
    code = _documents(corpus, "code", "train") + _documents(corpus, "code", "val")
    assert all(len(d) <= 512 for d in code)
    assert sorted(fake_py) == sorted(set(fake_py))  # distinct fake files
    rebuilt = {}
    for split in ("train", "val"):
        for origin, doc in zip(_origins(corpus, "code", split), _documents(corpus, "code", split)):
            rebuilt.setdefault(origin.split("#")[0], []).append((split, doc))
    assert {b"".join(d for _, d in chunks) for chunks in rebuilt.values()} == fake_py
    assert all(len({s for s, _ in chunks}) == 1 for chunks in rebuilt.values())
    # Binary, non-UTF-8 and pattern-excluded files are not used, and are counted.
    prov = _sources(corpus)["code"]["provenance"][0]
    assert prov["files_matched"] == len(fake_py) + 2 and prov["files_used"] == len(fake_py)
    assert prov["files_skipped"] == 2
    words = b"".join(_documents(corpus, "words", "train") + _documents(corpus, "words", "val"))
    assert b"Function docstring number" in words and b"def g" not in words
    assert manifest["tokenizer"]["version"] == "bytes-v1"
    assert manifest["totals"]["train"]["tokens"] == corpus.num_tokens("train")


def test_split_depends_only_on_content(tmp_path):
    """Renaming every file (so the read order changes) keeps the same validation documents."""
    first = build_tiny_corpus(tmp_path / "a")
    roots = write_fake_tree(tmp_path / "b" / "src")
    for path in sorted(Path(roots.get("stdlib"), "pkg").glob("mod*.py")):
        path.rename(path.with_name("z_" + path.name))
    second = TokenStore(build_corpus(tmp_path / "b" / "corpus", tiny_config(roots), progress=False).folder)
    assert sorted(_documents(first, "code", "val")) == sorted(_documents(second, "code", "val"))


def test_duplicates_across_sources_kept_once(tmp_path):
    roots = write_fake_tree(tmp_path / "src")
    Path(roots.get("licenses"), "COPY.py").write_text(Path(roots.get("stdlib"), "pkg", "mod00.py").read_text())
    sources = TINY_SOURCES[:1] + (SourceSpec("dup", "prose:english", "licences",
                                             (FileSet("licenses", ("*",)),), 1_000_000),)
    config = BuildConfig(sources=sources, roots=roots, val_fraction=0.2, max_document_bytes=100_000)
    corpus = TokenStore(build_corpus(tmp_path / "c", config, progress=False).folder)
    dup_docs = _documents(corpus, "dup", "train") + _documents(corpus, "dup", "val")
    assert Path(roots.get("stdlib"), "pkg", "mod00.py").read_bytes() not in dup_docs
    assert _sources(corpus)["dup"]["duplicates_dropped"] == 1


def test_build_is_idempotent_and_detects_corruption(tmp_path):
    roots = write_fake_tree(tmp_path / "src")
    config = tiny_config(roots)
    first = build_corpus(tmp_path / "corpus", config, progress=False)
    assert first.built
    files = sorted(p for p in first.folder.rglob("*") if p.is_file())
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    second = build_corpus(tmp_path / "corpus", config, progress=False)
    assert not second.built and second.manifest["store_digest"] == first.manifest["store_digest"]
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes
    # A different recipe over the same folder is refused.
    with pytest.raises(CorpusError, match="another recipe"):
        build_corpus(tmp_path / "corpus", tiny_config(roots, corpus_version="other"), progress=False)
    # Change one stored token (rewriting its chunk): verification and a rebuild attempt name the array.
    import tensorstore as ts

    tokens = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                     "path": str(first.folder / "arrays" / "tokens")}}).result()
    tokens[5].write(np.uint16(int(tokens[5].read().result()) ^ 1)).result()
    with pytest.raises(CorpusError, match="tokens: digest mismatch"):
        verify_corpus(first.folder)
    with pytest.raises(CorpusError, match="tokens: digest mismatch"):
        build_corpus(tmp_path / "corpus", config, progress=False)
    # The corpus records its token chunks (count, bytes, CRC-32, issue 53): a plain open refuses the
    # rewritten chunk, at open when its size changed, else at its first read.
    with pytest.raises(StoreError, match="truncated or rewritten chunks|has CRC-32"):
        TokenStore(first.folder).tokens.read(0, 16)
    # --force rebuilds to the identical corpus.
    forced = build_corpus(tmp_path / "corpus", config, force=True, progress=False)
    assert forced.built and forced.manifest["arrays"] == first.manifest["arrays"]
    assert forced.manifest["store_digest"] == first.manifest["store_digest"]
    verify_corpus(first.folder)
    # A missing or edited origins file is reported too.
    (first.folder / "origins.txt").write_text("edited\n")
    with pytest.raises(CorpusError, match="origins.txt sha256 mismatch"):
        verify_corpus(first.folder)
    os.remove(first.folder / "origins.txt")
    with pytest.raises(CorpusError, match="origins.txt missing"):
        verify_corpus(first.folder)


def test_open_refuses_bad_folders(tmp_path):
    corpus = build_tiny_corpus(tmp_path)
    with pytest.raises(CorpusError, match="no token store"):
        verify_corpus(tmp_path / "nowhere")
    old = tmp_path / "old"  # a corpus of the numpy format (v2): rebuild it
    old.mkdir()
    (old / MANIFEST_NAME).write_text(json.dumps({"format": "smelt-corpus/1"}))
    with pytest.raises(CorpusError, match="smelt data build"):
        build_corpus(old, tiny_config(write_fake_tree(tmp_path / "src2")), progress=False)
    manifest = json.loads((Path(corpus.root) / MANIFEST_NAME).read_text())
    manifest["arrays"]["tokens"]["shape"] = [manifest["arrays"]["tokens"]["shape"][0] + 1]
    (Path(corpus.root) / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="do not match the manifest"):
        open_dataset(corpus.root)
    with pytest.raises(ValueError):
        BuildConfig(sources=TINY_SOURCES, roots=Roots.of(), val_fraction=0)


def test_source_without_text_is_an_error(tmp_path):
    empty = Roots.of(stdlib=tmp_path)
    with pytest.raises(CorpusError, match="no readable text"):
        build_corpus(tmp_path / "c", tiny_config(empty), progress=False)


def _default_roots() -> Roots:
    from smelt_jax.data.corpus import default_data_dir
    from smelt_jax.data.inputs import fetch_inputs
    return Roots.of(fetch_inputs(default_data_dir()))


def test_default_sources_read_the_pinned_archives(tmp_path):
    """The default recipe at 1/40 of its caps: every source reads real text from the pinned archives."""
    small = tuple(dataclasses.replace(s, max_bytes=s.max_bytes // 40) for s in DEFAULT_SOURCES)
    corpus = open_dataset(build_corpus(tmp_path / "small", BuildConfig(sources=small), progress=False).folder)
    assert sorted(s.name for s in DEFAULT_SOURCES) == sorted(corpus.sources)
    for spec in small:
        meta = _sources(corpus)[spec.name]
        used = sum(p["bytes"] for p in meta["provenance"])
        assert spec.max_bytes <= used <= spec.max_bytes + (1 << 20), spec.name
        assert meta["splits"]["train"]["documents"] > 0 and meta["splits"]["val"]["documents"] > 0
    assert [a["sha256"] for a in corpus.manifest["inputs"]] == [a.sha256 for a in PINNED_ARCHIVES]
    python = corpus.tokenizer.decode(corpus.split("python", "train").tokens[:200_000])
    assert "def " in python and "import " in python
    c_code = corpus.tokenizer.decode(corpus.split("c", "train").tokens[:200_000])
    assert "#define" in c_code or "#include" in c_code


_LIST_SCRIPT = """
import hashlib, json, sys
from smelt_jax.data.corpus import default_data_dir
from smelt_jax.data.inputs import fetch_inputs
from smelt_jax.data.sources import DEFAULT_SOURCES, Roots, candidate_files
roots = Roots.of(fetch_inputs(default_data_dir()))
listing = {spec.name: candidate_files(spec, roots) for spec in DEFAULT_SOURCES}
print(json.dumps({"digest": hashlib.sha256(json.dumps(listing).encode()).hexdigest(),
                  "files": sum(map(len, listing.values())), "path": len(sys.path)}))
"""


def test_recipe_file_list_is_the_same_in_another_environment(tmp_path):
    """The recipe's file list depends on the pinned archives only, not on what else is installed: a
    second interpreter with an extra site folder (a fake `libtpu` and other packages, as the TPU extra
    adds) and another working directory lists the same files."""
    import os
    import subprocess
    import sys

    extra = tmp_path / "extra_site"
    for package in ("libtpu", "torch", "django", "numpy"):
        (extra / package).mkdir(parents=True)
        (extra / package / "__init__.py").write_text('"""An installed package the corpus must not read."""\n' * 20)
        (extra / package / "data.json").write_text('{"key": "value"}\n' * 50)
    runs = []
    for env_extra, cwd in (({}, Path.cwd()), ({"PYTHONPATH": str(extra)}, tmp_path)):
        env = {**os.environ, **env_extra}
        out = subprocess.run([sys.executable, "-c", _LIST_SCRIPT], env=env, cwd=cwd, check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert runs[0]["path"] != runs[1]["path"]  # the two interpreters do see different packages
    assert runs[0]["files"] > 1000
    assert runs[0]["digest"] == runs[1]["digest"]


def test_default_recipe_is_the_committed_one():
    """Changing the default recipe without recording its digest (`record_expected`) fails here."""
    expected = json.loads(EXPECTED_FILE.read_text())
    assert BuildConfig().recipe_digest() == expected["recipe_digest"]
    assert expected["corpus_version"] == CORPUS_VERSION
    assert set(expected["sources"]) == {s.name for s in DEFAULT_SOURCES}


def test_digest_mismatch_names_the_source_and_files(tmp_path):
    roots = write_fake_tree(tmp_path / "src")
    first = build_corpus(tmp_path / "a", tiny_config(roots), progress=False)
    expected_path = tmp_path / "expected.json"
    expected_path.write_text(json.dumps(expected_record(first.manifest)))
    check_expected(first.manifest, expected_path)  # the same corpus passes
    (Path(roots.get("stdlib")) / "pkg" / "mod03.py").write_text("def changed():\n    return 'another'\n" * 8)
    second = build_corpus(tmp_path / "b", tiny_config(roots), progress=False)
    with pytest.raises(DigestMismatch) as err:
        check_expected(second.manifest, expected_path)
    message = str(err.value)
    assert "source code:" in message and "stdlib:pkg/mod03.py" in message and "changed 1" in message
    assert "source words" not in message and "--accept-digest" in message


def test_build_refuses_a_corpus_other_than_the_committed_one(tmp_path, monkeypatch):
    """build_corpus stops (and leaves nothing) on a mismatch, and keeps the corpus with accept_digest."""
    roots = write_fake_tree(tmp_path / "src")
    config = tiny_config(roots)
    good = build_corpus(tmp_path / "good", config, progress=False)
    record = expected_record(good.manifest)
    record["store_digest"] = "0" * 64
    record["sources"]["tables"]["digest"] = "0" * 64
    expected_path = tmp_path / "expected.json"
    expected_path.write_text(json.dumps(record))
    monkeypatch.setattr(corpus_module, "EXPECTED_FILE", expected_path)
    with pytest.raises(DigestMismatch, match="source tables"):
        build_corpus(tmp_path / "bad", config, progress=False)
    assert not (tmp_path / "bad").exists()
    kept = build_corpus(tmp_path / "bad", config, progress=False, accept_digest=True)
    assert "not the committed one" in kept.manifest["digest_accepted"]


@pytest.mark.slow
def test_default_corpus_builds_to_the_committed_digest(tmp_path):
    """The real default corpus from the pinned archives equals the committed digest (5-10 s on 2 cores)."""
    started = time.time()
    result = build_corpus(tmp_path / "default", BuildConfig(), progress=False)
    seconds = time.time() - started
    corpus = open_dataset(result.folder, verify=True)
    assert corpus.digest == json.loads(EXPECTED_FILE.read_text())["store_digest"]
    kinds = {meta["kind"] for meta in _sources(corpus).values()}
    assert {"code:python", "code:c", "prose:english", "structured"} <= kinds
    for spec in DEFAULT_SOURCES:
        meta = _sources(corpus)[spec.name]
        assert meta["splits"]["train"]["tokens"] > 500_000, spec.name
        assert meta["splits"]["val"]["tokens"] > 10_000, spec.name
        # A source stops within one file (<= 1 MiB) past its cap.
        assert meta["text_bytes"] <= spec.max_bytes + (1 << 20)
    total_mb = sum(p.stat().st_size for p in result.folder.rglob("*") if p.is_file()) / 1e6
    assert total_mb < 80
    assert seconds < 90


def test_cli_info_and_errors(tmp_path, capsys):
    from smelt_jax.cli import main

    corpus = build_tiny_corpus(tmp_path)
    assert main(["data", "info", "--corpus-dir", corpus.root, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer bytes" in out and "digests verified" in out
    for source in corpus.sources:
        assert f"| {source} |" in out
    assert main(["data", "store-info", corpus.root]) == 0  # the embedded corpus is a token store
    assert "the embedded corpus" in capsys.readouterr().out
    assert main(["data", "info", "--corpus-dir", str(tmp_path / "none")]) == 2
    assert "no token store" in capsys.readouterr().err


def test_inputs_from_a_mirror_and_a_missing_archive_is_one_line(tmp_path, monkeypatch, capsys):
    """SMELT_CORPUS_MIRROR serves the archives from a folder; a file it lacks is one line, exit 2; a file
    with other bytes than the pinned ones is refused and moved aside."""
    from smelt_jax.cli import main
    from smelt_jax.data import inputs

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    monkeypatch.setenv("SMELT_CORPUS_MIRROR", str(mirror))
    monkeypatch.setenv("SMELT_DATA_DIR", str(tmp_path / "data"))
    assert main(["data", "build", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and PINNED_ARCHIVES[0].filename in err and "SMELT_CORPUS_MIRROR" in err
    (mirror / PINNED_ARCHIVES[0].filename).write_bytes(b"not the archive")
    with pytest.raises(inputs.InputError, match="is not the pinned"):
        inputs.fetch_inputs(tmp_path / "data", PINNED_ARCHIVES[:1])
    assert (tmp_path / "data" / "archives" / (PINNED_ARCHIVES[0].filename + ".bad")).exists()


def test_parallel_first_builds_of_the_default_corpus_do_not_race(tmp_path, monkeypatch):
    """Two trainers of a local sweep that open the default corpus at once on a fresh machine: the build
    is serialised (once it raised 'Directory not empty' when both extracted the same archive)."""
    import threading

    import smelt_jax.data.corpus as corpus_mod

    monkeypatch.setenv("SMELT_DATA_DIR", str(tmp_path / "cache"))
    inside, overlap = [], []

    def fake_build(progress=False):
        inside.append(1)
        if len(inside) > 1:
            overlap.append(1)
        import time
        time.sleep(0.2)
        inside.pop()
        return corpus_mod.BuildResult(tmp_path / "corpus", {}, built=False)

    monkeypatch.setattr(corpus_mod, "build_corpus", fake_build)
    threads = [threading.Thread(target=corpus_mod._build_default, args=(False,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlap and (tmp_path / "cache" / ".build.lock").exists()

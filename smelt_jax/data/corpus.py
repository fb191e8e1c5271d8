"""The embedded default corpus: build it offline from pinned archives, store it as a token store, verify it.

The corpus is a token store (smelt_jax/data/token_store.py: zarr3 arrays written with tensorstore, read
by `TokenStore`, the one reader of training data) with the byte-level tokenizer, in one folder (default
`$SMELT_DATA_DIR/<version>` or `<repo>/data_cache/<version>`). Besides the store's arrays and manifest it
holds `origins.txt`: one line per document, in token-array order, "root:relative/path#text.chunk".
The manifest adds to the store's fields the recipe (`recipe_digest`, `corpus_version`), the pinned inputs,
per source its kind, provenance, input files (sha256 each) and a content `digest`, and the build's facts.

Documents are stored source by source (in recipe order), each source's documents in the order they were
read. A document goes to validation when the first 8 bytes of the sha256 of its text, read as a fraction
of 2**64, fall below `val_fraction` (every source keeps at least one document on each side when it has
two or more), so the split depends only on content, never on order or machine: the rule `smelt data
prepare` applies too. Exact duplicate documents (same bytes) are kept once, in the first source that
reads them.

`build_corpus` is idempotent: when the folder holds a corpus of the same recipe whose digests verify, it
does nothing. It writes into a temporary folder and renames it into place, so a crash leaves no half corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from smelt_jax.data import store_arrays
from smelt_jax.data import token_store as tsd
from smelt_jax.data.hf_tokenizer import BytesTokenizer
from smelt_jax.data.inputs import PINNED_ARCHIVES, Archive, archive_table, fetch_inputs
from smelt_jax.data.sources import DEFAULT_SOURCES, Roots, SourceSpec, collect_source
from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER, ByteTokenizer
from smelt_jax.platform.errors import SmeltError, UsageError
from smelt_jax.platform.paths import checkout_root

CORPUS_VERSION = "smelt-default-v3"  # v3: a token store (v2: numpy files)
# The digest the default recipe must produce (with the per-file hashes that explain a mismatch).
EXPECTED_FILE = Path(__file__).resolve().parent / "corpus_expected.json"
MANIFEST_NAME = tsd.MANIFEST_NAME
ORIGINS_NAME = "origins.txt"


class CorpusError(SmeltError, RuntimeError):
    """A corpus folder that is missing, stale, or fails its checksums."""


class DigestMismatch(CorpusError):
    """The default recipe built a corpus other than the committed one (`expected_digest`)."""


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Everything that decides a corpus's bytes (its hash is the manifest's `recipe_digest`)."""

    sources: tuple[SourceSpec, ...] = DEFAULT_SOURCES
    # None: the pinned archives `inputs`, fetched into the data cache. Set: these folders (tests, experiments).
    roots: Roots | None = None
    inputs: tuple[Archive, ...] = PINNED_ARCHIVES
    val_fraction: float = 0.05
    max_document_bytes: int = 32_768
    corpus_version: str = CORPUS_VERSION
    tokenizer: ByteTokenizer = DEFAULT_TOKENIZER

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"val_fraction must lie in (0, 1), got {self.val_fraction}")
        names = [s.name for s in self.sources]
        if not names or len(set(names)) != len(names):
            raise UsageError(f"source names must be non-empty and distinct, got {names}")
        for name in names:
            if not name.isidentifier():
                raise UsageError(f"source name {name!r} must be an identifier (it names files and columns)")
        if self.max_document_bytes < 64:
            raise UsageError(f"max_document_bytes must be >= 64, got {self.max_document_bytes}")

    def to_dict(self) -> dict:
        origin = ({"inputs": [a.to_dict() for a in self.inputs]} if self.roots is None
                  else {"roots": list(self.roots.names())})
        return {"sources": [s.to_dict() for s in self.sources], **origin,
                "val_fraction": self.val_fraction, "max_document_bytes": self.max_document_bytes,
                "corpus_version": self.corpus_version, "tokenizer": self.tokenizer.to_dict()}

    def recipe_digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_data_dir() -> Path:
    """$SMELT_DATA_DIR if set, else `data_cache/` at the repository root (git-ignored)."""
    from smelt_jax.platform import env as environment  # the one door for outside values
    env = environment.data_dir()
    return Path(env) if env else checkout_root() / "data_cache"


def default_corpus_dir() -> Path:
    return default_data_dir() / CORPUS_VERSION


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _source_digest(tokens: np.ndarray, lengths: np.ndarray, mine: np.ndarray) -> str:
    """Content digest of one source: its documents' tokens and lengths, per split (`mine`: bool [D, 2])."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    parts = []
    for column in range(2):
        ids = np.flatnonzero(mine[:, column])
        body = (np.concatenate([tokens[offsets[i]:offsets[i + 1]] for i in ids]) if ids.size
                else tokens[:0])
        parts += [store_arrays.array_digest(body), store_arrays.array_digest(lengths[ids])]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _sources_by_name(manifest: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in manifest["sources"]}


def read_manifest(folder: Path | str) -> dict:
    """The manifest of the corpus at `folder` (a token store built by `build_corpus`), else CorpusError."""
    try:
        manifest = tsd.read_manifest(folder)
    except tsd.StoreError as err:
        raise CorpusError(f"{err}. The embedded corpus is built with `smelt data build` (--force replaces "
                          "a corpus of an older format)") from err
    if "recipe_digest" not in manifest:
        raise CorpusError(f"{folder} holds a prepared token store, not the embedded corpus")
    return manifest


def verify_corpus(folder: Path | str) -> dict:
    """Recompute every array digest and the origins' sha256 against the manifest; return the manifest or
    raise CorpusError."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    try:
        tsd.verify_store(folder)
    except tsd.StoreError as err:
        raise CorpusError(str(err)) from err
    origins = folder / ORIGINS_NAME
    if not origins.is_file() or sha256_file(origins) != manifest["origins_sha256"]:
        raise CorpusError(f"corpus at {folder} fails verification: {ORIGINS_NAME} "
                          + ("missing" if not origins.is_file() else "sha256 mismatch"))
    return manifest


@dataclasses.dataclass(frozen=True)
class BuildResult:
    folder: Path
    manifest: dict
    built: bool  # False when an existing, verified corpus of the same recipe was kept


def expected_record(manifest: dict) -> dict:
    """What `EXPECTED_FILE` holds: the digests and, per source, the hash of every input file it used."""
    return {"corpus_version": manifest["corpus_version"], "recipe_digest": manifest["recipe_digest"],
            "store_digest": manifest["store_digest"],
            "sources": {name: {"digest": meta["digest"], "files": meta["files"]}
                        for name, meta in sorted(_sources_by_name(manifest).items())}}


def digest_difference(expected: dict, manifest: dict, limit: int = 8) -> list[str]:
    """One line per source whose files differ from the expected record: which files, and how."""
    got = expected_record(manifest)
    lines = []
    for name in sorted(set(expected["sources"]) | set(got["sources"])):
        want, have = expected["sources"].get(name), got["sources"].get(name)
        if want is None or have is None:
            lines.append(f"source {name}: {'not expected' if want is None else 'missing'}")
            continue
        if want["digest"] == have["digest"]:
            continue
        missing = sorted(set(want["files"]) - set(have["files"]))
        extra = sorted(set(have["files"]) - set(want["files"]))
        changed = sorted(f for f in set(want["files"]) & set(have["files"])
                         if want["files"][f] != have["files"][f])
        parts = [f"{label} {len(items)} ({', '.join(items[:limit])}{', ...' if len(items) > limit else ''})"
                 for label, items in (("missing", missing), ("extra", extra), ("changed", changed)) if items]
        lines.append(f"source {name}: " + ("; ".join(parts) or "same files, different tokens (code change?)"))
    return lines


def check_expected(manifest: dict, expected_path: Path | None = None) -> None:
    """Raise DigestMismatch when `manifest` is of the committed recipe but not the committed corpus."""
    expected_path = expected_path or EXPECTED_FILE
    if not expected_path.is_file():
        return
    expected = json.loads(expected_path.read_text())
    if expected["recipe_digest"] != manifest["recipe_digest"]:
        return  # another recipe (a test's, an experiment's): nothing committed to compare with
    if expected["store_digest"] == manifest["store_digest"]:
        return
    detail = "\n  ".join(digest_difference(expected, manifest))
    raise DigestMismatch(
        f"the corpus built here (digest {manifest['store_digest'][:16]}) is not the committed one "
        f"({expected['store_digest'][:16]}, {expected_path.name}):\n  {detail}\n"
        "Runs trained on it are not comparable with the committed results. Pass --accept-digest to "
        "use it anyway.")


def record_expected(folder: Path | str, expected_path: Path | None = None) -> dict:
    """Commit a verified default corpus's digests as the expected ones (after a deliberate recipe change)."""
    manifest = verify_corpus(folder)
    record = expected_record(manifest)
    (expected_path or EXPECTED_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _resolve_roots(config: BuildConfig, progress: bool) -> Roots:
    if config.roots is not None:
        return config.roots
    log = (lambda msg: print(f"smelt data build: {msg}", file=sys.stderr, flush=True)) if progress else None
    return Roots.of(fetch_inputs(default_data_dir(), config.inputs, log=log))


def _write_store(folder: Path, config: BuildConfig, documents: list[tuple[str, str, bytes, bytes]],
                 sources_meta: dict[str, dict]) -> dict:
    """Write `documents` ((source, origin, text, split key) in store order) as a token store into
    `folder`; returns the manifest's store fields (arrays, sources, totals, tokenizer, split rule)."""
    tokenizer = BytesTokenizer(config.tokenizer)
    names = sorted(sources_meta)
    codes = np.array([names.index(d[0]) for d in documents], dtype=np.int32)
    keys = np.array([int.from_bytes(d[3][:8], "big") for d in documents], dtype=np.uint64)
    val = tsd.split_assignment(keys, codes, len(names), config.val_fraction)
    lengths = np.array([len(d[2]) + 2 for d in documents], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=tokenizer.token_dtype)
    start = 0
    for (_, _, text, _), length in zip(documents, lengths):
        tokens[start:start + length] = tokenizer.encode_document(text)
        start += length
    store = store_arrays.create_array(folder, "tokens", tokens.dtype, [tokens.size], layout="chunks")
    store.write(tokens).result()
    arrays = {"tokens": {"dtype": tokens.dtype.str, "shape": [int(tokens.size)],
                         "sha256": store_arrays.array_digest(tokens), "chunks": tsd.chunk_record(folder)}}
    duplicates = {k: sources_meta[name].pop("duplicates_dropped") for k, name in enumerate(names)}
    index, sources = tsd.write_index(folder, lengths, codes, val, names, duplicates)
    for k, entry in enumerate(sources):
        mine = np.stack([(codes == k) & ~val, (codes == k) & val], axis=1)
        entry.update(sources_meta[entry["name"]], digest=_source_digest(tokens, lengths, mine))
    return {"format": tsd.STORE_FORMAT, "tokenizer": tokenizer.to_dict(),
            "split_rule": {"val_fraction": config.val_fraction, "key": tsd.SPLIT_RULE_KEY,
                           "dedup": True, "unit": "text (its chunks share a key)"},
            "arrays": {**arrays, **index}, "sources": sources,
            "totals": {"documents": int(lengths.size), "tokens": int(tokens.size),
                       **tsd.split_totals(sources),
                       "duplicates_dropped": int(sum(duplicates.values()))}}


def build_corpus(folder: Path | str | None = None, config: BuildConfig | None = None, *,
                 force: bool = False, progress: bool = True, accept_digest: bool = False) -> BuildResult:
    """Build the corpus into `folder` (default `default_corpus_dir()`), or verify and keep one already there.

    An existing corpus with another recipe, or one that fails its digests, is an error unless `force`.
    The default recipe's result must equal the committed digest (`EXPECTED_FILE`), unless `accept_digest`.
    """
    config = config or BuildConfig()
    folder = Path(folder) if folder is not None else default_corpus_dir()
    recipe = config.recipe_digest()
    if (folder / MANIFEST_NAME).exists() and not force:
        manifest = verify_corpus(folder)
        if manifest.get("recipe_digest") != recipe:
            raise CorpusError(f"{folder} holds a corpus of another recipe ({manifest.get('recipe_digest')}, "
                              f"wanted {recipe}); pass force=True (--force) to rebuild it")
        return BuildResult(folder, manifest, built=False)
    if folder.exists() and any(folder.iterdir()) and not (folder / MANIFEST_NAME).exists() and not force:
        raise CorpusError(f"{folder} exists, is not empty and holds no corpus; pass --force or choose "
                          "another folder")

    from tqdm.auto import tqdm  # only the build needs it

    started = time.time()
    roots = _resolve_roots(config, progress)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building-", dir=folder.parent))
    try:
        sources_meta, documents, seen = {}, [], set()
        total = sum(spec.max_bytes for spec in config.sources)
        with tqdm(total=total, unit="B", unit_scale=True, desc="smelt data build",
                  disable=not progress, file=sys.stderr) as bar:
            for spec in config.sources:
                bar.set_postfix_str(spec.name)
                collected = collect_source(spec, roots, config.max_document_bytes,
                                           progress=bar.update)
                bar.update(max(0, spec.max_bytes - collected.total_bytes))  # source done
                duplicates, kept = 0, 0
                for origin, text, key in collected.documents:
                    digest = hashlib.sha256(text).digest()
                    if digest in seen:
                        duplicates += 1
                        continue
                    seen.add(digest)
                    documents.append((spec.name, origin, text, key))
                    kept += 1
                if not kept:
                    raise CorpusError(f"source {spec.name!r} found no readable text under "
                                      f"{[p['path'] for p in collected.provenance]}")
                sources_meta[spec.name] = {"kind": spec.kind, "description": spec.description,
                                           "max_bytes": spec.max_bytes, "provenance": collected.provenance,
                                           "duplicates_dropped": duplicates,
                                           "text_bytes": sum(len(d[2]) for d in documents[-kept:]),
                                           "files": collected.files}
        manifest = _write_store(staging, config, documents, sources_meta)
        (staging / ORIGINS_NAME).write_text("".join(d[1] + "\n" for d in documents), encoding="utf-8")
        manifest.update({
            "corpus_version": config.corpus_version, "recipe_digest": recipe,
            "origins_sha256": sha256_file(staging / ORIGINS_NAME),
            "inputs": archive_table(config.inputs) if config.roots is None else dict(roots.paths),
            "build": {"val_fraction": config.val_fraction, "max_document_bytes": config.max_document_bytes,
                      "python": sys.version.split()[0], "numpy": np.__version__,
                      "seconds": round(time.time() - started, 2),
                      "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
        manifest["store_digest"] = tsd.store_digest(manifest)
        try:
            check_expected(manifest)
        except DigestMismatch as err:
            if not accept_digest:
                raise
            manifest["digest_accepted"] = str(err)
        tsd.commit_manifest(staging, manifest)
        os.chmod(staging, 0o755)
        if folder.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.replace(folder, trash / folder.name)
            os.replace(staging, folder)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return BuildResult(folder, manifest, built=True)


def open_dataset(path=None, *, progress: bool = False, **kwargs) -> tsd.TokenStore:
    """The token store at `path` (a prepared store, local or gs://, or an embedded corpus folder); with
    no path, the embedded default corpus (fetched and built on first use, verified after). The one way
    the trainer, evaluation and the analyses find their data."""
    if path is None:
        path = _build_default(progress)
    return tsd.TokenStore(path, **kwargs)


def _build_default(progress: bool) -> Path:
    """The embedded default corpus, fetched and built by one process at a time: the trainers of a local
    sweep all start on a fresh machine together and would otherwise race on the same archives."""
    import fcntl

    root = default_data_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return build_corpus(progress=progress).folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

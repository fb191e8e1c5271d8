"""The embedded default corpus: build it offline from text on the machine, store it tokenized, verify it.

On disk (one folder per corpus, default `$SMELT_DATA_DIR/<version>` or `<repo>/data_cache/<version>`):

    manifest.json                        provenance, counts, tokenizer, sha256 of every file below
    <source>.<split>.tokens.npy          uint16 [tokens]: documents back to back, each BOS + bytes + EOS
    <source>.<split>.offsets.npy         int64 [documents + 1]: document d is tokens[off[d]:off[d+1]]
    <source>.<split>.origins.txt         one line per document: "root:relative/path#text.chunk"

`split` is `train` or `val`. A document goes to validation when the first 8 bytes of the sha256 of its
text, read as a fraction of 2**64, fall below `val_fraction` (every source keeps at least one document on
each side when it has two or more), so the split depends only on content, never on order or machine.
Exact duplicate documents (same bytes) are kept once, in the first source that reads them.

`build_corpus` is idempotent: when the folder holds a corpus of the same recipe whose checksums verify, it
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

from smelt_jax.data.inputs import PINNED_ARCHIVES, Archive, archive_table, fetch_inputs
from smelt_jax.data.sources import DEFAULT_SOURCES, Roots, SourceSpec, collect_source
from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER, ByteTokenizer
from smelt_jax.errors import SmeltError, UnknownName, UsageError
from smelt_jax.paths import checkout_root

CORPUS_VERSION = "smelt-default-v2"
# The digest the default recipe must produce (with the per-file hashes that explain a mismatch).
EXPECTED_FILE = Path(__file__).resolve().parent / "corpus_expected.json"
MANIFEST_FORMAT = "smelt-corpus/1"
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")


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
    env = os.environ.get("SMELT_DATA_DIR")
    return Path(env) if env else checkout_root() / "data_cache"


def default_corpus_dir() -> Path:
    return default_data_dir() / CORPUS_VERSION


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _split_fraction(key: bytes) -> float:
    return int.from_bytes(key[:8], "big") / 2.0**64


def _assign_splits(documents: list[tuple[str, bytes, bytes]], val_fraction: float) -> list[str]:
    """'train' or 'val' per document, by its split key; both sides non-empty when >= 2 keys exist."""
    keys = sorted({key for _, _, key in documents})
    val_keys = {k for k in keys if _split_fraction(k) < val_fraction}
    if len(keys) >= 2 and not val_keys:
        val_keys = {keys[0]}  # smallest hash: still a pure function of content
    if len(keys) >= 2 and len(val_keys) == len(keys):
        val_keys.discard(keys[-1])
    return ["val" if key in val_keys else "train" for _, _, key in documents]


def _write_split(folder: Path, source: str, split: str, texts: list[bytes], origins: list[str],
                 tokenizer: ByteTokenizer) -> dict:
    lengths = np.array([len(t) + 2 for t in texts], dtype=np.int64)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.uint16)
    for text, start in zip(texts, offsets[:-1]):
        tokens[start:start + len(text) + 2] = tokenizer.encode_document(text)
    names = {"tokens": f"{source}.{split}.tokens.npy", "offsets": f"{source}.{split}.offsets.npy",
             "origins": f"{source}.{split}.origins.txt"}
    np.save(folder / names["tokens"], tokens)
    np.save(folder / names["offsets"], offsets)
    (folder / names["origins"]).write_text("".join(o + "\n" for o in origins), encoding="utf-8")
    return {"documents": len(texts), "tokens": int(tokens.size), "text_bytes": int(sum(map(len, texts))),
            "files": names}


def _all_files(manifest: dict) -> list[str]:
    return sorted(name for source in manifest["sources"].values()
                  for split in source["splits"].values() for name in split["files"].values())


def _corpus_digest(checksums: dict[str, str]) -> str:
    text = "\n".join(f"{name} {checksums[name]}" for name in sorted(checksums))
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(folder: Path | str) -> dict:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise CorpusError(f"no corpus at {folder} (missing {MANIFEST_NAME}); run `smelt data build`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path} is not valid JSON: {err}") from err
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CorpusError(f"{path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


def verify_corpus(folder: Path | str) -> dict:
    """Recompute every file's sha256 against the manifest; return the manifest or raise CorpusError."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    problems = []
    for name in _all_files(manifest):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(path) != manifest["checksums"].get(name):
            problems.append(f"{name}: sha256 mismatch")
    if problems:
        raise CorpusError(f"corpus at {folder} fails verification: " + "; ".join(problems))
    return manifest


@dataclasses.dataclass(frozen=True)
class BuildResult:
    folder: Path
    manifest: dict
    built: bool  # False when an existing, verified corpus of the same recipe was kept


def _source_digest(checksums: dict[str, str], source: str) -> str:
    return _corpus_digest({k: v for k, v in checksums.items() if k.startswith(f"{source}.")})


def expected_record(manifest: dict) -> dict:
    """What `EXPECTED_FILE` holds: the digests and, per source, the hash of every file it used."""
    return {"corpus_version": manifest["corpus_version"], "recipe_digest": manifest["recipe_digest"],
            "corpus_digest": manifest["corpus_digest"],
            "sources": {name: {"digest": _source_digest(manifest["checksums"], name),
                               "files": meta["files"]}
                        for name, meta in sorted(manifest["sources"].items())}}


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
    if expected["corpus_digest"] == manifest["corpus_digest"]:
        return
    detail = "\n  ".join(digest_difference(expected, manifest))
    raise DigestMismatch(
        f"the corpus built here (digest {manifest['corpus_digest'][:16]}) is not the committed one "
        f"({expected['corpus_digest'][:16]}, {expected_path.name}):\n  {detail}\n"
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


def build_corpus(folder: Path | str | None = None, config: BuildConfig | None = None, *,
                 force: bool = False, progress: bool = True, accept_digest: bool = False) -> BuildResult:
    """Build the corpus into `folder` (default `default_corpus_dir()`), or verify and keep one already there.

    An existing corpus with another recipe, or one that fails its checksums, is an error unless `force`.
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
        sources_meta, seen = {}, set()
        total = sum(spec.max_bytes for spec in config.sources)
        with tqdm(total=total, unit="B", unit_scale=True, desc="smelt data build",
                  disable=not progress, file=sys.stderr) as bar:
            for spec in config.sources:
                bar.set_postfix_str(spec.name)
                collected = collect_source(spec, roots, config.max_document_bytes,
                                           progress=bar.update)
                bar.update(max(0, spec.max_bytes - collected.total_bytes))  # source done
                unique, duplicates = [], 0
                for origin, text, key in collected.documents:
                    digest = hashlib.sha256(text).digest()
                    if digest in seen:
                        duplicates += 1
                        continue
                    seen.add(digest)
                    unique.append((origin, text, key))
                if not unique:
                    raise CorpusError(f"source {spec.name!r} found no readable text under "
                                      f"{[p['path'] for p in collected.provenance]}")
                assignment = _assign_splits(unique, config.val_fraction)
                splits = {}
                for split in SPLITS:
                    chosen = [(o, t) for (o, t, _), s in zip(unique, assignment) if s == split]
                    splits[split] = _write_split(staging, spec.name, split, [t for _, t in chosen],
                                                 [o for o, _ in chosen], config.tokenizer)
                sources_meta[spec.name] = {"kind": spec.kind, "description": spec.description,
                                           "max_bytes": spec.max_bytes, "provenance": collected.provenance,
                                           "duplicates_dropped": duplicates, "splits": splits,
                                           "files": collected.files}
        manifest = {"format": MANIFEST_FORMAT, "corpus_version": config.corpus_version,
                    "recipe_digest": recipe, "tokenizer": config.tokenizer.to_dict(),
                    "inputs": (archive_table(config.inputs) if config.roots is None
                               else dict(roots.paths)),
                    "build": {"val_fraction": config.val_fraction,
                              "max_document_bytes": config.max_document_bytes,
                              "python": sys.version.split()[0], "numpy": np.__version__,
                              "seconds": round(time.time() - started, 2),
                              "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                    "sources": sources_meta}
        checksums = {name: sha256_file(staging / name) for name in _all_files(manifest)}
        manifest["checksums"] = checksums
        manifest["corpus_digest"] = _corpus_digest(checksums)
        manifest["totals"] = {split: {"documents": sum(s["splits"][split]["documents"]
                                                       for s in sources_meta.values()),
                                      "tokens": sum(s["splits"][split]["tokens"]
                                                    for s in sources_meta.values())}
                              for split in SPLITS}
        try:
            check_expected(manifest)
        except DigestMismatch as err:
            if not accept_digest:
                raise
            manifest["digest_accepted"] = str(err)
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
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


@dataclasses.dataclass(frozen=True)
class SplitArrays:
    """One (source, split): the token memmap uint16 [tokens] and document offsets int64 [documents + 1]."""

    tokens: np.ndarray
    offsets: np.ndarray

    @property
    def num_documents(self) -> int:
        return int(self.offsets.size - 1)

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]


class Corpus:
    """A built corpus opened read-only: memory-mapped token shards and the manifest.

    Opening checks the format, the tokenizer version and the file sizes (cheap); `verify=True` also
    recomputes every sha256.
    """

    def __init__(self, folder: Path | str, *, verify: bool = False,
                 tokenizer: ByteTokenizer = DEFAULT_TOKENIZER) -> None:
        self.folder = Path(folder)
        self.manifest = verify_corpus(self.folder) if verify else read_manifest(self.folder)
        if self.manifest["tokenizer"] != tokenizer.to_dict():
            raise CorpusError(f"corpus at {folder} was built with tokenizer {self.manifest['tokenizer']}, "
                              f"this code uses {tokenizer.to_dict()}; rebuild it (smelt data build --force)")
        self.tokenizer = tokenizer
        self._arrays: dict[tuple[str, str], SplitArrays] = {}
        for source, meta in self.manifest["sources"].items():
            for split in SPLITS:
                files = meta["splits"][split]["files"]
                try:
                    tokens = np.load(self.folder / files["tokens"], mmap_mode="r")
                    offsets = np.load(self.folder / files["offsets"], mmap_mode="r")
                except (OSError, ValueError) as err:
                    raise CorpusError(f"cannot read {source}.{split} in {folder}: {err}") from err
                if (tokens.dtype != np.uint16 or offsets.dtype != np.int64
                        or tokens.size != meta["splits"][split]["tokens"]
                        or offsets.size != meta["splits"][split]["documents"] + 1
                        or (offsets.size and int(offsets[-1]) != tokens.size)):
                    raise CorpusError(f"{source}.{split} in {folder} does not match its manifest entry")
                self._arrays[(source, split)] = SplitArrays(tokens, offsets)

    @property
    def sources(self) -> tuple[str, ...]:
        """Source names, sorted."""
        return tuple(sorted(self.manifest["sources"]))

    @property
    def digest(self) -> str:
        return self.manifest["corpus_digest"]

    def split(self, source: str, split: str) -> SplitArrays:
        if (source, split) not in self._arrays:
            raise UnknownName(f"no split {source}.{split}; sources are {list(self.sources)}, splits {SPLITS}")
        return self._arrays[(source, split)]

    def num_tokens(self, split: str) -> int:
        return sum(self.split(s, split).tokens.size for s in self.sources)

    def summary(self) -> list[dict]:
        """One row per source: kind, documents and tokens per split."""
        rows = []
        for source, meta in self.manifest["sources"].items():
            row = {"source": source, "kind": meta["kind"]}
            for split in SPLITS:
                row[f"{split}_documents"] = meta["splits"][split]["documents"]
                row[f"{split}_tokens"] = meta["splits"][split]["tokens"]
            rows.append(row)
        return rows

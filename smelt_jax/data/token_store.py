"""The token store: tokenized documents in zarr3 arrays written with tensorstore (local folder or gs://).

Layout under the store's root (written by `smelt_jax.data.prepare`):

    manifest.json                    counts, per-array digests, tokenizer, inputs, problems, store digest
    tokenizer.json                   the Hugging Face tokenizer (absent for the embedded byte tokenizer)
    arrays/tokens/                   uint16|uint32 [T]: documents back to back, each BOS + ids + EOS
                                     (zarr3, zstd chunks of 2**16 tokens; optionally inside shard
                                     objects of 2**22 tokens)
    arrays/doc_offsets/              int64 [D + 1]: document d is tokens[off[d]:off[d + 1]]
    arrays/doc_source/               int32 [D]: index into the manifest's `sources` list
    arrays/by_source/<k>/<split>/    int64 [n]: ids of source k's documents in `split` (train | val),
                                     ascending
    parts/<id>/part.json, part.npz   per-input-shard output of the tokenize phase (resumption)
    .staging/                        the store prepare is assembling (swapped in when complete)

Every array's digest is a tree hash (`array_digest`): the sha256 of every block of 2**22 elements in
little-endian bytes, hashed together with the dtype and shape. It depends on the values only, never on
compression, chunking on disk or the number of processes that wrote it. The `store_digest` hashes the
format, the tokenizer's sha256, the split rule, the source table and every array digest.

Two writers produce stores: `smelt data prepare` (smelt_jax/data/prepare.py: text shards, any
tokenizer, many processes) and `smelt data build` (smelt_jax/data/corpus.py: the embedded byte-level
corpus). Both write the index arrays and the manifest through `write_index` and `commit_manifest`.

`check_store` runs at every open: the manifest's digest, every token chunk present (one listing) and
their count and bytes as the writer recorded them; a chunk that is missing, does not decode, fails its
CRC-32 (checked as first read) or holds ids outside the vocabulary is a StoreError, never zeros
(`store_checks`). `TokenStore` opens a store read-only and is the one reader of
training data: `sources`, `tokenizer` (with `pad_id`), `digest`, and `split(source, split)` ->
`SplitArrays(tokens, offsets)` where `tokens` is a view that reads only the positions it is indexed
with (tensorstore reads of the covering ranges, batched), so each host reads only its own rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from smelt_jax.data import store_checks as checks
from smelt_jax.data.store_arrays import (  # the array files: store_arrays.py
    _read,
    _result,
    array_url,
    every_chunk_stored,
    open_array,
    read_array,
    verify_array,
    write_array,
)
from smelt_jax.data.store_checks import StoreError
from smelt_jax.platform import storage as gcs
from smelt_jax.platform.errors import UnknownName

STORE_FORMAT = "smelt-token-store/1"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
PARTS_DIR = "parts"
READ_GAP = 1 << 14  # index runs closer than this are read as one range
SPLITS = ("train", "val")


@dataclasses.dataclass(frozen=True)
class SplitArrays:
    """One (source, split): tokens [tokens] (a `SplitTokens` view, or any array) and document offsets
    int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]."""

    tokens: np.ndarray
    offsets: np.ndarray

    @property
    def num_documents(self) -> int:
        return int(self.offsets.size - 1)

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]


# Digests --------------------------------------------------------------------------------------------
def store_digest(manifest: dict) -> str:
    content = {"format": manifest["format"], "tokenizer": manifest["tokenizer"]["sha256"],
               "split": manifest["split_rule"],
               "sources": [[s["name"], s["splits"]] for s in manifest["sources"]],
               "arrays": {name: meta["sha256"] for name, meta in sorted(manifest["arrays"].items())}}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_index(root, lengths: np.ndarray, codes: np.ndarray, val: np.ndarray, names: list[str],
                duplicates: dict[int, int]) -> tuple[dict, list[dict]]:
    """The index arrays of a store whose documents (in token-array order) have `lengths` int64 [D],
    source `codes` int32 [D] (into the sorted `names`) and validation flags `val` bool [D].

    Writes doc_offsets, doc_source and by_source/<k>/<split>; returns (their manifest entries, the
    manifest's `sources` table)."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {"doc_offsets": write_array(root, "doc_offsets", offsets),
              "doc_source": write_array(root, "doc_source", codes.astype(np.int32))}
    sources = []
    for k, name in enumerate(names):
        entry = {"name": name, "index": k, "duplicates_dropped": int(duplicates.get(k, 0)), "splits": {}}
        for split, mask in (("train", ~val), ("val", val)):
            ids = np.flatnonzero((codes == k) & mask).astype(np.int64)
            arrays[f"by_source/{k:04d}/{split}"] = write_array(root, f"by_source/{k:04d}/{split}", ids)
            entry["splits"][split] = {"documents": int(ids.size), "tokens": int(lengths[ids].sum())}
        sources.append(entry)
    return arrays, sources


def split_assignment(keys: np.ndarray, codes: np.ndarray, n_sources: int, val_fraction: float) -> np.ndarray:
    """bool [D]: is document d in validation? `keys` uint64 [D] are the first 8 bytes (big-endian) of
    the sha256 of each document's text (chunks of one text share a key, so a text never straddles the
    split), `codes` int [D] their sources. A document goes to validation when key / 2**64 < val_fraction;
    a source with two or more distinct keys keeps both sides (its smallest key moves to validation, or
    its largest to training). The rule of every store: `smelt data prepare` and the embedded corpus."""
    val = keys.astype(np.float64) / 2.0**64 < val_fraction
    for k in range(n_sources):
        mine = np.flatnonzero(codes == k)
        own = keys[mine]
        if np.unique(own).size < 2:
            continue
        if not val[mine].any():
            val[mine[own == own.min()]] = True
        if val[mine].all():
            val[mine[own == own.max()]] = False
    return val


SPLIT_RULE_KEY = "sha256(text)[:8]/2**64"


def split_totals(sources: list[dict]) -> dict:
    return {split: {"documents": sum(s["splits"][split]["documents"] for s in sources),
                    "tokens": sum(s["splits"][split]["tokens"] for s in sources)} for split in SPLITS}


def commit_manifest(root, manifest: dict) -> dict:
    """Add the store digest and write manifest.json, last: the store is complete from this write on."""
    manifest["store_digest"] = store_digest(manifest)
    gcs.write_text(gcs.join(root, MANIFEST_NAME), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


# Manifest -------------------------------------------------------------------------------------------
def read_manifest(root) -> dict:
    url = gcs.join(root, MANIFEST_NAME)
    try:
        manifest = json.loads(gcs.read_text(url))
    except FileNotFoundError as err:
        raise StoreError(f"no token store at {root} (missing {MANIFEST_NAME}); run `smelt data prepare`") \
            from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StoreError(f"{url} is not valid JSON: {err}") from err
    if manifest.get("format") != STORE_FORMAT:
        raise StoreError(f"{url}: format {manifest.get('format')!r}, expected {STORE_FORMAT!r}")
    return manifest


def is_token_store(root) -> bool:
    try:
        return json.loads(gcs.read_text(gcs.join(root, MANIFEST_NAME))).get("format") == STORE_FORMAT
    except (OSError, ValueError):
        return False


def verify_store(root) -> dict:
    """Recompute every array digest and the store digest; return the manifest or raise StoreError."""
    manifest = read_manifest(root)
    problems = [p for name, entry in sorted(manifest["arrays"].items())
                if (p := verify_array(root, name, entry, every_chunk_stored(manifest, name)))]
    if store_digest(manifest) != manifest["store_digest"]:
        problems.append("store_digest does not match the manifest's content")
    if problems:
        raise StoreError(f"token store at {root} fails verification: " + "; ".join(problems))
    return manifest


# Cheap checks before training (every open) ----------------------------------------------------------
CHUNK_PREFIX = "c/"  # zarr3 default chunk key encoding of a 1-D array: c/<chunk index>
token_chunks = checks.token_chunks


def chunk_record(root, listed: dict | None = None, checksums: bool = True) -> dict:
    """What the writers record of the written token chunks (manifest arrays.tokens.chunks): their count,
    for a local store their total bytes, and each one's CRC-32 (`store_checks`; `listed`: a
    `token_chunks` result)."""
    sizes = list((listed or token_chunks(root))["objects"].values())
    record = {"objects": len(sizes), "bytes": None if None in sizes else int(sum(sizes))}
    if checksums:
        record[checks.CHECKSUM_KEY] = checks.chunk_checksums(array_url(root, "tokens"), len(sizes))
    return record


def _missing_text(missing: list[int]) -> str:
    shown = ", ".join(f"{CHUNK_PREFIX}{i}" for i in missing[:5])
    return shown + (f", ... ({len(missing) - 5} more)" if len(missing) > 5 else "")


def check_store(root, manifest: dict | None = None) -> dict:
    """The checks every open of a store makes before training reads it (StoreError if one fails):

    - the manifest's `store_digest` is the digest of its content (an edited manifest is refused);
    - every chunk object of the token array is present (one listing: a partial copy is refused);
    - the chunk count and, locally, their total bytes equal what prepare recorded (truncated or
      rewritten chunks are refused).

    Cost: one listing of the token chunks, no data read. A 10B-token store in the `chunks` layout
    (2**16 tokens per object) has 152,588 chunk objects: 153 list pages of 1000 on gs://, or one local
    directory scan with one stat per chunk (docs/data-prepare.md gives the measured time). The full
    re-hash stays in `verify_store` (`smelt data store-info --verify`). Returns the manifest."""
    manifest = manifest if manifest is not None else read_manifest(root)
    if store_digest(manifest) != manifest.get("store_digest"):
        raise StoreError(f"token store at {root}: the manifest's store_digest "
                         f"{str(manifest.get('store_digest'))[:16]} is not the digest of its content "
                         f"({store_digest(manifest)[:16]}): the manifest was edited or damaged; prepare "
                         "the store again")
    listed = token_chunks(root)
    missing = sorted(set(range(listed["grid"])) - set(listed["objects"]))
    if missing:
        raise StoreError(f"token store at {root}: {len(missing)} of {listed['grid']} token chunks are "
                         f"missing ({_missing_text(missing)} under {array_url(root, 'tokens')}): a partial "
                         "copy? copy or prepare the store again")
    recorded = manifest["arrays"]["tokens"].get("chunks")
    if recorded:
        found = chunk_record(root, listed, checksums=False)
        if found["objects"] != recorded["objects"]:
            raise StoreError(f"token store at {root}: {found['objects']} token chunk objects, the manifest "
                             f"records {recorded['objects']}; copy or prepare the store again")
        if None not in (found["bytes"], recorded.get("bytes")) and found["bytes"] != recorded["bytes"]:
            raise StoreError(f"token store at {root}: the token chunks hold {found['bytes']:,} bytes, the "
                             f"manifest records {recorded['bytes']:,}: truncated or rewritten chunks; copy "
                             "or prepare the store again")
    return manifest


def load_store_tokenizer(root, manifest: dict):
    from smelt_jax.data.hf_tokenizer import tokenizer_from_record

    record = manifest["tokenizer"]
    text = gcs.read_text(gcs.join(root, TOKENIZER_NAME)) if record.get("kind") != "bytes" else None
    tokenizer = tokenizer_from_record(record, text)
    if tokenizer.sha256 != record["sha256"]:
        raise StoreError(f"{gcs.join(root, TOKENIZER_NAME)} has sha256 {tokenizer.sha256}, the manifest "
                         f"records {record['sha256']}")
    return tokenizer


# Reading --------------------------------------------------------------------------------------------
class TokenArray:
    """The flat token array: `take(positions)` reads just the covering ranges (concurrently); a chunk
    that is missing, does not decode, fails its checksum or holds ids outside the vocabulary (`guard`,
    a `store_checks.ChunkGuard`) is a StoreError, never zeros."""

    def __init__(self, store, root="", guard: checks.ChunkGuard | None = None) -> None:
        self.store, self.root, self.guard = store, root, guard
        self.size = int(store.shape[0])
        self.dtype = np.dtype(store.dtype.numpy_dtype)

    def take(self, positions) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        flat = positions.reshape(-1)
        if flat.size == 0:
            return np.empty(positions.shape, dtype=self.dtype)
        if flat.min() < 0 or flat.max() >= self.size:
            raise IndexError(f"token positions outside 0..{self.size - 1}")
        unique = np.unique(flat)
        if self.guard:
            self.guard.verify(unique)
        cut = np.flatnonzero(np.diff(unique) > READ_GAP) + 1
        first = np.concatenate([[0], cut])
        last = np.concatenate([cut, [unique.size]])
        futures = [self.store[int(unique[a]):int(unique[b - 1]) + 1].read() for a, b in zip(first, last)]
        values = np.empty(unique.size, dtype=self.dtype)
        for (a, b), future in zip(zip(first, last), futures):
            chunk = _result(future, self.root, "tokens", f" {unique[a]}..{unique[b - 1]}")
            values[a:b] = chunk[unique[a:b] - unique[a]]
        if self.guard:
            self.guard.check_ids(values, unique)
        return values[np.searchsorted(unique, flat)].reshape(positions.shape)

    def read(self, start: int, stop: int) -> np.ndarray:
        if not self.guard:
            return _read(self.store[start:stop], self.root, "tokens", f" {start}..{stop - 1}")
        return self.take(np.arange(start, stop, dtype=np.int64))


class SplitTokens:
    """One (source, split)'s documents seen as one flat array (`SplitArrays.tokens` of a store).

    Position i of the view is token i of the concatenation of the split's documents; indexing with an
    int array or a slice reads only those tokens from the store.
    """

    def __init__(self, array: TokenArray, doc_starts: np.ndarray, offsets: np.ndarray) -> None:
        self.array, self.doc_starts, self.offsets = array, doc_starts, offsets
        self.size = int(offsets[-1])
        self.shape = (self.size,)
        self.dtype = array.dtype

    def __len__(self) -> int:
        return self.size

    def _global(self, local: np.ndarray) -> np.ndarray:
        if local.size and (local.min() < 0 or local.max() >= self.size):
            raise IndexError(f"positions outside 0..{self.size - 1}")
        doc = np.searchsorted(self.offsets, local, side="right") - 1
        return self.doc_starts[doc] + (local - self.offsets[doc])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(self.size), dtype=np.int64)
        elif isinstance(index, (int, np.integer)):
            index = np.int64(index + self.size if index < 0 else index)
            return self.array.take(self._global(np.array([index])))[0]
        local = np.asarray(index, dtype=np.int64)
        return self.array.take(self._global(local.reshape(-1))).reshape(local.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self[0:self.size]
        return values.astype(dtype) if dtype is not None else values


class TokenStore:
    """A prepared token store opened read-only (local folder or gs://).

    Every open runs `check_store` (the manifest's digest, every token chunk present, their recorded count
    and size: one listing, no data read); `expect_tokenizer` (a sha256) refuses a store prepared with
    another tokenizer; `verify=True` also recomputes every digest first. `cache_bytes` sizes tensorstore's chunk cache (decompressed chunks
    shared by all reads of this store).
    """

    def __init__(self, root, *, verify: bool = False, expect_tokenizer: str | None = None,
                 cache_bytes: int = 256 << 20) -> None:
        self.root = gcs.normalize(root)
        self.manifest = check_store(self.root, verify_store(self.root) if verify else None)
        record = self.manifest["tokenizer"]
        if expect_tokenizer and record["sha256"] != expect_tokenizer:
            raise StoreError(f"token store at {root} was prepared with tokenizer {record['sha256'][:16]} "
                             f"(vocab {record['vocab_size']}), expected {expect_tokenizer[:16]}; prepare "
                             "it again with the expected tokenizer")
        self.tokenizer = load_store_tokenizer(self.root, self.manifest)
        store = open_array(self.root, "tokens", cache_bytes=cache_bytes)
        self.tokens = TokenArray(store, self.root, checks.guard_for(self.root, store, self.manifest,
                                                                    self.tokenizer))
        self._strict = every_chunk_stored(self.manifest, "doc_offsets")
        self.doc_offsets = read_array(self.root, "doc_offsets", self._strict).astype(np.int64)
        arrays = self.manifest["arrays"]
        if (self.tokens.size != arrays["tokens"]["shape"][0]
                or self.doc_offsets.size != arrays["doc_offsets"]["shape"][0]
                or int(self.doc_offsets[-1]) != self.tokens.size):
            raise StoreError(f"token store at {root}: arrays do not match the manifest")
        self._names = [s["name"] for s in self.manifest["sources"]]
        self._splits: dict[tuple[str, str], SplitArrays] = {}

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(sorted(self._names))

    @property
    def digest(self) -> str:
        return self.manifest["store_digest"]

    def document_ids(self, source: str, split: str) -> np.ndarray:
        if source not in self._names or split not in SPLITS:
            raise UnknownName(f"no split {source}.{split}; sources are {list(self.sources)}, splits {SPLITS}")
        return read_array(self.root, f"by_source/{self._names.index(source):04d}/{split}",
                          self._strict).astype(np.int64)

    def split(self, source: str, split: str) -> SplitArrays:
        key = (source, split)
        if key not in self._splits:
            ids = self.document_ids(source, split)
            starts = self.doc_offsets[ids]
            offsets = np.zeros(ids.size + 1, dtype=np.int64)
            np.cumsum(self.doc_offsets[ids + 1] - starts, out=offsets[1:])
            self._splits[key] = SplitArrays(SplitTokens(self.tokens, starts, offsets), offsets)
        return self._splits[key]

    def document(self, doc_id: int) -> np.ndarray:
        return self.tokens.read(int(self.doc_offsets[doc_id]), int(self.doc_offsets[doc_id + 1]))

    def in_memory(self) -> InMemoryDocuments:
        """Every split read whole into numpy arrays, behind the same interface (the tests' and
        benchmarks' reference for the reading views; a store must fit in memory)."""
        return InMemoryDocuments(self.sources, self.tokenizer,
                                 {(s, split): SplitArrays(np.asarray(self.split(s, split).tokens),
                                                          self.split(s, split).offsets)
                                  for s in self.sources for split in SPLITS})

    def num_tokens(self, split: str) -> int:
        return sum(s["splits"][split]["tokens"] for s in self.manifest["sources"])

    def summary(self) -> list[dict]:
        rows = []
        for meta in self.manifest["sources"]:
            row = {"source": meta["name"], "kind": meta.get("kind", "text")}
            for split in SPLITS:
                row[f"{split}_documents"] = meta["splits"][split]["documents"]
                row[f"{split}_tokens"] = meta["splits"][split]["tokens"]
            rows.append(row)
        return rows


@dataclasses.dataclass(frozen=True)
class InMemoryDocuments:
    """`TokenStore.in_memory()`: sources, tokenizer and `split(source, split)` from numpy arrays."""

    sources: tuple[str, ...]
    tokenizer: object
    splits: dict

    def split(self, source: str, split: str) -> SplitArrays:
        return self.splits[(source, split)]

"""Token chunks that cannot lie (issue 53): a checksum per stored chunk object, verified as it is first
read, and every token id read checked against the tokenizer's vocabulary.

**Checksums.** The writers (`smelt data prepare`, `smelt data build`) record in the manifest's token
chunk record (`arrays.tokens.chunks.crc32`) the CRC-32 of every stored chunk object of the token array,
as stored (compressed bytes), 8 hex digits per chunk in chunk order. A reader (`ChunkGuard`) verifies a
chunk the first time a read of this process touches it (reading its object once more and hashing it),
before any of its tokens are used; a chunk overwritten with other bytes, even at the same size, is a
StoreError naming the store, the chunk object and both checksums. Verification as read, not at open:
opening stays one listing whatever the store's size (a 10B-token store would otherwise be read whole at
every open), and each chunk costs one extra object read and a CRC once per process (docs/data.md gives
the measured costs). Stores written before checksums (no `crc32` in the record, and the embedded corpus
built before) still open: their chunks are not checksummed, their ids are still range-checked, and
`smelt data store-info --verify` re-hashes them whole.

**Token ids.** Every token read is below the tokenizer's `vocab_size`; one that is not names the chunk it
came from (corrupted data is named as such, never left to show up as a non-finite loss).
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np

from smelt_jax.platform import storage as gcs
from smelt_jax.platform.errors import SmeltError

CHECKSUM_KEY = "crc32"
CHUNK_DIR = "c"


def chunk_url(tokens_url: str, index: int) -> str:
    return gcs.join(tokens_url, CHUNK_DIR, str(int(index)))


def crc32_hex(data: bytes) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def chunk_checksums(tokens_url: str, count: int) -> str:
    """The CRC-32s of chunk objects 0..count-1 of the token array at `tokens_url`, concatenated."""
    return "".join(crc32_hex(gcs.read_bytes(chunk_url(tokens_url, i))) for i in range(count))


class StoreError(SmeltError, ValueError):
    """A token store that is missing, incomplete, of another tokenizer, or fails its digests (defined
    here, the lowest module of the store; `token_store.StoreError` is this class)."""


def _store_error(message: str) -> StoreError:
    return StoreError(message)


def token_chunks(root) -> dict:
    """The token array's stored chunk objects: {"grid": chunks its shape needs, "objects": {index: bytes
    | None}} from one listing (bytes from the local folder; None on gs://, whose listing here carries
    no sizes). `sharded` stores list their shard objects (2**22 tokens each)."""
    url = gcs.join(root, "arrays", "tokens")
    try:
        meta = json.loads(gcs.read_text(gcs.join(url, "zarr.json")))
    except FileNotFoundError:
        raise _store_error(f"token store at {root}: the token array is missing ({url}/zarr.json)") from None
    except ValueError as err:
        raise _store_error(f"token store at {root}: {url}/zarr.json is damaged: {err}") from None
    size, chunk = int(meta["shape"][0]), int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    objects: dict[int, int | None] = {}
    folder = gcs.join(url, CHUNK_DIR)
    if gcs.is_gcs(url):
        for name in gcs.list_files(folder + "/"):
            if (key := name[len(folder) + 1:]).isdigit():
                objects[int(key)] = None
    elif os.path.isdir(folder):
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.isdigit():
                    objects[int(entry.name)] = entry.stat().st_size
    return {"grid": -(-size // chunk), "objects": objects}


def guard_for(root, store, manifest: dict, tokenizer) -> ChunkGuard:
    """The guard of a store's opened token array (`store`, a tensorstore; its write chunk is the stored
    object: a chunk, or a shard in the `sharded` layout)."""
    return ChunkGuard(root, gcs.join(root, "arrays", "tokens"), store.chunk_layout.write_chunk.shape[0],
                      (manifest["arrays"]["tokens"].get("chunks") or {}).get(CHECKSUM_KEY),
                      getattr(tokenizer, "vocab_size", None))


class ChunkGuard:
    """The checks of one opened token array: `verify(positions)` before a read, `check_ids(values,
    positions)` after it. `checksums` None (a store written before checksums): ids only."""

    def __init__(self, root, tokens_url: str, chunk_tokens: int, checksums: str | None,
                 vocab_size: int | None) -> None:
        self.root, self.url, self.chunk_tokens = root, tokens_url, int(chunk_tokens)
        self.checksums, self.vocab_size = checksums, vocab_size
        self.verified: set[int] = set()

    def verify(self, positions: np.ndarray) -> None:
        if not self.checksums:
            return
        for index in np.unique(np.asarray(positions, dtype=np.int64) // self.chunk_tokens).tolist():
            if index in self.verified:
                continue
            url = chunk_url(self.url, index)
            want = self.checksums[8 * index:8 * index + 8]
            try:
                got = crc32_hex(gcs.read_bytes(url))
            except (OSError, ValueError) as err:  # missing (a partial copy) or unreadable
                raise _store_error(f"token store at {self.root}: cannot read token chunk {url}: {err}; "
                                   "the store is damaged: copy or prepare it again") from None
            if got != want:
                raise _store_error(f"token store at {self.root}: token chunk {url} has CRC-32 {got}, the "
                                   f"manifest records {want}: the chunk was overwritten or damaged; copy "
                                   "or prepare the store again")
            self.verified.add(index)

    def check_ids(self, values: np.ndarray, positions: np.ndarray) -> None:
        if self.vocab_size is None or values.size == 0:
            return
        bad = np.flatnonzero(values.reshape(-1) >= self.vocab_size)
        if bad.size:
            where = int(np.asarray(positions).reshape(-1)[bad[0]])
            top = int(values.reshape(-1)[bad].max())
            raise _store_error(f"token store at {self.root}: token chunk "
                               f"{chunk_url(self.url, where // self.chunk_tokens)} holds ids up to {top}, "
                               f"the tokenizer's vocabulary has {self.vocab_size} ({bad.size} such ids "
                               f"read, the first at token {where}): the chunk is damaged; copy or "
                               "prepare the store again")

"""The zarr3 arrays of a token store (`token_store.py`), through tensorstore on a local folder or gs://: the
spec of each layout, creating, writing, opening, reading (with one error naming the array on a failed
read) and verifying an array against its recorded digest. Split from token_store.py (issue 52): the array
files are one concept, the store's documents, manifest and reader another."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from smelt_jax.data.store_checks import StoreError
from smelt_jax.platform import storage as gcs

ARRAYS_DIR = "arrays"
DIGEST_BLOCK = 1 << 22  # elements per digest block (= tokens per zarr shard)
TOKENS_SHARD = DIGEST_BLOCK
TOKENS_CHUNK = 1 << 16
SMALL_CHUNK = 1 << 20


def block_digest(values: np.ndarray) -> str:
    array = np.ascontiguousarray(values)
    return hashlib.sha256(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()


def combine_digests(dtype, shape: Iterable[int], blocks: Iterable[str]) -> str:
    digest = hashlib.sha256(f"{np.dtype(dtype).str} {list(shape)}\n".encode())
    for block in blocks:
        digest.update(block.encode() + b"\n")
    return digest.hexdigest()


def array_digest(values: np.ndarray) -> str:
    """The tree digest of an in-memory array (blocks of DIGEST_BLOCK elements along the flat order)."""
    flat = np.asarray(values).reshape(-1)
    blocks = [block_digest(flat[i:i + DIGEST_BLOCK]) for i in range(0, max(flat.size, 1), DIGEST_BLOCK)]
    return combine_digests(flat.dtype, np.shape(values), blocks)


def array_url(root, name: str) -> str:
    return gcs.join(root, ARRAYS_DIR, name)


LAYOUTS = ("chunks", "sharded")


def _zarr_spec(root, name: str, dtype, shape, *, layout: str = "small") -> dict:
    """zarr3 metadata. `small`: chunks of 2**20 elements; `chunks`: the token layout, one zstd object per
    2**16 tokens; `sharded`: 2**16-token chunks inside 2**22-token shard objects (64x fewer objects;
    needs a server that answers byte-range reads, which real Cloud Storage does and the emulator
    does not)."""
    dtype = np.dtype(dtype).name
    inner = [{"name": "bytes", "configuration": {"endian": "little"}},
             {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]
    if layout == "sharded":
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [TOKENS_CHUNK], "codecs": inner,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}]
        chunk = [TOKENS_SHARD]
    elif layout == "chunks":
        codecs, chunk = inner, [TOKENS_CHUNK]
    elif layout == "small":
        codecs, chunk = inner, [SMALL_CHUNK] + [max(int(s), 1) for s in shape[1:]]
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return {"driver": "zarr3", "kvstore": gcs.kvstore_spec(array_url(root, name)),
            "metadata": {"shape": [int(s) for s in shape], "data_type": dtype,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                         "chunk_key_encoding": {"name": "default"}, "codecs": codecs, "fill_value": 0}}


def create_array(root, name: str, dtype, shape, *, layout: str = "small"):
    """A new zarr3 array (the folder must be empty: callers delete old arrays key by key first). Every
    chunk is stored, even one equal to the fill value, so a missing chunk object is always damage."""
    import tensorstore as ts

    spec = {**_zarr_spec(root, name, dtype, shape, layout=layout), "store_data_equal_to_fill_value": True}
    return ts.open(spec, create=True).result()


def write_array(root, name: str, values: np.ndarray) -> dict:
    """Write a small array whole; returns its manifest entry (dtype, shape, sha256)."""
    values = np.ascontiguousarray(values)
    store = create_array(root, name, values.dtype, values.shape)
    if values.size:
        store.write(values).result()
    return {"dtype": values.dtype.str, "shape": list(values.shape), "sha256": array_digest(values)}


def open_array(root, name: str, *, cache_bytes: int = 0, write: bool = False, strict: bool = True):
    """An array of the store. `strict`: a missing chunk reads as an error, never as the fill value
    (zeros), so a partial copy cannot train. Stores written before every chunk was stored (no chunk
    record in the manifest: `every_chunk_stored`) left out chunks equal to the fill value, e.g. the
    all-zero doc_source of a one-source store; their small arrays are read with strict=False."""
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": gcs.kvstore_spec(array_url(root, name)),
            "recheck_cached_data": "open", "fill_missing_data_reads": not strict}
    if write:
        spec["store_data_equal_to_fill_value"] = True
    context = ts.Context({"cache_pool": {"total_bytes_limit": int(cache_bytes)}})
    try:
        return ts.open(spec, read=True, write=write, open=True, context=context).result()
    except Exception as err:  # tensorstore raises ValueError / its own errors for a missing array
        raise StoreError(f"cannot open array {name} of the token store at {root}: {err}") from err


def read_array(root, name: str, strict: bool = True) -> np.ndarray:
    store = open_array(root, name, strict=strict)
    return _read(store[...], root, name, "")


def every_chunk_stored(manifest: dict, name: str) -> bool:
    """Whether a missing chunk of array `name` is damage: always for the tokens (their chunks are
    never all fill value in practice, and check_store lists them); for the small arrays, in stores whose
    writer stored every chunk (those with a token chunk record)."""
    return name == "tokens" or "chunks" in manifest["arrays"]["tokens"]


def _read(view, root, name: str, where: str) -> np.ndarray:
    return _result(view.read(), root, name, where)


def _result(future, root, name: str, where: str) -> np.ndarray:
    """A tensorstore read's values; a missing or undecodable chunk raised as one StoreError line."""
    try:
        return np.asarray(future.result())
    except ValueError as err:  # tensorstore: NOT_FOUND (a missing chunk), FAILED_PRECONDITION (truncated)
        raise StoreError(f"token store at {root}: cannot read {name}{where}: {str(err).splitlines()[0]}; "
                         "the store is damaged: copy or prepare it again") from None


def verify_array(root, name: str, entry: dict, strict: bool = True) -> str | None:
    """Recompute one array's digest from storage; None when it matches, else the problem."""
    try:
        store = open_array(root, name, strict=strict)
    except StoreError as err:
        return str(err)
    shape = list(store.shape)
    if shape != entry["shape"] or np.dtype(store.dtype.numpy_dtype).str != entry["dtype"]:
        return f"{name}: shape/dtype {shape} {store.dtype} differ from the manifest's"
    size = int(np.prod(shape)) if shape else 1
    blocks = []
    try:
        for start in range(0, max(size, 1), DIGEST_BLOCK):
            stop = min(start + DIGEST_BLOCK, size)
            part = _read(store[start:stop], root, name, "") if len(shape) == 1 else \
                _read(store, root, name, "").reshape(-1)[start:stop]
            blocks.append(block_digest(part))
    except StoreError as err:
        return str(err)
    if combine_digests(entry["dtype"], shape, blocks) != entry["sha256"]:
        return f"{name}: digest mismatch"
    return None

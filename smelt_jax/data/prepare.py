"""`smelt data prepare`: text shards -> tokenized documents -> a token store (see token_store.py).

Two phases, both on `workers` processes:

1. **Tokenize**, one task per input shard (JSONL, JSONL.zst, JSONL.gz or Parquet; local or gs://).
   Each record gives a text (`text_field`) and a source label (`source_field`, or `default_source` when
   the field is absent). The shard's documents go to `parts/<id>/part.npz` (tokens, lengths, content
   keys, source codes) and `parts/<id>/part.json` is written last: a shard is done when its part.json
   exists, names the same input, tokenizer and fields, and its part.npz has the recorded sha256. A rerun
   reuses those parts and tokenizes only the others (resumption after a crash or a preemption).
2. **Assemble**, in shard order (sorted input names, so the result does not depend on `workers`):
   exact duplicates (same text) are dropped after their first occurrence, each document goes to
   validation when sha256(text)[:8] / 2**64 < `val_fraction` (every source with two or more documents
   keeps one on each side; the rule of the embedded corpus), and the flat token array is written in
   whole zarr shards, each by one process. The small arrays and `manifest.json` (written last) follow.
   All of it goes to `<store>/.staging/`, swapped in place of the old store only once complete; a store
   of other inputs, tokenizer or config is replaced only with `force` (refused before any work).

Bad input is counted and reported by shard and line, never silently dropped and never a traceback:
records that are not valid UTF-8 (or not JSON), lack the text / source field, or hold an empty text; a
shard that fails to read or parse as a whole (truncated zstd, broken Parquet) is reported by name, its
records are left out, and the rest is prepared (the manifest lists it under `failed_shards`; a rerun
tries it again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from smelt_jax.platform import storage as gcs
from smelt_jax.data import input_checks, worker_pool
from smelt_jax.data.input_shards import (
    INPUT_SUFFIXES,
    MAX_EXAMPLES,
    PROBLEM_KINDS,
    PrepareConfig,
    PrepareError,
    extract,
    read_records,
)
from smelt_jax.data import store_arrays
from smelt_jax.data import token_store as tsd
from smelt_jax.platform.errors import UsageError

ENCODE_BATCH = 512


# Phase 1: one shard -> one part ----------------------------------------------------------------------
def part_id(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:20]


def _part_url(root: str, url: str, name: str) -> str:
    return gcs.join(root, tsd.PARTS_DIR, part_id(url), name)


def _input_size(url: str) -> int | None:
    return None if gcs.is_gcs(url) else os.path.getsize(url)


def load_part(root: str, url: str, key: str) -> tuple[dict, dict] | None:
    """(part.json, arrays) when the shard's part exists and verifies, else None."""
    try:
        meta = json.loads(gcs.read_text(_part_url(root, url, "part.json")))
        if meta.get("input") != url or meta.get("key") != key or meta.get("input_bytes") != _input_size(url):
            return None
        blob = gcs.read_bytes(_part_url(root, url, "part.npz"))
    except (OSError, ValueError):
        return None
    if hashlib.sha256(blob).hexdigest() != meta.get("npz_sha256"):
        return None
    with np.load(io.BytesIO(blob)) as npz:
        return meta, {name: npz[name] for name in npz.files}


def tokenize_shard(url: str, tokenizer, config: PrepareConfig) -> tuple[dict, dict | None]:
    """Read, check and tokenize one shard: (summary, arrays) — arrays None when the shard failed."""
    counts: Counter = Counter()
    examples: list[str] = []
    try:
        data = gcs.read_bytes(url)
        records = list(read_records(url, data, config))
    except Exception as err:  # noqa: BLE001 - any parse failure is this shard's, reported by name
        return {"input": url, "status": "failed", "error": f"{type(err).__name__}: {err}"[:500]}, None
    texts, sources = [], []
    for number, record in records:
        counts["records"] += 1
        got = extract(record, config)
        if isinstance(got, str):
            counts[got] += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(f"{'row' if url.endswith('.parquet') else 'line'} {number}: {got}")
            continue
        texts.append(got[0])
        sources.append(got[1])
    names = sorted(set(sources))
    codes = np.array([names.index(s) for s in sources], dtype=np.int32) if names else np.zeros(0, np.int32)
    encoded = []
    for i in range(0, len(texts), ENCODE_BATCH):
        encoded.extend(tokenizer.encode_documents(texts[i:i + ENCODE_BATCH]))
    lengths = np.array([a.size for a in encoded], dtype=np.int64)
    tokens = np.concatenate(encoded) if encoded else np.zeros(0, dtype=tokenizer.token_dtype)
    keys = np.zeros((len(texts), 2), dtype=np.uint64)
    for i, text in enumerate(texts):
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        keys[i] = (int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:16], "big"))
    arrays = {"tokens": tokens.astype(tokenizer.token_dtype), "lengths": lengths, "keys": keys,
              "codes": codes}
    counts["documents"] = len(texts)
    counts["tokens"] = int(tokens.size)
    counts["text_bytes"] = sum(len(t.encode("utf-8")) for t in texts)
    summary = {"input": url, "status": "tokenized", "input_bytes": _input_size(url), "sources": names,
               "fields": input_checks.field_types(r for _, r in records),
               "counts": {k: int(counts[k]) for k in ("records", "documents", "tokens", "text_bytes")},
               "problems": {k: int(counts[k]) for k in PROBLEM_KINDS if counts[k]},
               "examples": examples}
    return summary, arrays


def write_part(root: str, url: str, key: str, summary: dict, arrays: dict) -> dict:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    blob = buffer.getvalue()
    gcs.write_bytes(_part_url(root, url, "part.npz"), blob)
    meta = {**summary, "key": key, "npz_sha256": hashlib.sha256(blob).hexdigest()}
    gcs.write_text(_part_url(root, url, "part.json"), json.dumps(meta, sort_keys=True))  # commit marker
    return meta


_WORKER: dict = {}


def _init_worker(tokenizer_spec: dict, config: dict, root: str, single_thread: bool = True) -> None:
    if single_thread:
        os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per worker process
    from smelt_jax.data.hf_tokenizer import tokenizer_from_record

    _WORKER["tokenizer"] = tokenizer_from_record(tokenizer_spec["record"], tokenizer_spec["json"])
    _WORKER["config"] = PrepareConfig(**config)
    _WORKER["root"] = root


def _shard_task(url: str) -> dict:
    tokenizer, config, root = _WORKER["tokenizer"], _WORKER["config"], _WORKER["root"]
    key = config.part_key(f"{tokenizer.sha256}:{tokenizer.bos_id}:{tokenizer.eos_id}")
    started = time.time()
    existing = load_part(root, url, key)
    if existing is not None:
        return {**existing[0], "status": "reused", "seconds": time.time() - started}
    summary, arrays = tokenize_shard(url, tokenizer, config)
    if arrays is not None:
        summary = write_part(root, url, key, summary, arrays)
    return {**summary, "seconds": time.time() - started}


# Phase 2: assemble ----------------------------------------------------------------------------------
def _assemble_task(args: tuple) -> dict[int, str]:
    """Write whole token shards [first, last) of the final array; their digests by shard index."""
    root, first, last, total, dtype, part_urls, doc_part, doc_src, doc_out, doc_len = args
    store = store_arrays.open_array(root, "tokens", write=True)
    cache: dict[int, np.ndarray] = {}
    digests = {}
    for shard in range(first, last):
        a, b = shard * store_arrays.TOKENS_SHARD, min((shard + 1) * store_arrays.TOKENS_SHARD, total)
        pos = np.arange(a, b, dtype=np.int64)
        doc = np.searchsorted(doc_out, pos, side="right") - 1
        src = doc_src[doc] + (pos - doc_out[doc])
        part = doc_part[doc]
        buf = np.empty(b - a, dtype=dtype)
        for p in np.unique(part):
            if int(p) not in cache:
                cache.clear()  # shards are visited in order: one part at a time is enough
                with np.load(io.BytesIO(gcs.read_bytes(part_urls[int(p)]))) as npz:
                    cache[int(p)] = npz["tokens"]
            take = part == p
            buf[take] = cache[int(p)][src[take]]
        store[a:b].write(buf).result()
        digests[shard] = store_arrays.block_digest(buf)
    return digests


@dataclasses.dataclass
class PrepareResult:
    root: str
    manifest: dict
    prepared: bool  # False when an up-to-date store was kept
    failed_shards: list[dict]


def _print(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


STAGING_DIR = ".staging"  # under the store's root: the store being assembled, swapped in when complete


def _existing_store(root: str, urls: list[str], tokenizer, config: PrepareConfig, force: bool) -> dict | None:
    """The manifest of a store at `root` that is up to date with this prepare (kept as it is), else None.

    A store of other inputs, tokenizer or config is replaced only with `force` (PrepareError otherwise,
    before anything is read or written); a store of the same recipe with failed shards is rebuilt (a
    rerun retries them). Nothing is deleted here: the new store replaces the old one only once it is
    complete (`_swap_in`)."""
    if not gcs.exists(gcs.join(root, tsd.MANIFEST_NAME)):
        return None  # nothing there, or an interrupted prepare (no manifest yet): resume
    try:
        old = tsd.read_manifest(root)
    except tsd.StoreError as err:
        if force:
            return None
        raise PrepareError(f"{err}; pass --force to replace it") from None
    same = (old.get("config") == dataclasses.asdict(config) and old.get("tokenizer") == tokenizer.to_dict()
            and [i["input"] for i in old.get("inputs", [])] == urls)
    if same and not old.get("failed_shards") and not force:
        return old
    if not same and not force:
        tokens = old.get("totals", {}).get("tokens")
        raise PrepareError(f"{root} already holds a token store of other inputs, tokenizer or config "
                           f"({f'{tokens:,}' if isinstance(tokens, int) else '?'} tokens, digest "
                           f"{str(old.get('store_digest'))[:16]}); pass --force to replace it, or choose "
                           "another --out")
    return None


def _swap_in(stage: str, root: str) -> None:
    """Put the complete store at `stage` (arrays, tokenizer.json, manifest.json) in place of the one at
    `root`. The old manifest goes first and the new one comes last, so a reader sees the old store, no
    store, or the new one. Local: renames. gs://: the staged objects are copied (a bucket has no rename:
    one read and one write per object) and the staging prefix deleted."""
    names = (store_arrays.ARRAYS_DIR, tsd.TOKENIZER_NAME)
    gcs.delete(gcs.join(root, tsd.MANIFEST_NAME))
    if gcs.is_gcs(root):
        gcs.delete_tree(gcs.join(root, store_arrays.ARRAYS_DIR))
        gcs.delete(gcs.join(root, tsd.TOKENIZER_NAME))
        prefix = stage.rstrip("/") + "/"
        for url in gcs.list_files(stage):
            if url[len(prefix):] != tsd.MANIFEST_NAME:
                gcs.write_bytes(gcs.join(root, url[len(prefix):]), gcs.read_bytes(url))
        gcs.write_bytes(gcs.join(root, tsd.MANIFEST_NAME), gcs.read_bytes(gcs.join(stage, tsd.MANIFEST_NAME)))
        gcs.delete_tree(stage)
        return
    import shutil
    import tempfile
    from pathlib import Path

    for left in Path(root).glob(".old-*"):  # an earlier swap killed half-way
        shutil.rmtree(left, ignore_errors=True)
    trash = tempfile.mkdtemp(prefix=".old-", dir=root)
    for name in names:
        if os.path.lexists(os.path.join(root, name)):
            os.replace(os.path.join(root, name), os.path.join(trash, name))
        if os.path.lexists(os.path.join(stage, name)):
            os.replace(os.path.join(stage, name), os.path.join(root, name))
    os.replace(os.path.join(stage, tsd.MANIFEST_NAME), os.path.join(root, tsd.MANIFEST_NAME))
    shutil.rmtree(trash, ignore_errors=True)
    shutil.rmtree(stage, ignore_errors=True)


def prepare(inputs: list[str], out, tokenizer, config: PrepareConfig | None = None, *, workers: int = 1,
            force: bool = False, progress: bool = True, clean_parts: bool = False,
            subset: tuple[int, int] | None = None,
            log: Callable[[str], None] | None = None) -> PrepareResult:
    """Prepare a token store at `out` from `inputs` (paths, globs or gs:// URLs); see the module doc.

    `subset=(i, n)` tokenizes only shards i, i + n, i + 2n, ... (of the sorted list) and stops before
    assembling: n machines each run one subset, then one run without `subset` reuses every part and
    assembles the store. The result's manifest is then empty ({}) and `prepared` False.
    """
    config = config or PrepareConfig()
    say = log or (lambda message: _print(progress, message))
    root = gcs.normalize(out)
    started = time.time()
    urls = gcs.expand(inputs, INPUT_SUFFIXES)
    if not urls:
        raise PrepareError("no input shards")
    key = config.part_key(f"{tokenizer.sha256}:{tokenizer.bos_id}:{tokenizer.eos_id}")
    if subset is None:
        kept = _existing_store(root, urls, tokenizer, config, force)
        if kept is not None:
            say(f"token store at {root} is up to date ({kept['totals']['tokens']:,} tokens, "
                f"digest {kept['store_digest'][:16]})")
            return PrepareResult(root, kept, False, [])
    if force and subset is None:
        gcs.delete_tree(gcs.join(root, tsd.PARTS_DIR))
    all_urls = urls
    if subset is not None:
        index, count = subset
        if not 0 <= index < count:
            raise UsageError(f"subset {index}/{count}: expected 0 <= I < N")
        urls = urls[index::count]

    # Phase 1 ----------------------------------------------------------------------------------------
    say(f"smelt data prepare: {len(urls)} shard(s) -> {root} with tokenizer {tokenizer.sha256[:12]} "
        f"(vocab {tokenizer.vocab_size}) on {workers} process(es)")
    spec = {"record": tokenizer.to_dict(), "json": getattr(tokenizer, "json", None)}
    initargs = (spec, dataclasses.asdict(config), root)
    summaries: dict[str, dict] = {}
    tokens_done, new_tokens = 0, 0
    phase_start = time.time()

    def report(summary: dict) -> None:
        nonlocal tokens_done, new_tokens
        summaries[summary["input"]] = summary
        n = len(summaries)
        name = gcs.basename(summary["input"])
        if summary["status"] == "failed":
            say(f"[{n}/{len(urls)}] {name}: FAILED ({summary['error']})")
            return
        tokens = summary["counts"]["tokens"]
        tokens_done += tokens
        if summary["status"] == "tokenized":
            new_tokens += tokens
        rate = new_tokens / max(time.time() - phase_start, 1e-9)
        bad = sum(summary["problems"].values())
        say(f"[{n}/{len(urls)}] {name}: {summary['status']}, {summary['counts']['documents']:,} docs, "
            f"{tokens:,} tokens" + (f", {bad:,} bad records" if bad else "")
            + f"; total {tokens_done:,} tokens, {rate:,.0f} tokens/s")

    if workers <= 1:
        _init_worker(*initargs, single_thread=False)
        for url in urls:
            report(_shard_task(url))
    else:
        with worker_pool.pool(workers, _init_worker, initargs) as pool:
            for summary in pool.imap_unordered(_shard_task, urls):
                report(summary)
    tokenize_seconds = time.time() - phase_start
    if subset is not None:
        failed = [{"input": u, "error": s["error"]} for u, s in summaries.items() if s["status"] == "failed"]
        say(f"subset {subset[0]}/{subset[1]}: {len(urls)} of {len(all_urls)} shard(s) tokenized or reused "
            f"({new_tokens:,} new tokens in {tokenize_seconds:.1f} s); assemble with a run without --subset")
        return PrepareResult(root, {}, False, failed)

    # Phase 2 ----------------------------------------------------------------------------------------
    failed = [{"input": u, "error": summaries[u]["error"]} for u in urls if summaries[u]["status"] == "failed"]
    good = [u for u in urls if summaries[u]["status"] != "failed"]
    if not good:
        raise PrepareError("every input shard failed: " + "; ".join(f"{f['input']}: {f['error']}" for f in failed))
    metas = []
    for url in good:
        loaded = load_part(root, url, key)
        if loaded is None:
            raise PrepareError(f"the part of {url} does not verify after writing it")
        meta, arrays = loaded
        metas.append((url, meta, {k: v for k, v in arrays.items() if k != "tokens"}))
    names = sorted({name for _, meta, _ in metas for name in meta["sources"]})
    lengths = np.concatenate([a["lengths"] for _, _, a in metas])
    keys = np.concatenate([a["keys"].reshape(-1, 2) for _, _, a in metas])
    codes = np.concatenate([np.array([names.index(s) for s in meta["sources"]], np.int32)[a["codes"]]
                            if a["codes"].size else np.zeros(0, np.int32) for _, meta, a in metas])
    doc_part = np.concatenate([np.full(a["lengths"].size, i, np.int32) for i, (_, _, a) in enumerate(metas)])
    doc_src = np.concatenate([np.concatenate([[0], np.cumsum(a["lengths"])[:-1]]).astype(np.int64)
                              if a["lengths"].size else np.zeros(0, np.int64) for _, _, a in metas])
    keep = np.ones(lengths.size, dtype=bool)
    if config.dedup and lengths.size:
        _, first = np.unique(np.ascontiguousarray(keys).view(np.dtype((np.void, 16))).reshape(-1),
                             return_index=True)
        keep[:] = False
        keep[first] = True
    duplicates = Counter(codes[~keep].tolist())
    lengths, keys, codes, doc_part, doc_src = (x[keep] for x in (lengths, keys, codes, doc_part, doc_src))
    if lengths.size == 0:
        found: dict = {}
        for _, meta, _ in metas:
            input_checks.merge_fields(found, meta.get("fields", {}))
        raise PrepareError(input_checks.no_documents_message(
            sum((Counter(meta.get("problems", {})) for _, meta, _ in metas), Counter()), found,
            inputs=len(urls), records=sum(meta["counts"]["records"] for _, meta, _ in metas),
            text_field=config.text_field, source_field=config.source_field))
    val = tsd.split_assignment(keys[:, 0], codes, len(names), config.val_fraction)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    dtype = np.dtype(tokenizer.token_dtype)
    say(f"assembling {lengths.size:,} documents, {total:,} tokens ({int((~keep).sum()):,} duplicates "
        f"dropped) from {len(good)} part(s)")

    stage = gcs.join(root, STAGING_DIR)  # the new store is built here and swapped in when complete
    gcs.delete_tree(stage)
    store_arrays.create_array(stage, "tokens", dtype, [total], layout=config.layout)
    n_shards = -(-total // store_arrays.TOKENS_SHARD)
    part_urls = [_part_url(root, u, "part.npz") for u, _, _ in metas]
    per = -(-n_shards // max(1, min(workers, n_shards)))
    tasks = [(stage, s, min(s + per, n_shards), total, dtype, part_urls, doc_part, doc_src, offsets[:-1],
              lengths) for s in range(0, n_shards, per)]
    digests: dict[int, str] = {}
    if workers <= 1 or len(tasks) == 1:
        for task in tasks:
            digests.update(_assemble_task(task))
    else:
        with worker_pool.pool(len(tasks)) as pool:
            for part in pool.imap_unordered(_assemble_task, tasks):
                digests.update(part)
    arrays = {"tokens": {"dtype": dtype.str, "shape": [total],
                         "sha256": store_arrays.combine_digests(dtype, [total], [digests[i] for i in range(n_shards)]),
                         "chunks": tsd.chunk_record(stage)}}
    index, sources = tsd.write_index(stage, lengths, codes, val, names, duplicates)
    arrays.update(index)
    if getattr(tokenizer, "kind", "") != "bytes":
        gcs.write_text(gcs.join(stage, tsd.TOKENIZER_NAME), tokenizer.json)
    problems = Counter()
    for s in summaries.values():
        problems.update(s.get("problems", {}))
    seconds = time.time() - started
    manifest = {
        "format": tsd.STORE_FORMAT, "tokenizer": tokenizer.to_dict(), "config": dataclasses.asdict(config),
        "split_rule": {"val_fraction": config.val_fraction, "key": tsd.SPLIT_RULE_KEY,
                       "dedup": config.dedup},
        "sources": sources, "arrays": arrays,
        "totals": {"documents": int(lengths.size), "tokens": total, **tsd.split_totals(sources),
                   "duplicates_dropped": int((~keep).sum())},
        "inputs": [{"input": u, "status": summaries[u]["status"], "counts": summaries[u].get("counts"),
                    "problems": summaries[u].get("problems", {}), "examples": summaries[u].get("examples", [])}
                   for u in urls],
        "problems": {k: int(problems[k]) for k in PROBLEM_KINDS if problems[k]},
        "failed_shards": failed,
        "prepare": {"workers": workers, "seconds": round(seconds, 2),
                    "tokenize_seconds": round(tokenize_seconds, 2),
                    "tokens_per_second": round(new_tokens / max(tokenize_seconds, 1e-9)),
                    "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    tsd.commit_manifest(stage, manifest)
    _swap_in(stage, root)
    if clean_parts:
        gcs.delete_tree(gcs.join(root, tsd.PARTS_DIR))
    say(f"token store at {root}: {total:,} tokens in {lengths.size:,} documents, {len(names)} source(s); "
        f"digest {manifest['store_digest'][:16]}; {seconds:.1f} s")
    return PrepareResult(root, manifest, True, failed)

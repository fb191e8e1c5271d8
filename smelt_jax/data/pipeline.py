"""The input pipeline: documents packed into rows, and the batch at step t a pure function of (seed, t).

**Training stream.** Epoch `e` orders all training documents (every source) by a hashed permutation
of (seed, e) and concatenates them into a stream of T tokens (T = training tokens in the corpus; each
document is BOS + bytes + EOS). The stream is cut into R = T // seq_len rows; row j reads stream tokens
[j*S, j*S + S + 1) — the extra token gives the last position its target. Rows are then visited in a
second hashed permutation of (seed, e), so one batch mixes many documents. Global row g is row
`row_perm_e[g mod R]` of epoch `e = g // R`, and the batch at step t is global rows [t*B, (t+1)*B).

Consequences, all by construction rather than by bookkeeping:
- `batch_at(t)` depends only on (corpus, seed, batch size, seq_len, t): resuming needs only the step, a
  decay branch forking at step s reads exactly what the stable run reads from s on, and two models of a
  matched pair (same Schedule) read identical batches.
- Host h of H reads rows [t*B + h*B/H, t*B + (h+1)*B/H) only; the hosts' rows concatenated in host
  order are the single-host batch.
- The permutations are a splitmix64 hash sorted with a stable sort, not a library RNG, so they do not
  change with numpy versions.

**Rows.** `tokens[i]` are the inputs and `targets[i]` the next stream token (`tokens[i + 1]`
within a row). `segment_ids` number the documents (fragments) in a row 1, 2, 3, ...; padding (only at the end of a validation stream) is 0.
`positions` restart at 0 where a document starts *and* at the start of a row (a fragment continuing
from the previous row cannot attend to its beginning, so it is treated as a document of its own).
`loss_mask[i]` is 1 exactly when token i and its target belong to the same document: the EOS of each
document (whose next token is another document's BOS) and padding are masked.

**Validation** (per source): the source's validation documents in stored order, packed the same way
without shuffling, the last row padded; every target token of the split is scored exactly once.

**Sources of documents.** A `TokenStore` (smelt_jax/data/token_store.py: tensorstore zarr3 on local disk
or gs://, whose `tokens` view reads only the positions a batch indexes): a store made by `smelt data
prepare`, or the embedded corpus (`smelt data build` writes it as a token store). Anything else with
`sources`, `tokenizer` (with `pad_id`) and `split(source, split)` -> `SplitArrays(tokens, offsets)` works
too (the tests use in-memory arrays as the reference). `corpus.open_dataset(path)` opens a store, by default the embedded corpus.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from smelt_jax.platform.errors import UsageError

if TYPE_CHECKING:
    from smelt_jax.data.token_store import TokenStore

    Documents = TokenStore

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic): a bijective 64-bit mix."""
    x = np.asarray(x, dtype=np.uint64)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _derive_key(*parts: int) -> np.uint64:
    key = np.zeros(1, dtype=np.uint64)
    for part in parts:
        key = _splitmix64(key ^ np.array([part & _MASK64], dtype=np.uint64))
    return key[0]


def hashed_permutation(n: int, *key: int) -> np.ndarray:
    """A permutation of range(n) that depends only on `key` (ints): int64 [n]."""
    scores = _splitmix64(np.arange(n, dtype=np.uint64) ^ _derive_key(*key))
    return np.argsort(scores, kind="stable").astype(np.int64)


@dataclasses.dataclass(frozen=True)
class DocumentTable:
    """Documents of one split over several sources: where each lives in which token array."""

    arrays: tuple[np.ndarray, ...]  # per source: uint16 [tokens] (memmap, or a token store's view)
    source: np.ndarray  # int32 [documents]: index into `arrays`
    start: np.ndarray  # int64 [documents]
    length: np.ndarray  # int64 [documents]

    @classmethod
    def from_corpus(cls, corpus: Documents, split: str, sources: Sequence[str]) -> DocumentTable:
        arrays, source, start, length = [], [], [], []
        for index, name in enumerate(sources):
            part = corpus.split(name, split)
            offsets = np.asarray(part.offsets, dtype=np.int64)
            arrays.append(part.tokens)
            source.append(np.full(offsets.size - 1, index, dtype=np.int32))
            start.append(offsets[:-1])
            length.append(np.diff(offsets))
        return cls(tuple(arrays), np.concatenate(source), np.concatenate(start), np.concatenate(length))

    @property
    def num_documents(self) -> int:
        return int(self.length.size)


def pack_rows(table: DocumentTable, order: np.ndarray, cumulative: np.ndarray, row_starts: np.ndarray,
              seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Rows of the stream that concatenates `table`'s documents in `order`.

    `cumulative` is int64 [len(order) + 1], the stream offset of each document (its last entry is the
    stream length); row b reads stream tokens [row_starts[b], row_starts[b] + seq_len + 1), positions at
    or past the end are padding. Returns int32 [rows, seq_len] `tokens`, `targets`, `segment_ids`,
    `positions` and float32 [rows, seq_len] `loss_mask`.
    """
    stream_len = int(cumulative[-1])
    row_starts = np.asarray(row_starts, dtype=np.int64).reshape(-1, 1)
    pos = row_starts + np.arange(seq_len + 1, dtype=np.int64)  # [rows, S + 1]
    valid = pos < stream_len
    slot = np.clip(np.searchsorted(cumulative, pos, side="right") - 1, 0, max(len(order) - 1, 0))
    doc = order[slot]
    within = np.where(valid, table.start[doc] + pos - cumulative[slot], 0)
    tokens = np.full(pos.shape, pad_id, dtype=np.int32)
    doc_source = table.source[doc]
    for index, array in enumerate(table.arrays):
        take = valid & (doc_source == index)
        if take.any():
            tokens[take] = array[within[take]]
    segment = np.where(valid, slot - slot[:, :1] + 1, 0)
    doc_begin = np.maximum(cumulative[slot], row_starts)
    positions = np.where(valid, pos - doc_begin, 0)
    same_doc = valid[:, 1:] & valid[:, :-1] & (slot[:, 1:] == slot[:, :-1])
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": segment[:, :-1].astype(np.int32),
            "positions": positions[:, :-1].astype(np.int32),
            "loss_mask": same_doc.astype(np.float32)}


def _host_slice(batch_size: int, host_index: int | None, host_count: int | None) -> tuple[int, int]:
    if host_index is None or host_count is None:
        import jax  # only when the caller leaves the host to JAX

        host_index = jax.process_index() if host_index is None else host_index
        host_count = jax.process_count() if host_count is None else host_count
    if host_count <= 0 or not 0 <= host_index < host_count:
        raise UsageError(f"host_index {host_index} must lie in 0..host_count-1 (host_count {host_count})")
    if batch_size % host_count:
        raise UsageError(f"batch_size {batch_size} is not divisible by host_count {host_count}")
    return host_index, host_count


class TrainPipeline:
    """The training batches: `batch_at(step)` is this host's slice of global batch `step`.

    Every array is [batch_size // host_count, seq_len]; see the module docstring for the packing.
    """

    def __init__(self, corpus: Documents, *, batch_size: int, seq_len: int, seed: int,
                 host_index: int | None = None, host_count: int | None = None,
                 sources: Sequence[str] | None = None) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise UsageError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be positive")
        self.corpus = corpus
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, int(seed)
        self.host_index, self.host_count = _host_slice(batch_size, host_index, host_count)
        self.local_batch_size = batch_size // self.host_count
        self.sources = tuple(sorted(sources if sources is not None else corpus.sources))
        self.table = DocumentTable.from_corpus(corpus, "train", self.sources)
        self.tokens_per_epoch = int(self.table.length.sum())
        self.rows_per_epoch = self.tokens_per_epoch // seq_len
        if self.rows_per_epoch < 1:
            raise UsageError(f"the training split holds {self.tokens_per_epoch} tokens, fewer than one "
                             f"row of seq_len {seq_len}; give more data or a shorter seq_len")
        self.pad_id = corpus.tokenizer.pad_id
        self._plans: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_schedule(cls, corpus: Documents, schedule, **host) -> TrainPipeline:
        """Batches for a `smelt_jax.design.config.Schedule`: its batch_size, seq_len and seed."""
        return cls(corpus, batch_size=schedule.batch_size, seq_len=schedule.seq_len, seed=schedule.seed,
                   **host)

    def _epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order [docs], stream offsets [docs + 1], row order [R]) of one epoch (cached)."""
        if epoch in self._plans:
            return self._plans[epoch]
        order = hashed_permutation(self.table.num_documents, self.seed, epoch, 0)
        cumulative = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(self.table.length[order], out=cumulative[1:])
        row_order = hashed_permutation(self.rows_per_epoch, self.seed, epoch, 1)
        if len(self._plans) >= 2:  # a step touches at most two epochs
            self._plans.pop(next(iter(self._plans)))
        self._plans[epoch] = (order, cumulative, row_order)
        return self._plans[epoch]

    def global_rows(self, step: int) -> np.ndarray:
        """Indices (into the endless row sequence) of this host's rows at `step`: int64 [local batch]."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        first = int(step) * self.batch_size + self.host_index * self.local_batch_size
        return np.arange(first, first + self.local_batch_size, dtype=np.int64)

    def rows(self, global_rows: np.ndarray) -> dict[str, np.ndarray]:
        """Packed rows for arbitrary global row indices (rows may span epochs)."""
        global_rows = np.asarray(global_rows, dtype=np.int64)
        epochs = global_rows // self.rows_per_epoch
        out: dict[str, np.ndarray] = {}
        for epoch in np.unique(epochs):
            pick = epochs == epoch
            order, cumulative, row_order = self._epoch_plan(int(epoch))
            starts = row_order[global_rows[pick] % self.rows_per_epoch] * self.seq_len
            part = pack_rows(self.table, order, cumulative, starts, self.seq_len, self.pad_id)
            for key, value in part.items():
                if key not in out:
                    out[key] = np.empty((global_rows.size, self.seq_len), dtype=value.dtype)
                out[key][pick] = value
        return out

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This host's slice of the global batch at `step`: arrays [local_batch, seq_len]."""
        return self.rows(self.global_rows(step))

    def epoch_of_step(self, step: int) -> float:
        return step * self.batch_size / self.rows_per_epoch

    def dataset(self, start_step: int, num_steps: int):
        """A grain MapDataset whose element i is `batch_at(start_step + i)` (random access)."""
        import grain

        return grain.MapDataset.range(start_step, start_step + num_steps).map(self.batch_at)

    def iterator(self, start_step: int, num_steps: int, *, threads: int = 2,
                 prefetch: int = 8) -> Iterator[dict[str, np.ndarray]]:
        """Batches start_step, start_step + 1, ... in order, built ahead by `threads` grain threads."""
        import grain

        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        return iter(self.dataset(start_step, num_steps).to_iter_dataset(options))


class ValidationSet:
    """One source's validation split as fixed batches: every target token is scored once.

    `num_batches` batches of [batch_size // host_count, seq_len]; the rows past the end of the stream
    are padding (loss_mask 0). `max_tokens` keeps only the first rows covering that many tokens.
    """

    def __init__(self, corpus: Documents, source: str, *, batch_size: int, seq_len: int,
                 host_index: int | None = None, host_count: int | None = None,
                 max_tokens: int | None = None) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise UsageError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be positive")
        self.source, self.batch_size, self.seq_len = source, batch_size, seq_len
        self.host_index, self.host_count = _host_slice(batch_size, host_index, host_count)
        self.local_batch_size = batch_size // self.host_count
        self.table = DocumentTable.from_corpus(corpus, "val", [source])
        if self.table.num_documents == 0:
            raise UsageError(f"source {source!r} has no validation documents")
        self.order = np.arange(self.table.num_documents, dtype=np.int64)
        self.cumulative = np.zeros(self.order.size + 1, dtype=np.int64)
        np.cumsum(self.table.length, out=self.cumulative[1:])
        stream = int(self.cumulative[-1])
        if max_tokens is not None:
            stream = min(stream, int(max_tokens))
        self.num_rows = -(-stream // seq_len)
        self.num_batches = -(-self.num_rows // batch_size)
        self.pad_id = corpus.tokenizer.pad_id

    def batch_at(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"validation batch {index} outside 0..{self.num_batches - 1}")
        first = index * self.batch_size + self.host_index * self.local_batch_size
        rows = np.arange(first, first + self.local_batch_size, dtype=np.int64)
        # Rows past the last one start at the stream's end: all padding.
        starts = np.where(rows < self.num_rows, rows * self.seq_len, self.cumulative[-1])
        return pack_rows(self.table, self.order, self.cumulative, starts, self.seq_len, self.pad_id)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self.batch_at(i) for i in range(self.num_batches))

    def dataset(self):
        """A grain MapDataset over the validation batches."""
        import grain

        return grain.MapDataset.range(self.num_batches).map(self.batch_at)


def validation_sets(corpus: Documents, *, batch_size: int, seq_len: int, max_tokens: int | None = None,
                    host_index: int | None = None, host_count: int | None = None
                    ) -> dict[str, ValidationSet]:
    """A ValidationSet per source that has validation documents, keyed by source name."""
    out = {}
    for source in sorted(corpus.sources):
        if corpus.split(source, "val").num_documents:
            out[source] = ValidationSet(corpus, source, batch_size=batch_size, seq_len=seq_len,
                                        max_tokens=max_tokens, host_index=host_index,
                                        host_count=host_count)
    return out

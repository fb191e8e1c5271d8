"""The packed input pipeline: purity in (seed, step), host slicing, branches, packing, validation."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import build_tiny_corpus

from smelt_jax.design.config import Schedule
from smelt_jax.data.pipeline import (
    DocumentTable,
    TrainPipeline,
    ValidationSet,
    hashed_permutation,
    pack_rows,
    validation_sets,
)

PAD = 258


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("tiny"))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _table(docs: list[list[int]], sources: list[int] | None = None) -> DocumentTable:
    """A DocumentTable over hand-written documents, spread over sources by `sources`."""
    sources = sources or [0] * len(docs)
    n_sources = max(sources) + 1
    arrays, start = [[] for _ in range(n_sources)], []
    for doc, src in zip(docs, sources):
        start.append(len(arrays[src]))
        arrays[src].extend(doc)
    return DocumentTable(tuple(np.array(a, dtype=np.uint16) for a in arrays), np.array(sources, np.int32),
                         np.array(start, np.int64), np.array([len(d) for d in docs], np.int64))


def _reference_rows(docs, order, row_starts, seq_len):
    """Straightforward per-token loops: the stream, then each row's fields."""
    stream, doc_of, begin_of = [], [], []
    for slot, d in enumerate(order):
        begin = len(stream)
        for t in docs[d]:
            stream.append(t)
            doc_of.append(slot)
            begin_of.append(begin)
    out = {k: [] for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask")}
    for a in row_starts:
        row = {k: [] for k in out}
        first_slot = doc_of[a] if a < len(stream) else None
        for i in range(seq_len):
            p = a + i
            real, real_next = p < len(stream), p + 1 < len(stream)
            row["tokens"].append(stream[p] if real else PAD)
            row["targets"].append(stream[p + 1] if real_next else PAD)
            row["segment_ids"].append(doc_of[p] - first_slot + 1 if real else 0)
            row["positions"].append(p - max(begin_of[p], a) if real else 0)
            row["loss_mask"].append(float(real and real_next and doc_of[p] == doc_of[p + 1]))
        for k, values in row.items():
            out[k].append(values)
    return {k: np.array(v) for k, v in out.items()}


# Packing -------------------------------------------------------------------------------------------
def test_pack_rows_hand_checked_case():
    # Stream (order 0, 1, 2): [B a b E][B c E][B d e f g E] ; B=256 E=257.
    docs = [[256, 1, 2, 257], [256, 3, 257], [256, 4, 5, 6, 7, 257]]
    table = _table(docs, sources=[0, 1, 0])
    order = np.arange(3)
    cumulative = np.array([0, 4, 7, 13])
    rows = pack_rows(table, order, cumulative, np.array([0, 5, 9]), seq_len=5, pad_id=PAD)
    np.testing.assert_array_equal(rows["tokens"], [[256, 1, 2, 257, 256],
                                                   [3, 257, 256, 4, 5],
                                                   [5, 6, 7, 257, PAD]])
    np.testing.assert_array_equal(rows["targets"], [[1, 2, 257, 256, 3],
                                                    [257, 256, 4, 5, 6],
                                                    [6, 7, 257, PAD, PAD]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 2],
                                                        [1, 1, 2, 2, 2],
                                                        [1, 1, 1, 1, 0]])
    # Positions restart per document and at the row start (a continued fragment).
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 0],
                                                      [0, 1, 0, 1, 2],
                                                      [0, 1, 2, 3, 0]])
    # EOS -> next BOS is masked; the last column scores the first token of the next row when same doc.
    np.testing.assert_array_equal(rows["loss_mask"], [[1, 1, 1, 0, 1],
                                                      [1, 0, 1, 1, 1],
                                                      [1, 1, 1, 0, 0]])


@pytest.mark.parametrize("seed", range(6))
def test_pack_rows_matches_reference_on_random_documents(seed):
    rng = np.random.default_rng(seed)
    n_docs = int(rng.integers(1, 12))
    docs = [[256] + rng.integers(0, 256, int(rng.integers(0, 20))).tolist() + [257] for _ in range(n_docs)]
    sources = rng.integers(0, 3, n_docs).tolist()
    sources[0] = 2  # make every source index up to 2 exist
    table = _table(docs, sources)
    order = rng.permutation(n_docs)
    cumulative = np.concatenate([[0], np.cumsum([len(docs[d]) for d in order])])
    seq_len = int(rng.choice([1, 2, 7, 33]))
    # Row starts anywhere, including the last token and past the end (pure padding).
    starts = rng.integers(0, cumulative[-1] + 3, 9)
    got = pack_rows(table, order, cumulative, starts, seq_len, PAD)
    want = _reference_rows(docs, order, starts, seq_len)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert got[key].shape == (9, seq_len)


def test_hashed_permutation_is_a_fixed_permutation():
    perm = hashed_permutation(1000, 3, 7)
    assert sorted(perm.tolist()) == list(range(1000))
    np.testing.assert_array_equal(perm, hashed_permutation(1000, 3, 7))
    assert not np.array_equal(perm, hashed_permutation(1000, 3, 8))
    assert not np.array_equal(perm, np.arange(1000))
    assert hashed_permutation(0, 1).size == 0


# Training batches ----------------------------------------------------------------------------------
def test_batches_are_a_pure_function_of_seed_and_step(corpus):
    first = TrainPipeline(corpus, batch_size=4, seq_len=32, seed=11, host_index=0, host_count=1)
    second = TrainPipeline(corpus, batch_size=4, seq_len=32, seed=11, host_index=0, host_count=1)
    steps = [0, 1, 5, 2, 40, 1000, 3]  # out of order, and far into later epochs
    for step in steps:
        assert _equal(first.batch_at(step), second.batch_at(step))
    reversed_batches = [second.batch_at(s) for s in reversed(steps)]
    for step, batch in zip(reversed(steps), reversed_batches):
        assert _equal(first.batch_at(step), batch)
    assert not _equal(first.batch_at(1), first.batch_at(2))
    other_seed = TrainPipeline(corpus, batch_size=4, seq_len=32, seed=12, host_index=0, host_count=1)
    assert not _equal(first.batch_at(1), other_seed.batch_at(1))
    batch = first.batch_at(7)
    assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == np.int32
    assert batch["loss_mask"].dtype == np.float32
    # Targets are the next tokens: shifted inputs within a row.
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])


@pytest.mark.parametrize("hosts", [2, 4])
def test_host_slices_concatenate_to_the_single_host_batch(corpus, hosts):
    single = TrainPipeline(corpus, batch_size=8, seq_len=16, seed=3, host_index=0, host_count=1)
    parts = [TrainPipeline(corpus, batch_size=8, seq_len=16, seed=3, host_index=h, host_count=hosts)
             for h in range(hosts)]
    for step in (0, 9, 123):
        whole = single.batch_at(step)
        pieces = [p.batch_at(step) for p in parts]
        assert all(piece["tokens"].shape == (8 // hosts, 16) for piece in pieces)
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), whole[key])


def test_host_count_must_divide_batch(corpus):
    with pytest.raises(ValueError, match="divisible"):
        TrainPipeline(corpus, batch_size=6, seq_len=16, seed=0, host_index=0, host_count=4)
    with pytest.raises(ValueError, match="host_index"):
        TrainPipeline(corpus, batch_size=8, seq_len=16, seed=0, host_index=4, host_count=4)
    pipeline = TrainPipeline(corpus, batch_size=8, seq_len=16, seed=0)  # hosts from JAX: 1 process
    assert (pipeline.host_index, pipeline.host_count) == (0, 1)
    with pytest.raises(ValueError, match="step"):
        pipeline.batch_at(-1)
    with pytest.raises(ValueError, match="fewer than one row"):
        TrainPipeline(corpus, batch_size=1, seq_len=10**8, seed=0, host_index=0, host_count=1)


def test_branch_from_step_reads_the_stable_runs_batches(corpus):
    """A stable run iterated from 0 and a decay branch started fresh at s see the same batches."""
    stable_schedule = Schedule(batch_size=4, seq_len=24, stable_steps=30, fork_steps=(10, 30),
                               decay_steps=6, warmup_steps=2, peak_lr=1e-3, seed=5)
    stable = TrainPipeline.from_schedule(corpus, stable_schedule, host_index=0, host_count=1)
    stable_batches = list(stable.iterator(0, 16, threads=2, prefetch=4))
    assert len(stable_batches) == 16
    for step, batch in enumerate(stable_batches):  # iteration order = step order
        assert _equal(batch, stable.batch_at(step))
    fork = stable_schedule.fork_steps[0]
    branch = TrainPipeline.from_schedule(corpus, stable_schedule, host_index=0, host_count=1)
    branch_batches = list(branch.iterator(fork, stable_schedule.decay_steps))
    for offset, batch in enumerate(branch_batches):
        assert _equal(batch, stable_batches[fork + offset])
    # Random access through the grain MapDataset agrees too.
    dataset = branch.dataset(fork, 4)
    assert len(dataset) == 4 and _equal(dataset[2], stable_batches[fork + 2])


def test_matched_pair_reads_identical_batches(corpus):
    """The pipeline reads only (batch, seq_len, seed) of a Schedule: LR or fork changes do not matter."""
    base = Schedule(batch_size=4, seq_len=32, stable_steps=50, fork_steps=(20,), decay_steps=5,
                    warmup_steps=5, peak_lr=3e-3, seed=9)
    other = base.replace(peak_lr=1e-4, fork_steps=(10, 50), decay_steps=7, weight_decay=0.0)
    a = TrainPipeline.from_schedule(corpus, base, host_index=0, host_count=1)
    b = TrainPipeline.from_schedule(corpus, other, host_index=0, host_count=1)
    assert all(_equal(a.batch_at(t), b.batch_at(t)) for t in range(0, 50, 7))
    c = TrainPipeline.from_schedule(corpus, base.replace(seed=10), host_index=0, host_count=1)
    assert not _equal(a.batch_at(3), c.batch_at(3))


def test_one_epoch_reads_every_row_once(corpus):
    """Rows 0..R-1 are a permutation of the epoch's stream rows: token counts match the stream's."""
    pipeline = TrainPipeline(corpus, batch_size=1, seq_len=64, seed=2, host_index=0, host_count=1)
    rows = pipeline.rows(np.arange(pipeline.rows_per_epoch))
    order, _cumulative, _ = pipeline._epoch_plan(0)
    table = pipeline.table
    stream = np.concatenate([table.arrays[table.source[d]][table.start[d]:table.start[d] + table.length[d]]
                             for d in order])
    covered = stream[:pipeline.rows_per_epoch * 64]
    np.testing.assert_array_equal(np.bincount(rows["tokens"].ravel(), minlength=512),
                                  np.bincount(covered, minlength=512))
    assert (rows["segment_ids"] > 0).all()  # the training stream never pads
    # Documents mix across sources within a batch window (the corpus has three sources).
    later = pipeline.rows(np.arange(pipeline.rows_per_epoch, pipeline.rows_per_epoch + 5))
    assert not _equal(later, pipeline.rows(np.arange(5)))  # epoch 1 is shuffled differently


def test_training_masks_are_consistent(corpus):
    pipeline = TrainPipeline(corpus, batch_size=8, seq_len=48, seed=0, host_index=0, host_count=1)
    tok = corpus.tokenizer
    for step in range(5):
        b = pipeline.batch_at(step)
        # EOS never has a target in its document; BOS always starts at position 0 of a new segment.
        assert (b["loss_mask"][b["tokens"] == tok.eos_id] == 0).all()
        assert (b["positions"][b["tokens"] == tok.bos_id] == 0).all()
        starts = b["positions"] == 0
        np.testing.assert_array_equal(starts[:, 1:], np.diff(b["segment_ids"], axis=1) == 1)
        assert (b["segment_ids"][:, 0] == 1).all()


# Validation ----------------------------------------------------------------------------------------
def test_validation_scores_every_target_once(corpus):
    sets = validation_sets(corpus, batch_size=4, seq_len=20, host_index=0, host_count=1)
    assert set(sets) == set(corpus.sources)
    for source, val in sets.items():
        part = corpus.split(source, "val")
        batches = list(val)
        assert len(batches) == val.num_batches > 0
        scored = sum(b["loss_mask"].sum() for b in batches)
        assert scored == part.tokens.size - part.num_documents  # all tokens but each EOS
        tokens = np.concatenate([b["tokens"].ravel() for b in batches])
        real = np.concatenate([(b["segment_ids"] > 0).ravel() for b in batches])
        np.testing.assert_array_equal(tokens[real], np.asarray(part.tokens))
        assert (tokens[~real] == PAD).all()
        assert _equal(val.dataset()[0], batches[0])


def test_validation_host_slices_and_truncation(corpus):
    source = corpus.sources[0]
    whole = ValidationSet(corpus, source, batch_size=4, seq_len=16, host_index=0, host_count=1)
    halves = [ValidationSet(corpus, source, batch_size=4, seq_len=16, host_index=h, host_count=2)
              for h in range(2)]
    for i in range(whole.num_batches):
        for key, value in whole.batch_at(i).items():
            np.testing.assert_array_equal(np.concatenate([h.batch_at(i)[key] for h in halves]), value)
    short = ValidationSet(corpus, source, batch_size=4, seq_len=16, host_index=0, host_count=1,
                          max_tokens=40)
    assert short.num_rows == 3 and short.num_batches == 1
    with pytest.raises(IndexError):
        short.batch_at(1)


# A prepared token store as the source ---------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_store(tmp_path_factory):
    import json

    from smelt_jax.data.hf_tokenizer import load_tokenizer
    from smelt_jax.data.prepare import PrepareConfig, prepare
    from smelt_jax.data.token_store import TokenStore

    folder = tmp_path_factory.mktemp("byte_store")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "return", "def", "x", "=", "\n"]
    for shard in range(2):
        lines = [json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(3, 200)))),
                             "source": ["code", "prose", "tables"][i % 3]}) for i in range(150)]
        (folder / f"s{shard}.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(folder / "*.jsonl")], folder / "store", load_tokenizer("bytes"), PrepareConfig(val_fraction=0.1),
            progress=False)
    return TokenStore(folder / "store")


def test_token_store_batches_equal_plain_arrays(byte_store):
    """The store's lazy token view gives the batches numpy arrays of the same documents give."""
    reference = byte_store.in_memory()  # every split read whole
    assert byte_store.tokenizer.pad_id == PAD and byte_store.sources == ("code", "prose", "tables")
    a = TrainPipeline(byte_store, batch_size=4, seq_len=48, seed=1, host_index=0, host_count=1)
    b = TrainPipeline(reference, batch_size=4, seq_len=48, seed=1, host_index=0, host_count=1)
    assert a.rows_per_epoch == b.rows_per_epoch
    for step in (0, 3, 10, 77):
        assert _equal(a.batch_at(step), b.batch_at(step))
    assert _equal(next(iter(a.iterator(5, 1))), b.batch_at(5))
    for source, val in validation_sets(byte_store, batch_size=2, seq_len=40, host_index=0,
                                       host_count=1).items():
        ref = ValidationSet(reference, source, batch_size=2, seq_len=40, host_index=0, host_count=1)
        assert len(val) == len(ref) and all(_equal(x, y) for x, y in zip(val, ref))

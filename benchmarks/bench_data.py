"""Input pipeline throughput: tokens/s of packed training batches (direct and through grain threads).

`run()` builds the default corpus if needed (idempotent, a few seconds the first time), then times
`TrainPipeline.batch_at` on consecutive steps from the token store (tensorstore reads), the same batches
from the store's documents copied into numpy arrays (the reference: no reader at all), and a grain
iterator over the store. Medians over repeated timings; the first epoch plan (two permutations of the
corpus) is timed on its own.
"""

from __future__ import annotations

import statistics
import time

CASES = ((16, 256), (8, 1024))
STEPS = 64
REPEATS = 5


def _median_seconds_per_batch(make_batches, repeats: int = REPEATS) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        count = make_batches()
        timings.append((time.perf_counter() - started) / count)
    return statistics.median(timings)


def run() -> str:
    from smelt_jax.data.corpus import build_corpus
    from smelt_jax.data.pipeline import TrainPipeline
    from smelt_jax.data.token_store import TokenStore

    result = build_corpus(progress=False)
    corpus = TokenStore(result.folder)
    in_memory = corpus.in_memory()
    lines = [(f"Data pipeline, corpus {result.manifest['corpus_version']} (a token store, "
             f"{corpus.num_tokens('train'):,} train tokens), {STEPS} steps per timing, median of {REPEATS}."),
             "",
             ("| batch x seq | first batch (epoch plan) ms | batch_at tokens/s | same from numpy arrays "
              "| store / numpy | grain iterator tokens/s | grain / direct |"),
             "|---|---:|---:|---:|---:|---:|---:|"]
    for batch, seq in CASES:
        pipeline = TrainPipeline(corpus, batch_size=batch, seq_len=seq, seed=0, host_index=0, host_count=1)
        reference = TrainPipeline(in_memory, batch_size=batch, seq_len=seq, seed=0, host_index=0,
                                  host_count=1)
        started = time.perf_counter()
        pipeline.batch_at(0)
        first_ms = 1e3 * (time.perf_counter() - started)

        def direct(pipeline=pipeline) -> int:
            for step in range(1, STEPS + 1):
                pipeline.batch_at(step)
            return STEPS

        reference.batch_at(0)

        def through_grain(pipeline=pipeline) -> int:
            return sum(1 for _ in pipeline.iterator(1, STEPS, threads=2, prefetch=8))

        tokens = batch * seq
        direct_rate = tokens / _median_seconds_per_batch(direct)
        numpy_rate = tokens / _median_seconds_per_batch(lambda reference=reference: direct(reference))
        grain_rate = tokens / _median_seconds_per_batch(through_grain)
        lines.append(f"| {batch} x {seq} | {first_ms:.1f} | {direct_rate:,.0f} | {numpy_rate:,.0f} "
                     f"| {direct_rate / numpy_rate:.2f} | {grain_rate:,.0f} | {grain_rate / direct_rate:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())

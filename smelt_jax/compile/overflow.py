"""How many times the MoE exchange's overflow loop runs per layer: expected (from measured load) and worst.

    overflow_passes(tokens_local=16384, top_k=8, experts_local=36, expert_shards=8, slack=1.5,
                    load=2.20) -> 2          (load=math.inf: the worst case, 18)
    expected_overflow_passes(same, slack=1.5) -> 0.45  (the mean over MEASURED_LOADS)
    step_overflow_passes(run, layout) -> (expected, worst) for a run's train step under `layout`

The first pass of the exchange (`model/expert_exchange.py`) moves C rows per destination block
(`moe_buffers.rows_per_destination`); rows past C go in overflow passes of C_o rows
(`moe_buffers.overflow_rows`), in a loop that runs as many passes as the fullest block of any device
needs. Its trip count is data-dependent, so the compiled program does not state it: the HBM walk
(`hbm_traffic`) charges it `overflow_trips` times. With the fullest block holding `load` x the
balanced T_l k / n rows, that is ceil((load T_l k / n - C) / C_o) passes (0 when C holds it); the worst
case is every copy of a device's tokens going to one destination, T_l min(k, E_l) rows.

The expected passes per layer are the mean of that count over `MEASURED_LOADS`: the fullest block's
ratio to the balanced one, per (group of 131,072 tokens, executed layer), of the two trained routers
nearest production's (`python -m benchmarks.moe_load --trained RUN 2`, docs/moe-buffers.md): nano2's
d96gqa gqa4 pair, top-4 of 230 (SMELT) and 96 (Baseline) experts, n = 8 devices, 16,384-token
shards (production's T_l), decay branch 2's endpoint (977 steps). smelt16 routes top-8 over
1-63 experts a device (8-504 experts); the trained top-2 routers measured beside them were less balanced
(1.68-1.85 on average), and micro's early in training (72 experts, top-2, steps 67-200; the load
used before, 2.20) less still.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from smelt_jax.model.moe_buffers import overflow_rows, rows_per_destination, worst_case_rows

MEASURED_LOADS = (  # block ratios, n = 8: nano2-d96gqa-s95-smelt-gqa4 (12), then its Baseline (8)
    1.506, 1.343, 1.344, 1.501, 1.500, 1.589, 1.528, 1.319, 1.356, 1.522, 1.532, 1.597,
    1.311, 1.571, 1.484, 1.390, 1.324, 1.622, 1.498, 1.364)


def overflow_passes(tokens_local: int, top_k: int, experts_local: int, expert_shards: int,
                    slack: float | None, load: float) -> int:
    """Overflow passes when the fullest block holds `load` x T_l k / n rows (math.inf: the worst case)."""
    first = rows_per_destination(tokens_local, top_k, experts_local, expert_shards, slack)
    extra = overflow_rows(first, tokens_local, top_k, experts_local)
    if not extra:
        return 0
    worst = worst_case_rows(tokens_local, top_k, experts_local)
    fullest = worst if math.isinf(load) else min(worst, math.ceil(load * tokens_local * top_k / expert_shards))
    return -(-max(fullest - first, 0) // extra)


def expected_overflow_passes(tokens_local: int, top_k: int, experts_local: int, expert_shards: int,
                             slack: float | None, loads=MEASURED_LOADS) -> float:
    """The mean of `overflow_passes` over the measured per-layer loads, rounded to 1e-3."""
    passes = [overflow_passes(tokens_local, top_k, experts_local, expert_shards, slack, load) for load in loads]
    return round(sum(passes) / len(passes), 3)


def step_overflow_passes(run, layout: dict[str, int], loads=MEASURED_LOADS) -> tuple[float, int]:
    """(expected, worst) overflow passes per MoE layer of `run`'s train step on a mesh of `layout`
    ({'data', 'fsdp', 'expert', 'tensor'} sizes); expected: the mean over `loads`. Without expert
    parallelism there is no overflow loop: (1, 1), so a loop of unknown length the program may hold is
    charged once, as the walk did before."""
    from smelt_jax.model.expert_exchange import token_axes

    shards = layout.get("expert", 1)
    cfg = run.model
    if shards <= 1 or not cfg.n_experts:
        return 1, 1
    token_shards = math.prod(layout[a] for a in token_axes(SimpleNamespace(shape=layout)))
    tokens_local = -(-run.schedule.tokens_per_step // token_shards)
    args = (tokens_local, cfg.top_k, cfg.n_experts // shards, shards, cfg.expert_buffer_slack)
    return expected_overflow_passes(*args, loads=loads), overflow_passes(*args, load=math.inf)

"""How many times the MoE exchange's overflow loop runs per layer: expected (from measured load) and worst.

    overflow_passes(tokens_local=16384, top_k=8, experts_local=36, expert_shards=8, slack=1.5,
                    load=2.20) -> 2          (load=math.inf: the worst case, 18)
    step_overflow_passes(run, layout) -> (expected, worst) for a run's train step under `layout`

The first pass of the exchange (`model/expert_exchange.py`) moves C rows per destination block
(`moe_buffers.rows_per_destination`); rows past C go in overflow passes of C_o rows
(`moe_buffers.overflow_rows`), in a loop that runs as many passes as the fullest block of any device
needs. Its trip count is data-dependent, so the compiled program does not state it: the HBM walk
(`hbm_traffic`) charges it `overflow_trips` times. With the fullest block holding `load` x the
balanced T_l k / n rows, that is ceil((load T_l k / n - C) / C_o) passes (0 when C holds it); the worst
case is every copy of a device's tokens going to one destination, T_l min(k, E_l) rows.

`MEASURED_LOAD` is the only routing load measured so far (docs/moe-buffers.md, `benchmarks/moe_load.py`):
micro-xs S95 SMELT, steps 67-200, n = 8 device groups, the busiest device's rows over the mean, 2.20 on
average (the block ratio, 3.25, adds the sampling noise of 64-row blocks, ~1% at production's 16,384).
It is a micro model's routing early in training (72 experts, top-2); the 100M-1.6B models route 8 of
96-504 experts, so their load is likely lower and the expected passes fewer.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from smelt_jax.model.moe_buffers import overflow_rows, rows_per_destination, worst_case_rows

MEASURED_LOAD = 2.20


def overflow_passes(tokens_local: int, top_k: int, experts_local: int, expert_shards: int,
                    slack: float | None, load: float = MEASURED_LOAD) -> int:
    """Overflow passes when the fullest block holds `load` x T_l k / n rows (math.inf: the worst case)."""
    first = rows_per_destination(tokens_local, top_k, experts_local, expert_shards, slack)
    extra = overflow_rows(first, tokens_local, top_k, experts_local)
    if not extra:
        return 0
    worst = worst_case_rows(tokens_local, top_k, experts_local)
    fullest = worst if math.isinf(load) else min(worst, math.ceil(load * tokens_local * top_k / expert_shards))
    return -(-max(fullest - first, 0) // extra)


def step_overflow_passes(run, layout: dict[str, int], load: float = MEASURED_LOAD) -> tuple[int, int]:
    """(expected, worst) overflow passes per MoE layer of `run`'s train step on a mesh of `layout`
    ({'data', 'fsdp', 'expert', 'tensor'} sizes). Without expert parallelism there is no overflow loop:
    (1, 1), so a loop of unknown length the program may hold is charged once, as the walk did before."""
    from smelt_jax.model.expert_exchange import token_axes

    shards = layout.get("expert", 1)
    cfg = run.model
    if shards <= 1 or not cfg.n_experts:
        return 1, 1
    token_shards = math.prod(layout[a] for a in token_axes(SimpleNamespace(shape=layout)))
    tokens_local = -(-run.schedule.tokens_per_step // token_shards)
    args = (tokens_local, cfg.top_k, cfg.n_experts // shards, shards, cfg.expert_buffer_slack)
    return overflow_passes(*args, load=load), overflow_passes(*args, load=math.inf)

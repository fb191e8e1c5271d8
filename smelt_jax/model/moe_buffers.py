"""How many rows the expert-parallel exchange's buffers hold: sized by the expected load, not the worst case.

Inside the MoE shard_map (`model/expert_exchange.py`) each device holds T_l tokens with k copies each and
E_l = E / n experts (n = size of the `expert` axis). It sends its copies to the n devices in n blocks of C
rows and receives n blocks of C rows, which the grouped matmul reads as one [n * C, d] operand.

- Worst case (`slack=None`): C = T_l * min(k, E_l), every copy a device could send to one destination (a
  token picks distinct experts, so at most min(k, E_l) of its copies go to one device). Always enough,
  but when E_l >= k only 1 / n of the rows carry a token.
- Sized by load (`slack` s): C = round_up(s * T_l * k / n, tile), capped at the worst case. T_l * k / n
  is what a destination receives from one source when routing is balanced; `slack` covers imbalance.
  Copies past C are not dropped: the exchange runs overflow passes for them (`overflow_rows`).

Tile: 128 rows when the buffer is at least that large. n * C is then a multiple of the grouped
matmul's 512-row tile for n >= 4 (kernels/gmm.py DEFAULT_TILING: no padding copy), and of the 8 / 16
sublane rows of f32 / bf16 TPU tiles. Smaller buffers (tests, micro models) round to 8, so a tile does
not swamp the load they are sized for.
"""

from __future__ import annotations

import math

ROW_TILE = 128
SMALL_ROW_TILE = 8
# Overflow passes hold this share of C per destination (rounded up to the tile): small, because they
# normally run 0 times, and the compiled program's HBM walk charges a loop of unknown trip count once.
OVERFLOW_SHARE = 0.25


def round_up(value: float, tile: int) -> int:
    return max(tile, -(-math.ceil(value) // tile) * tile)


def worst_case_rows(tokens_local: int, top_k: int, experts_local: int) -> int:
    """T_l * min(k, E_l): the most copies one device can send to one destination."""
    return tokens_local * min(top_k, experts_local)


def _tiled(rows: float) -> int:
    return round_up(rows, ROW_TILE if rows >= ROW_TILE else SMALL_ROW_TILE)


def rows_per_destination(tokens_local: int, top_k: int, experts_local: int, expert_shards: int,
                         slack: float | None) -> int:
    """C: rows per destination block of the first pass. None: the worst case (no overflow possible)."""
    worst = worst_case_rows(tokens_local, top_k, experts_local)
    if slack is None:
        return worst
    return min(worst, _tiled(slack * tokens_local * top_k / expert_shards))


def overflow_rows(first_rows: int, tokens_local: int, top_k: int, experts_local: int) -> int:
    """Rows per destination block of each overflow pass (0: the first pass holds the worst case)."""
    left = worst_case_rows(tokens_local, top_k, experts_local) - first_rows
    return 0 if left <= 0 else min(left, _tiled(OVERFLOW_SHARE * first_rows))


def buffer_fill(top_k: int, n_experts: int, expert_shards: int, tokens_local: int | None = None,
                slack: float | None = None) -> float:
    """Expected share of the first pass's receive rows [n * C] that carry a token copy: T_l * k / (n * C).
    With tokens_local None (or slack None) the worst-case C: k / (n * min(k, E / n)), 1 when E / n = 1 and
    1 / n whenever E / n >= k. Pallas kernels skip the empty rows; their cost estimate cannot."""
    experts_local = n_experts // expert_shards
    if tokens_local is None or slack is None:
        return top_k / (expert_shards * min(top_k, experts_local))
    rows = rows_per_destination(tokens_local, top_k, experts_local, expert_shards, slack)
    return min(1.0, tokens_local * top_k / (expert_shards * rows))

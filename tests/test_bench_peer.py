"""The goal verdicts of benchmarks/bench_peer.py: a median over paired rounds with a distribution-free
interval, and 'yes' / 'no' only when the whole interval is on one side of the goal."""

import math
import types

import pytest

from benchmarks import bench_peer as bp


def _coverage(n: int, k: int) -> float:
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n


@pytest.mark.parametrize("n, k", [(5, 1), (7, 1), (9, 2), (11, 3), (21, 7)])
def test_median_interval_takes_the_innermost_order_statistics_that_cover_the_level(n, k):
    values = [float(v) for v in range(n, 0, -1)]  # unsorted on purpose
    lo, hi, cover = bp.median_interval(values, level=0.9)
    assert (lo, hi) == (float(k), float(n - k + 1))
    assert cover == pytest.approx(_coverage(n, k)) and cover >= 0.9
    assert _coverage(n, k + 1) < 0.9  # one step further in would cover less than asked


def test_median_interval_with_too_few_rounds_says_how_little_it_covers():
    lo, hi, cover = bp.median_interval([1.2, 1.0, 1.1], level=0.9)
    assert (lo, hi) == (1.0, 1.2) and cover == pytest.approx(0.75)
    assert math.isnan(bp.median_interval([])[0])


def test_verdict_needs_the_whole_interval_on_one_side():
    assert bp.verdict(1.05, 1.14, 1.15, at_most=True) == "yes"
    assert bp.verdict(1.16, 1.40, 1.15, at_most=True) == "no"
    assert bp.verdict(1.10, 1.20, 1.15, at_most=True) == "not resolved"
    assert bp.verdict(1.5, 1.9, 1.5, at_most=False) == "yes"
    assert bp.verdict(0.8, 1.1, 1.5, at_most=False) == "no"
    assert bp.verdict(1.3, 1.7, 1.5, at_most=False) == "not resolved"


def _cand(name, group, times, note="", tokens=4096, flops=1.0):
    c = bp.Candidate(group, name, tokens, flops, None, cfg=types.SimpleNamespace(seq_len=256), note=note)
    c.times = list(times)
    return c


def test_tables_judge_pairs_and_the_peer_on_paired_rounds():
    """A pair whose every round is over the goal says no; one that straddles it says not resolved; ours
    twice as fast as the peer in every round says yes against 1.5x."""
    base = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 0.95]
    cands = [
        _cand("transformers MixtralForCausalLM, experts `grouped_mm`", "peer table", [2 * t for t in base]),
        _cand("ours `auto`", "peer table", base),
        _cand("b", "pair", base, "slow/baseline"), _cand("s", "pair", [1.3 * t for t in base], "slow/smelt"),
        _cand("b", "pair", base, "close/baseline"),
        _cand("s", "pair", [t * r for t, r in zip(base, (1.0, 1.3, 1.1, 1.2, 1.05, 1.25, 1.12))], "close/smelt"),
    ]
    text = bp.tables(cands, [], "")
    assert "**2.00x**" in text and "goal >= 1.5x: yes" in text
    assert "not measured" in bp.peer_line(cands[1], None)
    rows = {r.split("|")[1].strip(): r for r in bp.pair_table(cands).splitlines() if r.startswith("| ")}
    assert rows["slow"].rstrip(" |").endswith("no") and "**1.30**" in rows["slow"]
    assert rows["close"].rstrip(" |").endswith("not resolved")

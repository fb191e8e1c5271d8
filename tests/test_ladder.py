"""The `ladder` suite (issue 51) and its registered predictions (docs/results-ladder.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments import ladder, nano
from smelt_jax.design.matching import Tolerances, mismatch
from smelt_jax.scaling import ladder as predictions

REPO = Path(__file__).resolve().parents[1]
NANO = REPO / "fits" / "nano" / "results.csv"


def test_head_size_rule_gives_nanos_widths_and_rates_extend_the_rule():
    assert {w: nano.head_size(w) for w in nano.WIDTHS} == nano.WIDTHS
    assert nano.lr_rule(nano.LR_BEST) == nano.PEAK_LR
    assert [ladder.peak_lr(a, w) for a in ("baseline", "smelt") for w in (128, 160)] == [1.1e-3, 9e-4, 2.3e-3, 1.8e-3]
    assert ladder.peak_lr("unrolled", 96) == ladder.peak_lr("smelt", 96) == 3e-3


def test_runs_in_the_registered_order_and_matched():
    runs = ladder.build()
    assert [(r.scale, r.arch) for r in runs[:6]] == [("d96", "baseline"), ("d96", "smelt"), ("d160", "baseline"),
                                                    ("d160", "smelt"), ("d128", "baseline"), ("d128", "smelt")]
    assert len({r.id for r in runs}) == len(runs) == 19
    for run in runs:
        tol = Tolerances(flops=0.06) if "gqa" in run.scale else Tolerances()
        gaps = mismatch(ladder.reference_for(run), run.model)
        assert abs(gaps["flops"]) <= tol.flops and abs(gaps["kv"]) <= tol.kv
        if run.arch != "unrolled":
            assert abs(gaps["params"]) <= tol.params
    # A's seed runs train the d96 re-run's models; the re-run is nano's d96 pair (same model and schedule)
    d96 = {r.arch: r for r in runs if r.pair_id == "ladder-d96"}
    for run in runs:
        if run.pair_id.startswith("ladder-d96-seed") and run.arch != "unrolled":
            assert run.model == d96[run.arch].model and run.schedule.seed in (1, 2)
    for arch in ("baseline", "smelt"):
        nano_run = next(r for r in nano.build() if r.pair_id == "nano-d96-s95" and r.arch == arch)
        assert (nano_run.model, nano_run.schedule) == (d96[arch].model, d96[arch].schedule)


@pytest.fixture(scope="module")
def gaps():
    return predictions.matched_gaps(pd.read_csv(NANO))


def test_registered_coefficients_are_the_fits_of_nanos_endpoints(gaps):
    """The coefficients docs/results-ladder.md registers, to the digits it prints."""
    assert len(gaps) == 15 and gaps["pair_id"].nunique() == 5
    np.testing.assert_allclose(predictions.fit_form("log-linear", gaps), [1.892, -0.1380], atol=6e-4)
    np.testing.assert_allclose(predictions.fit_form("power", gaps), [8.984, -0.7751], atol=6e-4)
    np.testing.assert_allclose(predictions.fit_form("width+tokens", gaps), [1.362, -0.1739, -0.0275], atol=6e-4)


def test_forms_recover_a_known_line_and_the_bootstrap_is_reproducible():
    flops = np.repeat([1e6, 2e6, 4e6], 3)
    tokens = np.tile([4e6, 7e6, 1e7], 3)
    table = pd.DataFrame({"pair_id": np.repeat(["a", "b", "c"], 3), "flops": flops, "tokens": tokens,
                          "gap": 1.5 - 0.1 * np.log10(flops * tokens)})
    np.testing.assert_allclose(predictions.fit_form("log-linear", table), [1.5, -0.1], atol=1e-12)
    assert predictions.break_even_10m("log-linear", np.array([1.5, -0.1])) == pytest.approx(1e15)
    assert predictions.break_even_10m("power", np.array([1.0, -0.5])) == np.inf
    points = pd.DataFrame({"label": ["p"], "flops": [8e6], "tokens": [1e7]})
    one = predictions.bootstrap(table, points, n_draws=200)
    assert one.equals(predictions.bootstrap(table, points, n_draws=200))
    exact = one[(one["form"] == "log-linear") & (one["point"] == "p")].iloc[0]
    assert exact["low"] == pytest.approx(exact["high"]) == pytest.approx(1.5 - 0.1 * np.log10(8e13))


def test_paper_break_even_lies_where_its_gap_changes_sign():
    first, last = predictions.paper_break_even(3.6)
    assert 1e19 < first < 1e20 < last
    for compute, sign in ((first / 2, 1), (first * 2, -1)):
        flops = np.sqrt(compute / 3.6)
        gap = predictions.paper_gap(flops, 0.937, flops, 0.937, compute / flops)
        assert np.sign(gap) == sign


def _rows(pair, arch, losses, horizons=(4e6, 7e6, 10e6)):
    return [{"run_id": f"{pair}-{arch}", "branch": i, "pair_id": pair, "arch": arch, "scale": "d",
             "flops_per_token": 1e6, "tokens": int(h), "val_loss": v} for i, (h, v) in enumerate(zip(horizons, losses))]


def test_standing_trend_and_drift_follow_the_registered_rules():
    rows = (_rows("ladder-d96", "baseline", [1.30, 1.20, 1.10]) + _rows("ladder-d96", "smelt", [1.33, 1.22, 1.12])
            + _rows("ladder-d128", "baseline", [1.25, 1.15, 1.05]) + _rows("ladder-d128", "smelt", [1.25, 1.16, 1.04])
            + _rows("ladder-d160", "baseline", [1.20, 1.10, 1.00]) + _rows("ladder-d160", "smelt", [1.18, 1.08, 0.99]))
    table = pd.DataFrame(rows)
    verdicts = dict(zip(predictions.standing(table)["width"], predictions.standing(table)["verdict"]))
    # d96: gaps +0.03/+0.02/+0.02 > delta -> trails; d128: 0/+0.01/-0.01 -> tie; d160: -0.02/-0.02/-0.01 -> wins
    assert verdicts == {96: "SMELT trails", 128: "tie", 160: "SMELT wins"}
    _, shrinks = predictions.trend(table)
    assert shrinks == "supported"  # d160 - d96: -0.05, -0.04, -0.03 at all three
    nano = pd.DataFrame(_rows("nano-d96-s95", "baseline", [1.30, 1.20, 1.10])
                        + _rows("nano-d96-s95", "smelt", [1.33, 1.22, 1.12]))
    drift = predictions.pair_drift(table, nano)
    assert np.allclose(drift["drift"], 0) and predictions.drift_verdict(drift) == ("not supported", predictions.DELTA)
    moved = nano.assign(val_loss=nano["val_loss"] - np.where(nano["arch"] == "smelt", 0.02, 0.0))
    word, delta = predictions.drift_verdict(predictions.pair_drift(table, moved))
    assert word == "supported" and delta == pytest.approx(predictions.DELTA + 0.02)
    assert predictions.standing(table.iloc[:0])["verdict"].tolist() == ["pending"] * 3


def test_seed_verdicts_use_a_t_interval_over_seeds():
    def seeds(loop, reshape):
        return pd.DataFrame({"seed": [0, 1, 2], "loop": loop, "reshape": reshape})
    out = predictions.seed_verdicts(seeds([0.010, 0.012, 0.011], [0.030, 0.028, 0.032]))
    assert out["looping"].startswith("costs: supported (small: below delta)")
    assert out["reshaping"].startswith("costs: supported (mean +0.0300")
    assert out["the larger term"].startswith("reshaping larger")
    out = predictions.seed_verdicts(seeds([0.002, -0.003, 0.001], [0.05, -0.04, 0.01]))
    assert out["looping"].startswith("negligible") and out["reshaping"].startswith("not resolved")
    mean, low, high = predictions.seed_interval([1.0, 2.0, 3.0])
    assert (mean, high - mean) == pytest.approx((2.0, 4.303 / np.sqrt(3)))

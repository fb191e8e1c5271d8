"""The `nano` design (issue 25): the spans it promises hold, its pairs are matched, its schedule decays each
branch over 5% of its horizon, and the learning-rate rule is the one docs/nano.md writes down."""

import math

import pytest

from experiments import load_suite, nano
from smelt_jax.design import budget as B
from smelt_jax.design.config import ConfigError, Schedule
from smelt_jax.design.matching import Tolerances, mismatch
from smelt_jax.train.lr import learning_rate, phase_steps


def _runs():
    return load_suite("nanolr")


def test_widths_span_six_fold_in_flops_and_pairs_are_matched():
    flops = {}
    tol = Tolerances()
    for width in nano.WIDTHS:
        base, smelt = nano.baseline_config(width), nano.smelt_config(width)
        flops[width] = B.train_flops_per_token(base)
        gaps = mismatch(base, smelt)
        assert abs(gaps["flops"]) <= tol.flops and abs(gaps["params"]) <= tol.params
        assert abs(gaps["kv"]) <= tol.kv
        assert smelt.loop_start == 1 and smelt.loop_length == 2 and smelt.loop_repeats == 2
        assert base.n_experts == 48 and base.top_k == 2
        assert 0.93 <= B.budget(base, control=nano.control(base)).sparsity <= 0.96
    assert max(flops.values()) / min(flops.values()) >= 6


def test_schedule_horizons_warmup_and_tokens_per_parameter():
    sched = nano.schedule(1e-3)
    assert sched.warmup_steps >= 50 and sched.warmup_steps <= sched.fork_steps[0]
    tokens = [sched.branch_tokens(k) for k in range(len(sched.fork_steps))]
    assert tokens == sorted(tokens) and tokens[-1] / tokens[0] >= 10
    for k, horizon in enumerate(nano.HORIZONS):
        assert abs(tokens[k] - horizon) / horizon < 0.01  # each branch ends at its stated horizon
        decay = sched.branch_decay_steps(k)
        assert abs(decay / sched.branch_end_step(k) - nano.DECAY_FRACTION) < 0.01
    assert sched.stable_steps * sched.tokens_per_step >= 9e6
    tpp = [d / (B.train_flops_per_token(nano.baseline_config(w)) / 6) for w in nano.WIDTHS
           for d in (tokens[0], tokens[-1])]
    assert min(tpp) < 1 and max(tpp) > 80  # tokens per active parameter ~1-100 (docs/nano.md)


def test_decay_fraction_schedule_lr_reaches_the_floor_at_each_branch_end():
    sched = nano.schedule(4e-3)
    for k in range(len(sched.fork_steps)):
        first, end = phase_steps(sched, k)
        assert end - first == sched.branch_decay_steps(k)
        assert learning_rate(sched, first, k) < sched.peak_lr
        assert learning_rate(sched, end - 1, k) == pytest.approx(sched.peak_lr * sched.final_lr_fraction)
    assert sched.executed_steps == sched.stable_steps + sum(
        sched.branch_decay_steps(k) for k in range(len(sched.fork_steps)))


@pytest.mark.parametrize("steps, fraction", [(0, 0.0), (10, 0.05), (0, 1.0), (-1, 0.0)])
def test_schedule_needs_exactly_one_decay_rule(steps, fraction):
    with pytest.raises(ConfigError):
        Schedule(batch_size=2, seq_len=8, stable_steps=10, fork_steps=(5, 10), decay_steps=steps,
                 decay_fraction=fraction, warmup_steps=1, peak_lr=1e-3)


def test_fixed_decay_schedules_keep_their_ids_and_dicts():
    """decay_fraction is absent from a fixed-decay schedule's dict, so every older id stays valid."""
    sched = Schedule(batch_size=2, seq_len=8, stable_steps=10, fork_steps=(5, 10), decay_steps=3,
                     warmup_steps=1, peak_lr=1e-3)
    assert "decay_fraction" not in sched.to_dict() and sched.branch_decay_steps(1) == 3
    assert Schedule.from_dict(sched.to_dict()) == sched
    fractional = nano.schedule(1e-3)
    assert Schedule.from_dict(fractional.to_dict()) == fractional


def test_lr_sweep_covers_the_grid_at_two_widths_per_arch():
    runs = _runs()
    assert len(runs) == 2 * len(nano.LR_WIDTHS) * len(nano.LR_GRID) + len(nano.LR_EXTENSION)
    assert len({r.id for r in runs}) == len(runs)
    for run in runs:
        assert run.schedule.branch_tokens(0) == pytest.approx(nano.LR_HORIZON, rel=0.01)
        assert run.variant == nano.lr_variant(run.schedule.peak_lr) and run.tokenizer == "bytes"


def test_lr_rule_interpolates_a_power_law_between_the_measured_widths():
    best = {("baseline", 24): 1.2e-2, ("baseline", 96): 3e-3, ("smelt", 24): 6e-3, ("smelt", 96): 6e-3}
    rule = nano.lr_rule(best)
    for key, value in best.items():
        assert rule[key] == pytest.approx(value)
    slope = math.log(3e-3 / 1.2e-2) / math.log(4)  # -1
    assert rule["baseline", 40] == pytest.approx(float(f"{1.2e-2 * (40 / 24) ** slope:.2g}"))
    assert rule["smelt", 64] == 6e-3


def test_peak_rates_are_the_rule_applied_to_the_committed_sweep():
    """PEAK_LR is what the pre-registered rule gives on fits/nano/lr_sweep.csv (best = lowest loss)."""
    import pandas as pd
    from pathlib import Path
    table = pd.read_csv(Path(__file__).parents[1] / "fits" / "nano" / "lr_sweep.csv")
    assert len(table) == len(_runs()) and set(table["run_id"]) == {r.id for r in _runs()}
    best = {(arch, int(width)): float(group.loc[group["val_loss"].idxmin(), "peak_lr"])
            for (arch, width), group in table.groupby(["arch", "width"])}
    assert best == nano.LR_BEST
    assert nano.PEAK_LR == nano.lr_rule(best)
    assert len(nano.build()) == 2 * len(nano.WIDTHS) + 2

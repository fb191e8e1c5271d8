"""Pair costs in chip-hours from the compile report (smelt_jax/compile/pair_cost.py) and the generated
table of docs/tpu-quickstart.md."""

import dataclasses
import re

import pytest

import experiments
from smelt_jax.compile import layout_search as ls
from smelt_jax.compile import pair_cost
from smelt_jax.design import paper
from smelt_jax.compile import report as cr
from smelt_jax.design.budget import train_flops_per_token
from smelt_jax.platform.paths import checkout_root

SMELT16 = experiments.load_suite("smelt16")
QUICKSTART = checkout_root() / "docs" / "tpu-quickstart.md"


def _result(run, step, slice_name="v5p-128", status="fits"):
    report = cr.CompileReport(run_id=run.id, slice=slice_name, layout={}, remat="none", expert_impl="pallas",
                              peak_fits_hbm=status == "fits", error=None, compile_seconds=1.0,
                              argument_bytes=0, output_bytes=0, temp_bytes=0, peak_bytes=0, hbm_bytes=1,
                              compiled_flops=0.0, budget_flops=0.0, optimal_seconds=-1.0, collectives={},
                              step_seconds=step)
    return ls.SearchResult(key="", run_id=run.id, slice=slice_name, chosen=None, report=report, tried=(),
                           status=status)


def _pair(scale, label):
    return [next(r for r in SMELT16 if (r.scale, r.sparsity_label, r.arch) == (scale, label, arch))
            for arch in ("baseline", "smelt")]


def test_a_run_executes_its_stable_phase_and_every_branch():
    schedule = _pair("200m", "s97")[0].schedule
    assert schedule.executed_steps == 196_075 + 6 * 9_537 == 253_297  # docs/tpu-quickstart.md section 0


def test_chip_hours_of_a_run_and_of_what_did_not_fit():
    baseline, smelt = _pair("200m", "s97")
    assert pair_cost.chip_hours(baseline, _result(baseline, 0.5)) == pytest.approx(0.5 * 253_297 * 64 / 3600)
    assert pair_cost.chip_hours(smelt, _result(smelt, 0.5, "v5p-512")) == pytest.approx(0.5 * 253_297 * 256 / 3600)
    assert pair_cost.chip_hours(smelt, _result(smelt, 0.5, status="does not fit")) is None
    assert pair_cost.chip_hours(smelt, _result(smelt, None)) is None  # no roofline: no cost claimed


def test_cost_table_rows_and_total_count_only_whole_pairs():
    (b1, s1), (b2, s2) = _pair("100m", "s0"), _pair("200m", "s85")
    table = pair_cost.cost_table([b1, s1, b2, s2], [_result(b1, 0.1), _result(s1, 0.3), _result(b2, 0.2),
                                                    _result(s2, 0.4, status="not compiled (budget)")])
    hours = (0.1 + 0.3) * 253_297 * 64 / 3600
    assert f"| 100M S0 | v5p-128 (64) | 0.10 / 0.30 | {hours:,.0f} |" in table
    assert "| 200M S85 | v5p-128 (64) | - | - (smelt: not compiled (budget)) |" in table
    assert f"| **all (1 of 2 pairs)** | | | **{hours:,.0f}** |" in table


def test_the_quickstart_table_is_the_formula_of_its_own_steps():
    """Each generated row's chip-hours is (Baseline + SMELT step) x 253,297 x chips / 3600 (up to the
    steps' rounding to 0.01 s), and the total is the rows' sum."""
    doc = QUICKSTART.read_text()
    assert doc.count(pair_cost.BEGIN) == 1 and doc.count(pair_cost.END) == 1
    section = doc.split(pair_cost.BEGIN)[1].split(pair_cost.END)[0]
    rows = re.findall(r"^\| (\S+ S\d+) \| \S+ \((\d+)\) \| ([\d.]+) / ([\d.]+) \| ([\d,]+) \| [\d,]+ \|$", section, re.M)
    assert len(rows) == 16, section
    for name, chips, b, s, hours in rows:
        per_step = 253_297 * int(chips) / 3600
        assert abs(float(hours.replace(",", "")) - (float(b) + float(s)) * per_step) <= 0.01 * per_step + 1, name
    total = re.search(r"\| \*\*all\*\* \| \| \| \*\*([\d,]+)\*\* \| \*\*[\d,]+\*\* \|", section)
    assert total, section
    assert abs(int(total.group(1).replace(",", "")) - sum(int(h.replace(",", "")) for *_, h in rows)) <= 16


def test_price_per_budget_flop_and_the_paper_savings_priced_in_chip_hours():
    """chip-s per PFLOP = step x chips / (F x batch tokens) x 1e15; the SMELT / Baseline price ratio per
    pair; the paper's 7.8% FLOP saving at (1e20, 0.95) at a price ratio of 1.3 is a chip-hour loss."""
    from smelt_jax.design.budget import train_flops_per_token

    b, s = _pair("100m", "s95")
    per_step = lambda run: train_flops_per_token(run.model) * run.schedule.batch_size * run.schedule.seq_len
    assert pair_cost.chip_seconds_per_pflop(b, _result(b, 0.2)) == pytest.approx(0.2 * 64 / per_step(b) * 1e15)
    assert pair_cost.chip_seconds_per_pflop(b, _result(b, 0.2, status="does not fit")) is None
    s_step = 1.3 * 0.2 * per_step(s) / per_step(b)  # a SMELT step that costs 1.3x per budget FLOP
    rows = pair_cost.step_ratios([b, s], [_result(b, 0.2), _result(s, s_step)])
    assert len(rows) == 1 and rows[0]["ratio"] == pytest.approx(1.3)
    assert pair_cost.chip_hour_saving(0.078, 1.3) == pytest.approx(1 - 0.922 * 1.3)
    assert pair_cost.chip_hour_saving(0.2, 1.0) == pytest.approx(0.2)
    table = pair_cost.price_table([b, s], [_result(b, 0.2), _result(s, s_step)], paper.CE_GAIN)
    assert "| 100M S95 |" in table and "| 1.30 |" in table
    assert "| 1e+20 | 0.95 | 7.8% [3, 15] | 1.30 [1.30, 1.30] | -19.9% [-19.9%, -19.9%] |" in table
    assert "| 1e+20 | 0.85 |" not in table  # no S85 pair priced: no row


MESH = {"data": 1, "fsdp": 8, "expert": 8, "tensor": 1}


def test_the_pair_at_its_physical_limit_uses_each_members_ideal_step():
    """The cost table's last column: both members at their per-op limit (compile/ideal_step.py) on
    their slice and mesh; the price table's ratio at the limit: floor and per-op limit per budget FLOP."""
    from smelt_jax.compile.ideal_step import for_run

    b, s = _pair("100m", "s95")
    results = [_result(b, 0.12), _result(s, 0.14)]
    for result in results:
        result.report.layout.update(MESH)
    ideal_b, ideal_s = for_run(b, "v5p-128", MESH), for_run(s, "v5p-128", MESH)
    limit = (ideal_b.per_op_seconds + ideal_s.per_op_seconds) * 253_297 * 64 / 3600
    assert pair_cost.limit_chip_hours(b, results[0]) == pytest.approx(ideal_b.per_op_seconds * 253_297 * 64 / 3600)
    table = pair_cost.cost_table([b, s], results)
    hours = (0.12 + 0.14) * 253_297 * 64 / 3600
    assert f"| 100M S95 | v5p-128 (64) | 0.12 / 0.14 | {hours:,.0f} | {limit:,.0f} |" in table
    row = pair_cost.step_ratios([b, s], results)[0]
    flops = lambda run: train_flops_per_token(run.model)
    assert row["limit_ratio"] == pytest.approx(ideal_s.per_op_seconds / flops(s) / (ideal_b.per_op_seconds / flops(b)))
    assert row["floor_ratio"] == pytest.approx(ideal_s.floor_seconds / flops(s) / (ideal_b.floor_seconds / flops(b)))
    # each member against its limit: walked step, per-op limit and their quotient
    members = pair_cost.limit_table([b, s], results)
    assert f"| {1e3 * ideal_s.per_op_seconds:,.0f} | 140 | {ideal_s.per_op_seconds / 0.14:.0%} |" in members


def test_a_pair_is_held_above_its_limit_by_what_smelt_walks_beyond_the_baselines_excess():
    """held_by: per category, SMELT's walked GB above its ideal less the Baseline's (per budget FLOP);
    an excess both members share cancels, the rest is named, largest first."""
    from smelt_jax.compile.ideal_step import for_run

    b, s = _pair("100m", "s95")
    ideal_b, ideal_s = for_run(b, "v5p-128", MESH), for_run(s, "v5p-128", MESH)
    extra = [{"other": 2e9}, {"other": 2e9, "copies": 10e9, "residual stacks": 1e9}]
    results = []
    for run, step, ideal, more in zip((b, s), (0.12, 0.14), (ideal_b, ideal_s), extra):
        result = _result(run, step)
        walked = {c: v + more.get(c, 0.0) for c, v in ideal.by_category.items()}
        # equal budgets per device: the two excesses compare 1:1
        report = dataclasses.replace(result.report, layout=MESH, hbm_by_category=walked, budget_flops=1.0)
        results.append(dataclasses.replace(result, report=report))
    row = pair_cost.step_ratios([b, s], results)[0]
    assert row["held_by"] == pytest.approx({"copies": 10e9, "residual stacks": 1e9})
    table = pair_cost.price_table([b, s], results, paper.CE_GAIN)
    assert "| copies +10, stacks +1 |" in table

"""The prepared device check (benchmarks/device_step.py): its roofline, efficiency and pair ratio are the
formulas its docstring states, and a dry run on this CPU measures a real step and walks its program."""

import pytest

from benchmarks import device_step
from smelt_jax.platform import hardware


def _member(arch, budget, flops, walked, step):
    chip = hardware.GPU_CHIPS["H100"]
    return device_step.MemberStep(
        run_id=f"r-{arch}", arch=arch, tokens=1000, budget_flops=budget, program_flops=flops,
        walked_bytes=walked, compile_seconds=1.0, step_seconds=step, step_seconds_all=(step,),
        compute_seconds=flops / chip.peak_flops, hbm_seconds=walked / chip.hbm_bytes_per_second)


def test_roofline_is_the_larger_term_and_the_pair_ratio_is_per_budget_flop():
    # Baseline HBM-bound: 3.35 GB / 3.35 TB/s = 1 ms > 0.989 TFLOP / 989 TFLOP/s = 1 ms * 1e-3
    base = _member("baseline", budget=1e12, flops=0.989e9, walked=3.35e9, step=4e-3)
    # SMELT compute-bound: 9.89 TFLOP / 989 TFLOP/s = 10 ms > 3.35 GB -> 1 ms
    smelt = _member("smelt", budget=2e12, flops=9.89e12, walked=3.35e9, step=20e-3)
    assert base.roofline_seconds == pytest.approx(1e-3) and base.efficiency == pytest.approx(0.25)
    assert smelt.roofline_seconds == pytest.approx(10e-3) and smelt.efficiency == pytest.approx(0.5)
    text = device_step.report((base, smelt), "NVIDIA H100 80GB HBM3", "H100")
    # measured (20 ms / 2e12) / (4 ms / 1e12) = 2.5; walked (10 ms / 2e12) / (1 ms / 1e12) = 5
    assert "measured 2.500, walked 5.000" in text
    assert "| baseline | 1,000 | 0.99 | 3.350 | 0.001 | 1.000 | 1.000 | 4.000 | 0.250 |" in text


def test_chip_for_device_kinds_and_the_cpu():
    assert device_step.chip_for("NVIDIA H100 80GB HBM3").name == "H100"
    assert device_step.chip_for("NVIDIA H200").hbm_bytes_per_second == 4.8e12
    assert device_step.chip_for("cpu") is None
    assert device_step.chip_for("cpu", "H100").name == "H100"
    with pytest.raises(SystemExit, match="not one of"):
        device_step.chip_for("cpu", "H900")


@pytest.mark.integration
def test_dry_run_on_this_cpu_measures_and_walks_one_member():
    base, _ = device_step.pair_runs("micro", "xs", "s95")
    chip = hardware.GPU_CHIPS["H100"]
    m = device_step.measure(base, steps=2, batch_size=2, chip=chip)
    assert m.tokens == 2 * base.schedule.seq_len and len(m.step_seconds_all) == 2
    assert m.step_seconds > 0 and m.walked_bytes > 0
    assert m.program_flops >= m.budget_flops * 0.5  # the step executes at least the budget's matmuls
    assert m.compute_seconds == pytest.approx(m.program_flops / chip.peak_flops)
    assert m.hbm_seconds == pytest.approx(m.walked_bytes / chip.hbm_bytes_per_second)
    with pytest.raises(SystemExit, match="no xs s50 pair"):
        device_step.pair_runs("micro", "xs", "s50")

"""A run's memory is estimated before anything is written; a run that cannot fit the devices present is
refused in one line with the estimate (`smelt_jax.run_files.memory_estimate`)."""

from __future__ import annotations

import pytest

import experiments
from smelt_jax.cli import main
from smelt_jax.run_files.memory_estimate import GIB, DoesNotFit, check_fits, estimate
from tests.custom_run_helpers import TINY_SPEC, tiny_run, write_spec_file


def test_the_estimate_counts_state_and_activations():
    run = tiny_run()
    n = 1
    one = estimate(run.model, run.schedule, n)
    params = one.params // 4  # float32
    assert one.gradients == 4 * params and one.optimizer == 8 * params
    two = estimate(run.model, run.schedule, 2)
    assert two.per_device < one.per_device and two.activations * 2 >= one.activations - 8
    assert estimate(run.model, run.schedule, 1, remat="full").activations < one.activations


def test_a_suite_model_fits_its_slice_and_not_one_small_device():
    run = [r for r in experiments.load_suite("smelt16") if r.scale == "1.6b"][0]
    check_fits(run, 256, 95 * GIB)  # v5p: 95 GiB of HBM per chip
    with pytest.raises(DoesNotFit, match=r"GiB per device at least \(parameters"):
        check_fits(run, 1, 16 * GIB)
    assert check_fits(run, 1, None).per_device > 16 * GIB  # unknown memory: never refused


def test_an_oversized_config_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    spec = {**TINY_SPEC, "model": {**TINY_SPEC["model"], "d_model": 100000000}}
    config = write_spec_file(tmp_path / "huge.yaml", spec)
    runs = tmp_path / "runs"
    runs.mkdir()
    assert main(["train", "--config", str(config), "--runs-dir", str(runs), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot fit" in err and "GiB per device" in err, err
    assert list(runs.iterdir()) == []

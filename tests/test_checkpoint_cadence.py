"""Checkpoint cadence by time (smelt_jax.compile.checkpoint_cadence): bytes per save against the real
train state, minutes -> steps, the cadence file the compile report writes and the flag sweep jobs get."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from smelt_jax.compile import checkpoint_cadence as cc
from smelt_jax.compile.report import CompileReport
from smelt_jax.parallel.layout import run_key


def _smoke_runs():
    import experiments

    return list(experiments.load_suite("smoke"))


def test_bytes_per_save_are_the_parameters_and_adams_two_moments():
    from smelt_jax.model.decoder import Decoder

    for run in _smoke_runs()[:2]:
        from flax import nnx

        model = nnx.eval_shape(lambda cfg=run.model: Decoder(cfg, rngs=nnx.Rngs(0)))
        params = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        # float32 parameters, Adam's mu and nu of the same size, and a few scalar step counters
        assert 3 * params <= cc.save_bytes(run) <= 3 * params + 64


@pytest.mark.parametrize(("minutes", "step", "steps"), [(30, 2.0, 900), (30, 7.0, 258), (1, 120.0, 1),
                                                         (0.5, 0.03, 1000)])
def test_minutes_become_whole_steps_of_at_least_the_interval(minutes, step, steps):
    assert cc.steps_between_saves(minutes, step) == steps
    assert steps * step >= minutes * 60 or steps == 1
    with pytest.raises(ValueError):
        cc.steps_between_saves(minutes, 0.0)


@dataclasses.dataclass(frozen=True)
class _Result:  # the fields of layout_search.SearchResult the cadence reads
    status: str
    report: CompileReport | None


def _report(step):
    return CompileReport(run_id="r", slice="v5p-8", layout={}, remat="none", expert_impl="pallas",
                         peak_fits_hbm=True, error=None, compile_seconds=1.0, step_seconds=step)


def test_the_cadence_file_lists_fitting_runs_and_sweep_jobs_get_the_flag(tmp_path, monkeypatch):
    runs = _smoke_runs()[:3]
    monkeypatch.setitem(cc.SUITE_CHECKPOINT_MINUTES, "smoke", 10.0)
    results = [_Result("fits", _report(2.0)), _Result("does not fit", _report(1.0)), _Result("fits", _report(None))]
    text = cc.cadence_document(runs, results, "smoke")
    assert text == cc.cadence_document(runs, results, "smoke")  # deterministic
    doc = json.loads(text)
    assert doc["minutes"] == 10.0 and list(doc["runs"]) == [run_key(runs[0])]
    assert doc["runs"][run_key(runs[0])] == {"checkpoint_every": 300, "step_seconds": 2.0,
                                             "save_bytes": cc.save_bytes(runs[0])}
    path = tmp_path / "checkpoint_cadence_smoke.json"
    path.write_text(text)
    assert cc.checkpoint_args(runs[0], path) == ["--checkpoint-every", "300"]
    assert cc.checkpoint_args(runs[1], path) == []  # not listed: the trainer's default
    assert cc.checkpoint_args(runs[0], tmp_path / "missing.json") == []
    assert cc.cadence_file(tmp_path / "layouts.json").name == "checkpoint_cadence.json"
    assert cc.cadence_file(tmp_path / "layouts_ablations200m.json").name == "checkpoint_cadence_ablations200m.json"

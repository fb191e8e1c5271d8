"""The demo's report: degenerate fits and endpoints that got worse are reported, never raised."""

from __future__ import annotations

import io
import json
import warnings

import pandas as pd
import pytest

from experiments import find_run
from smelt_jax.demo import endpoint_checks, fit_and_report, fit_in_pinned_process
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.scaling import health

# The smoke endpoints of one run of the committed demo; smelt s s95's longer branch ended higher
# (3.762 against 3.642), as on the fresh machine of issue 14, and its fit degenerated.
ROWS = """arch,scale,sparsity_label,branch,F,S,D,loss,cell
baseline,s,s85,0,12204000,0.83891102,61440,3.4090824,smoke-s-s85-baseline-e0506f9d
baseline,s,s85,1,12204000,0.83891102,102400,3.3207507,smoke-s-s85-baseline-e0506f9d
baseline,s,s95,0,12369888,0.94407692,61440,3.4230951,smoke-s-s95-baseline-c0125c7c
baseline,s,s95,1,12369888,0.94407692,102400,3.3016576,smoke-s-s95-baseline-c0125c7c
baseline,xs,s85,0,4318272,0.83438947,61440,3.4289969,smoke-xs-s85-baseline-6cbd592a
baseline,xs,s85,1,4318272,0.83438947,102400,3.3498922,smoke-xs-s85-baseline-6cbd592a
baseline,xs,s95,0,4392000,0.94211757,61440,3.4459064,smoke-xs-s95-baseline-9f8dcedf
baseline,xs,s95,1,4392000,0.94211757,102400,3.376077,smoke-xs-s95-baseline-9f8dcedf
smelt,s,s85,0,12456192,0.82843132,61440,3.4295308,smoke-s-s85-smelt-1df1dd71
smelt,s,s85,1,12456192,0.82843132,102400,3.3087527,smoke-s-s85-smelt-1df1dd71
smelt,s,s95,0,12068928,0.94385472,61440,3.642,smoke-s-s95-smelt-471601d5
smelt,s,s95,1,12068928,0.94385472,102400,3.762,smoke-s-s95-smelt-471601d5
smelt,xs,s85,0,4170624,0.83675787,61440,3.4630015,smoke-xs-s85-smelt-1f1df970
smelt,xs,s85,1,4170624,0.83675787,102400,3.2532356,smoke-xs-s85-smelt-1f1df970
smelt,xs,s95,0,4225920,0.94239061,61440,3.4744585,smoke-xs-s95-smelt-c788a2fe
smelt,xs,s95,1,4225920,0.94239061,102400,3.3308132,smoke-xs-s95-smelt-c788a2fe
"""


def _store_rows(text: str) -> str:
    """The fit-format rows above as the results store's rows (what fits/<suite>/results.csv holds)."""
    points = pd.read_csv(io.StringIO(text))
    store = pd.DataFrame({
        "run_id": points["cell"], "branch": points["branch"],
        "pair_id": "smoke-" + points["scale"] + "-" + points["sparsity_label"], "arch": points["arch"],
        "scale": points["scale"], "sparsity_label": points["sparsity_label"], "sparsity": points["S"],
        "flops_per_token": points["F"], "tokens": points["D"], "val_loss": points["loss"]})
    return store.to_csv(index=False)


def test_degenerate_table_is_reported_not_raised(tmp_path):
    (tmp_path / "results.csv").write_text(_store_rows(ROWS))
    (tmp_path / "fit.json").write_text('{"bootstrap_draws": 16}')
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no numpy noise may reach the terminal
        report = fit_and_report(tmp_path)
    text = "\n".join(report.warnings)
    assert "unidentified: 8 points for 6 parameters" in text
    assert "smelt: degenerate" in text or "not a finite number" in text
    for name in ("ce_gain.md", "ce_gain.png", "loss_vs_compute.png", "smelt/coefficients.json"):
        assert (tmp_path / name).exists(), name
    table = (tmp_path / "ce_gain.md").read_text()
    assert "inf" not in table and "nan" not in table  # non-finite values are written as n/a


def test_table_that_cannot_be_fitted_is_reported(tmp_path):
    rows = ROWS.splitlines()
    (tmp_path / "results.csv").write_text(_store_rows("\n".join(rows[:1] + rows[1:4] + rows[9:12]) + "\n"))
    (tmp_path / "fit.json").write_text('{"bootstrap_draws": 0}')
    report = fit_and_report(tmp_path)
    assert len(report.warnings) == 1 and report.warnings[0].startswith("no fit:")
    pinned = fit_in_pinned_process(tmp_path)  # the demo's fit step: `smelt fit-suite` in a fresh process
    assert len(pinned.warnings) == 1 and pinned.paths == []
    assert pinned.warnings[0].startswith("no fit:") and pinned.warnings[0].endswith("3 rows is too few to fit "
                                                                                  "the 6 parameters of the smelt law (need more than 6)")


def test_assess_fit_names_each_problem():
    good = {"arch": "smelt", "n_points": 72, "converged": True, "E": 1.8, "A": 40.0, "K": 300.0,
            "a": 0.3, "b": 0.2, "c": 0.3}
    assert health.assess_fit(good) == []
    assert "unidentified" in health.assess_fit({**good, "n_points": 8})[0]
    assert "did not converge" in health.assess_fit({**good, "converged": False, "grad_norm": 3.0})[0]
    assert "exponent a" in health.assess_fit({**good, "a": 1e-6})[0]
    assert "coefficient A" in health.assess_fit({**good, "A": 5e-126})[0]
    assert "non-finite K" in health.assess_fit({**good, "K": float("inf")})[0]


def _write_metrics(path, ce_by_step):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "ce": ce, "loss": ce}) + "\n" for s, ce in ce_by_step))


@pytest.mark.parametrize("rising", [True, False])
def test_endpoint_checks(tmp_path, rising):
    """smoke forks at steps 20 and 40; a branch must end below its fork's loss and the longer branch
    below the shorter."""
    run_id = find_run("smoke-s-s95-smelt").id
    _write_metrics(run_dir("smoke", run_id, tmp_path).metrics(None),
                   [(10, 4.0), (20, 3.6), (30, 3.5), (40, 3.4)])
    second = 3.70 if rising else 3.30
    results = pd.DataFrame({"run_id": [run_id, run_id], "branch": [0, 1], "tokens": [61440, 102400],
                            "val_loss": [3.45, second]})
    problems = endpoint_checks(results, tmp_path)
    if not rising:
        assert problems == []
        return
    assert len(problems) == 2
    assert "branch 1: endpoint loss 3.7000 is not below the loss at its fork (step 40: 3.5000)" in problems[0]
    assert "branch 1 (102,400 tokens) ends at 3.7000, not below branch 0" in problems[1]

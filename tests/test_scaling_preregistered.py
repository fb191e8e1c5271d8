"""The pre-registered nano test (scaling/preregistered.py) on synthetic tables from known laws: a normal
law at nano's grid passes and its coefficients come back; a law without an asymptote, or a noisy table,
fails the criterion that it breaks; CE gains and the law-free comparison agree in sign with the truth."""

import numpy as np
import pandas as pd
import pytest

from smelt_jax.scaling import preregistered as pre
from smelt_jax.scaling.laws import ChinchillaLaw

F = (6.56e5, 1.33e6, 2.54e6, 4.61e6)  # nano's Baseline F per token
D = (0.5e6, 1e6, 2e6, 4e6, 7e6, 10e6)


def _table(law_fd, arch, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i, f in enumerate(F):
        for k, d in enumerate(D):
            loss = law_fd(f, d) * np.exp(noise * rng.standard_normal())
            rows.append({"run_id": f"{arch}-{i}", "branch": k, "arch": arch, "flops_per_token": f,
                         "tokens": d, "val_loss": float(loss)})
    return pd.DataFrame(rows)


def _law(E, A, K, a, c):
    return lambda f, d: E + A / f ** a + K / d ** c


def test_a_normal_law_is_recovered_and_counts():
    truth = dict(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3)
    table = _table(_law(**truth), "baseline", noise=0.002)
    fitted = pre.fit_fd(pre.fd_points(table, "baseline"), n_draws=200, seed=0)
    for name in ("E", "a", "c"):
        assert fitted["coefficients"][name] == pytest.approx(truth[name], rel=0.25)
        lo, hi = fitted["intervals"][name]["lo"], fitted["intervals"][name]["hi"]
        assert lo <= fitted["coefficients"][name] <= hi and hi - lo < 0.5 * truth[name]
    result = pre.verdict(fitted)
    assert result["counts"], result["failed"]


def test_no_asymptote_fails_on_E_and_noise_fails_on_rmse():
    flat = _table(_law(E=1e-6, A=40.0, K=60.0, a=0.3, c=0.3), "baseline", noise=0.002)
    result = pre.verdict(pre.fit_fd(pre.fd_points(flat, "baseline"), n_draws=100))
    assert not result["counts"] and any(s.startswith("E's lower") for s in result["failed"])
    noisy = _table(_law(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3), "baseline", noise=0.05, seed=3)
    result = pre.verdict(pre.fit_fd(pre.fd_points(noisy, "baseline"), n_draws=100))
    assert any(s.startswith("RMSE") for s in result["failed"])


def test_ce_gains_and_law_free_comparison_have_the_true_sign():
    base = _law(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3)
    better = _law(E=1.0, A=30.0, K=60.0, a=0.3, c=0.3)  # less loss at every F: a positive CE gain
    table = pd.concat([_table(base, "baseline", 0.001, 1), _table(better, "smelt", 0.001, 2)])
    ref = pre.fit_fd(pre.fd_points(table, "baseline"), n_draws=200)
    tgt = pre.fit_fd(pre.fd_points(table, "smelt"), n_draws=200)
    computes = pre.inside_computes(pre.fd_points(table, "baseline"))
    assert len(computes) == 3 and computes == sorted(computes)
    gains = pre.ce_gains(ref, tgt, computes)
    truth = [1 - c / ChinchillaLaw(E=1.0, A=40.0 / 6 ** 0.3, B=60.0, alpha=0.3, beta=0.3).compute_for_loss(
        ChinchillaLaw(E=1.0, A=30.0 / 6 ** 0.3, B=60.0, alpha=0.3, beta=0.3).frontier_loss(c)) for c in computes]
    assert np.all(gains["ce_gain"] > 0) and np.allclose(gains["ce_gain"], truth, atol=0.1)
    assert gains["resolved"].all() and (gains["ce_lo"] <= gains["ce_gain"]).all()
    free = pre.law_free(table, computes)
    assert (free["delta"] < 0).all()


def test_resampling_by_run_keeps_a_runs_horizons_together():
    table = _table(_law(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3), "smelt")
    assert pre.fd_points(table, "smelt", "run")["cell"].nunique() == len(F)
    assert pre.fd_points(table, "smelt")["cell"].nunique() == len(F) * len(D)
    with pytest.raises(Exception, match="no endpoints"):
        pre.fd_points(table, "baseline")

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


def test_a_degenerate_exponent_gives_an_infinite_A_not_an_overflow_error():
    """Found on the nano endpoints: a bootstrap draw with a ~ 400 overflowed 6 ** a and stopped make fits."""
    fd = pre._as_fd(ChinchillaLaw(E=1.0, A=2.0, B=3.0, alpha=400.0, beta=0.3))
    assert fd["A"] == float("inf") and fd["a"] == 400.0 and fd["K"] == 3.0


def test_resampling_by_run_keeps_a_runs_horizons_together():
    table = _table(_law(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3), "smelt")
    assert pre.fd_points(table, "smelt", "run")["cell"].nunique() == len(F)
    assert pre.fd_points(table, "smelt")["cell"].nunique() == len(F) * len(D)
    with pytest.raises(Exception, match="no endpoints"):
        pre.fd_points(table, "baseline")


def _store_rows(law_fd, arch, pair_ids, noise=0.002, seed=0, widths=F):
    """The results store's rows (fit_suite_table's input) for one architecture on nano's grid."""
    rng = np.random.default_rng(seed)
    rows = []
    for f, pair_id in zip(widths, pair_ids):
        for k, d in enumerate(D):
            loss = law_fd(f, d) * np.exp(noise * rng.standard_normal())
            rows.append({"run_id": f"{pair_id}-{arch}", "branch": k, "pair_id": pair_id, "arch": arch,
                         "scale": pair_id.split("-")[1], "sparsity_label": "s95",
                         "sparsity": 0.94 if arch == "baseline" else 0.96, "flops_per_token": f, "tokens": d,
                         "val_loss": float(loss), "params": 1000})
    return rows


def _suite_folder(tmp_path, rows, draws=60):
    import json

    folder = tmp_path / "nano"
    folder.mkdir()
    pd.DataFrame(rows).to_csv(folder / "results.csv", index=False)
    (folder / "fit.json").write_text(json.dumps({
        "analysis": "preregistered-fd", "bootstrap_draws": draws, "seed": 0,
        "noise_pairs": {"nano-d40-s95-seed1": "nano-d40-s95"}, "expected_points": len(F) * len(D)}))
    return folder


def test_the_suite_pipeline_runs_the_preregistered_test_and_keeps_the_repeat_out_of_the_fits(tmp_path):
    from smelt_jax.scaling.suite_fits import fit_suite_table

    pairs = [f"nano-d{w}-s95" for w in (24, 40, 64, 96)]
    base, better = _law(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3), _law(E=1.0, A=30.0, K=60.0, a=0.3, c=0.3)
    rows = _store_rows(base, "baseline", pairs, seed=1) + _store_rows(better, "smelt", pairs, seed=2)
    # the repeat seed of the d40 pair: far off the law, so it would break the fit if it entered it
    rows += _store_rows(lambda f, d: 5.0, "baseline", ["nano-d40-s95-seed1"], noise=0.0, widths=F[1:2])
    rows += _store_rows(lambda f, d: 5.5, "smelt", ["nano-d40-s95-seed1"], noise=0.0, widths=F[1:2])
    folder = _suite_folder(tmp_path, rows)
    fit_suite_table(folder)
    verdict = pd.read_csv(folder / "verdict.csv").set_index("arch")
    assert verdict["counts"].all() and (verdict["n_points"] == 24).all(), verdict
    gains = pd.read_csv(folder / "ce_gain.csv")
    assert len(gains) == 3 and (gains["ce_gain"] > 0).all()
    noise = pd.read_csv(folder / "seed_noise.csv")
    assert len(noise) == len(D) and np.allclose(noise["baseline_repeat"], 5.0)
    assert np.allclose(noise["delta_repeat"], 0.5) and (noise["pair_id"] == "nano-d40-s95").all()
    counts = pd.read_csv(folder / "win_counts.csv").set_index("sparsity_label")
    assert counts.loc["all", "wins"] == 24 and counts.loc["all", "sign_p"] == pytest.approx(2 / 2 ** 24)
    assert (folder / "loss_vs_compute.png").exists() and (folder / "law_free.csv").exists()
    assert "**The pre-registered test passed**" in (folder / "README.md").read_text()


def test_partial_data_gives_a_verdict_that_does_not_count_and_no_ce_gain(tmp_path):
    from smelt_jax.scaling.suite_fits import fit_suite_table

    rows = _store_rows(_law(E=1.0, A=40.0, K=60.0, a=0.3, c=0.3), "baseline", ["nano-d24-s95"], widths=F[:1])
    folder = _suite_folder(tmp_path, rows)
    fit_suite_table(folder)
    verdict = pd.read_csv(folder / "verdict.csv")
    assert list(verdict["arch"]) == ["baseline"] and not verdict["counts"].any()
    assert "only 6 of the 24" in verdict["failed"].iloc[0]
    assert not (folder / "ce_gain.csv").exists() and (folder / "loss_vs_compute.png").exists()
    assert "has not been run yet**: 6 of its 48 endpoints" in (folder / "README.md").read_text()

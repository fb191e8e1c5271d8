"""Fitting: the batched L-BFGS against scipy, synthetic recovery, the Chinchilla replication, bootstrap."""

import numpy as np
import pytest
from scaling_synthetic import paper_pair_table, smelt_table

from smelt_jax.design import paper
from smelt_jax.scaling import bootstrap, fit, gains, io
from smelt_jax.scaling.laws import ChinchillaLaw, SmeltLaw

EPOCH = {"E": 1.817, "A": 482.0, "B": 2085.4, "alpha": 0.3478, "beta": 0.3659}
EPOCH_SE = {"A": 124.52, "B": 1293.28, "E": 0.0257, "alpha": 0.0154, "beta": 0.0206}


@pytest.fixture(scope="module")
def chinchilla():
    table, kept, n_rows = io.chinchilla_table()
    return table, kept, n_rows, ChinchillaLaw.features(table), table["loss"].to_numpy(float)


def test_huber_matches_definition():
    r = np.array([-0.01, -1e-3, 0.0, 5e-4, 2e-3])
    expected = [1e-3 * (0.01 - 5e-4), 0.5e-6, 0.0, 0.5 * 25e-8, 1e-3 * (2e-3 - 5e-4)]
    np.testing.assert_allclose(np.asarray(fit.float64(fit.huber)(r)), expected, rtol=1e-12)


def test_float64_is_scoped():
    import jax.numpy as jnp

    inside = fit.float64(lambda: jnp.ones(2).dtype)()
    assert inside == jnp.float64 and jnp.ones(2).dtype == jnp.float32


def test_batched_lbfgs_matches_scipy_per_start():
    """Reference: scipy L-BFGS-B per start on the same objective; random starts on a synthetic table."""
    import jax
    import jax.numpy as jnp
    import scipy.optimize

    table = smelt_table(paper.SMELT_LAW, "s", 0.002, seed=3)
    x, y = SmeltLaw.features(table), np.log(table["loss"].to_numpy())
    rng = np.random.default_rng(0)
    starts = paper.SMELT_LAW.to_raw() + rng.normal(0, [0.1, 0.5, 0.5, 0.03, 0.03, 0.05], (6, 6))
    ours = fit.minimise_huber(SmeltLaw, x, y, np.ones((1, len(y))), starts)
    with jax.enable_x64(True):
        vg = jax.jit(jax.value_and_grad(lambda r: fit.huber_objective(SmeltLaw, r, jnp.asarray(x), jnp.asarray(y), 1.0)))
        for i, s in enumerate(starts):
            ref = scipy.optimize.minimize(lambda r: tuple(np.asarray(v, float) for v in vg(jnp.asarray(r))), s,
                                          jac=True, method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-12,
                                                                                "maxiter": 5000})
            assert ours["objective"][0, i] <= ref.fun * (1 + 1e-6)
    assert ours["stopped"].all()


def test_smelt_fit_recovers_parameters_and_ce_gain():
    """Synthetic tables from the paper's laws with 0.1% noise: parameters and CE gains come back."""
    table = paper_pair_table(noise=0.001, seed=7)
    fitted = {}
    for arch, truth in (("baseline", paper.BASELINE_LAW), ("smelt", paper.SMELT_LAW)):
        rows = table[table.arch == arch]
        result = fit.fit_law(SmeltLaw, SmeltLaw.features(rows), rows["loss"])
        assert result.converged and result.n_points == 72
        assert result.grad_norm < 1e-6
        assert result.rmse < 0.004 and result.share_within_delta > 0.3
        law = result.law
        assert law.E == pytest.approx(truth.E, abs=0.01)
        for name in ("a", "b", "c"):
            assert getattr(law, name) == pytest.approx(getattr(truth, name), abs=0.03)
        fitted[arch] = law
    for c, s in ((1e20, 0.85), (1e21, 0.95), (1e21, 0.97)):
        true_gain = gains.ce_gain(paper.BASELINE_LAW, paper.SMELT_LAW, c, s)
        assert gains.ce_gain(fitted["baseline"], fitted["smelt"], c, s) == pytest.approx(true_gain, abs=0.02)


def test_chinchilla_epoch_point_estimate(chinchilla):
    """Acceptance: Epoch's estimator reproduces E 1.817, A 482.0, B 2085.4, alpha 0.3478, beta 0.3659."""
    table, _, _, x, loss = chinchilla
    assert len(table) == 240
    law = fit.fit_huber_likelihood(ChinchillaLaw, x, loss).law
    assert law.E == pytest.approx(EPOCH["E"], abs=1e-3)
    assert law.A == pytest.approx(EPOCH["A"], rel=0.02)
    assert law.B == pytest.approx(EPOCH["B"], rel=0.02)
    assert law.alpha == pytest.approx(EPOCH["alpha"], abs=5e-4)
    assert law.beta == pytest.approx(EPOCH["beta"], abs=5e-4)


def test_chinchilla_huber_grid_fit_is_a_lower_minimum(chinchilla):
    """The summed-Huber grid fit converges (gradient ~0) and no start beats it, incl. Hoffmann's values."""
    _, _, _, x, loss = chinchilla
    result = fit.fit_law(ChinchillaLaw, x, loss, refine=16)
    assert result.converged and result.grad_norm < 1e-6
    hoffmann = fit.minimise_huber(ChinchillaLaw, x, np.log(loss), np.ones((1, len(loss))), fit.HOFFMANN_RAW[None])
    assert result.objective <= hoffmann["objective"][0, 0] * (1 + 1e-9)
    assert result.law.E == pytest.approx(1.817, abs=2e-3)


def _epoch_bootstrap_se(chinchilla, n_draws):
    _, kept, n_rows, x, loss = chinchilla
    weights = bootstrap.epoch_point_weights(n_rows, kept, n_draws, seed=42)
    out = bootstrap.refit(ChinchillaLaw, x, loss, weights, fit.HOFFMANN_RAW)
    assert out["converged"].all()
    return bootstrap.intervals(bootstrap.parameter_draws(ChinchillaLaw, out["raw"]))


def test_chinchilla_bootstrap_se_first_400_draws(chinchilla):
    """Fast version: the first 400 of Epoch's 4000 draws give SEs within 10% of Epoch's (4000-draw) SEs."""
    ivals = _epoch_bootstrap_se(chinchilla, 400)
    for name, se in EPOCH_SE.items():
        assert ivals[name]["se"] == pytest.approx(se, rel=0.10), name


@pytest.mark.slow
def test_chinchilla_bootstrap_se_4000_draws(chinchilla):
    """Acceptance (full): 4000 draws, np.random.seed(42), Huber sum from Hoffmann's values; SEs within 10%."""
    ivals = _epoch_bootstrap_se(chinchilla, 4000)
    for name, se in EPOCH_SE.items():
        assert ivals[name]["se"] == pytest.approx(se, rel=0.10), name


def test_cell_weights_resample_whole_cells():
    cells = np.repeat(np.array(["a", "b", "c", "d"]), 6)
    w = bootstrap.cell_weights(cells, 50, seed=1)
    assert w.shape == (50, 24)
    np.testing.assert_array_equal(w.sum(1), 24)
    for row in w:   # every point of a cell carries the same weight
        assert (row.reshape(4, 6) == row.reshape(4, 6)[:, :1]).all()
    np.testing.assert_array_equal(w, bootstrap.cell_weights(cells, 50, seed=1))


def test_cell_bootstrap_covers_truth():
    table = smelt_table(paper.BASELINE_LAW, "b", 0.002, seed=11)
    x, loss = SmeltLaw.features(table), table["loss"].to_numpy()
    best = fit.fit_law(SmeltLaw, x, loss, refine=16)
    boot = bootstrap.cell_bootstrap(SmeltLaw, x, loss, table["cell"].to_numpy(), np.array(best.raw),
                                    n_draws=100, seed=0)
    assert boot["n_cells"] == 12 and boot["n_converged"] >= 95
    for name in ("E", "a", "b", "c"):
        iv = boot["intervals"][name]
        assert iv["lo"] < getattr(best.law, name) < iv["hi"] and iv["se"] > 0


def test_looped_fit_recovers_phi():
    """Schwethelm et al.'s looped law: synthetic runs over (N_once, N_rec, r, D) give back phi."""
    from smelt_jax.scaling.laws import LoopedLaw

    truth = LoopedLaw(E=1.7, A=400.0, B=1500.0, alpha=0.34, beta=0.30, phi=0.459)
    rng = np.random.default_rng(2)
    grid = [(n, rec, r, d) for n in (2e7, 6e7, 2e8) for rec in (0.25, 0.5) for r in (1, 2, 4)
            for d in (2e9, 8e9, 3e10)]
    table = {"N_once": np.array([n * (1 - rec) for n, rec, _, _ in grid]),
             "N_rec": np.array([n * rec for n, rec, _, _ in grid]),
             "r": np.array([g[2] for g in grid], float), "D": np.array([g[3] for g in grid])}
    loss = truth.predict(**table) * np.exp(5e-4 * rng.standard_normal(len(grid)))
    result = fit.fit_law(LoopedLaw, LoopedLaw.features(table), loss, refine=32)
    assert result.converged
    assert result.law.phi == pytest.approx(truth.phi, abs=0.05)
    assert result.law.alpha == pytest.approx(truth.alpha, abs=0.03)
    assert result.law.E == pytest.approx(truth.E, abs=0.02)

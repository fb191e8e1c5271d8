"""Laws: closed forms against brute-force numerics, and the paper's CE gains / TPP from its coefficients."""

import numpy as np
import pytest
import scipy.optimize

from smelt_jax.design import paper
from smelt_jax.scaling import gains
from smelt_jax.scaling.laws import ChinchillaLaw, LoopedLaw, SmeltLaw, law_from_dict


def random_smelt(rng):
    return SmeltLaw(E=rng.uniform(1.2, 2.0), A=10 ** rng.uniform(2, 4), K=10 ** rng.uniform(5, 7),
                    a=rng.uniform(0.25, 0.5), b=rng.uniform(0.05, 0.3), c=rng.uniform(0.4, 0.8))


@pytest.mark.parametrize("seed", range(5))
def test_smelt_frontier_matches_numerical_minimum(seed):
    rng = np.random.default_rng(seed)
    law = random_smelt(rng)
    for c, s in ((1e19, 0.0), (1e21, 0.9), (1e23, 0.97)):
        res = scipy.optimize.minimize_scalar(lambda logf, c=c, s=s: law.predict(np.exp(logf), s, c / np.exp(logf)),
                                             bounds=(np.log(1e3), np.log(c) - np.log(1e3)), method="bounded",
                                             options={"xatol": 1e-10})
        assert law.frontier_loss(c, s) == pytest.approx(res.fun, rel=1e-9)
        assert np.log(law.optimal_flops_per_token(c, s)) == pytest.approx(res.x, abs=1e-4)
        assert law.optimal_tokens(c, s) * law.optimal_flops_per_token(c, s) == pytest.approx(c)
        # inverse frontier round trip
        assert law.compute_for_loss(law.frontier_loss(c, s), s) == pytest.approx(c, rel=1e-9)
    assert law.compute_for_loss(law.E * 0.999, 0.9) == np.inf


@pytest.mark.parametrize("seed", range(3))
def test_chinchilla_frontier_matches_numerical_minimum(seed):
    rng = np.random.default_rng(seed)
    law = ChinchillaLaw(E=rng.uniform(1.5, 2), A=10 ** rng.uniform(2, 3), B=10 ** rng.uniform(2, 4),
                        alpha=rng.uniform(0.25, 0.45), beta=rng.uniform(0.25, 0.45))
    c = 1e22
    res = scipy.optimize.minimize_scalar(lambda logn: law.predict(np.exp(logn), c / (6 * np.exp(logn))),
                                         bounds=(np.log(1e6), np.log(1e14)), method="bounded",
                                         options={"xatol": 1e-10})
    assert law.frontier_loss(c) == pytest.approx(res.fun, rel=1e-9)
    assert np.log(law.optimal_params(c)) == pytest.approx(res.x, abs=1e-4)
    assert law.compute_for_loss(law.frontier_loss(c)) == pytest.approx(c, rel=1e-9)


def test_looped_reduction_matches_brute_force():
    law = LoopedLaw(E=1.7, A=400.0, B=1500.0, alpha=0.34, beta=0.3, phi=0.459)
    rho, r, c = 0.5, 2.0, 1e21
    chin, _ = law.at_fixed_shape(rho, r)
    k_exec = 1 - rho + r * rho

    def loss(log_n):   # N unique parameters; compute C = 6 N k_exec D
        n = np.exp(log_n)
        return law.predict((1 - rho) * n, rho * n, r, c / (6 * n * k_exec))

    res = scipy.optimize.minimize_scalar(loss, bounds=(np.log(1e6), np.log(1e13)), method="bounded",
                                         options={"xatol": 1e-10})
    assert chin.frontier_loss(c) == pytest.approx(res.fun, rel=1e-9)
    assert chin.optimal_params(c) / k_exec == pytest.approx(np.exp(res.x), rel=1e-3)


@pytest.mark.parametrize("law", [paper.BASELINE_LAW, ChinchillaLaw(1.8, 480, 2000, 0.35, 0.37),
                                 LoopedLaw(1.7, 400, 1500, 0.34, 0.3, 0.46)])
def test_log_terms_logsumexp_equals_predict(law):
    rng = np.random.default_rng(0)
    if isinstance(law, SmeltLaw):
        table = {"F": 10 ** rng.uniform(8, 10, 20), "S": rng.uniform(0, 0.97, 20), "D": 10 ** rng.uniform(9, 12, 20)}
        pred = law.predict(table["F"], table["S"], table["D"])
    elif isinstance(law, ChinchillaLaw):
        table = {"N": 10 ** rng.uniform(7, 10, 20), "D": 10 ** rng.uniform(9, 12, 20)}
        pred = law.predict(table["N"], table["D"])
    else:
        table = {"N_once": 10 ** rng.uniform(7, 9, 20), "N_rec": 10 ** rng.uniform(7, 9, 20),
                 "r": rng.integers(1, 5, 20), "D": 10 ** rng.uniform(9, 12, 20)}
        pred = law.predict(table["N_once"], table["N_rec"], table["r"], table["D"])
    terms = type(law).log_terms(law.to_raw(), type(law).features(table))
    np.testing.assert_allclose(np.log(np.exp(terms).sum(1)), np.log(pred), rtol=1e-12)
    back = type(law).from_raw(law.to_raw())
    np.testing.assert_allclose(back.to_raw(), law.to_raw(), rtol=1e-12)


def test_invalid_parameters_rejected():
    with pytest.raises(ValueError, match="E must be"):
        SmeltLaw(E=-1, A=1, K=1, a=0.3, b=0.1, c=0.5)
    with pytest.raises(ValueError, match="missing"):
        law_from_dict("smelt", {"E": 1.0})
    with pytest.raises(ValueError, match="unknown law"):
        law_from_dict("nope", {})


def test_paper_ce_gains_and_tpp_from_published_coefficients():
    """Acceptance: CE gains within 0.2 points of the paper's table and TPP within 1 at 1e21."""
    rows = gains.gain_rows(paper.BASELINE_LAW, paper.SMELT_LAW, paper.COMPUTES, paper.SPARSITIES)
    assert len(rows) == 9
    for row in rows:
        expected = paper.CE_GAIN[(row["C"], row["S"])][0]
        assert 100 * row["ce_gain"] == pytest.approx(expected, abs=0.2), row
        if row["C"] == 1e21:
            tpp_b, tpp_s = paper.TPP_1E21[row["S"]]
            assert abs(row["tpp_reference"] - tpp_b) <= 1 and abs(row["tpp_target"] - tpp_s) <= 1
    assert paper.BASELINE_LAW.gamma() == pytest.approx(paper.GAMMA["baseline"], abs=5e-4)
    assert paper.SMELT_LAW.gamma() == pytest.approx(paper.GAMMA["smelt"], abs=5e-4)


def test_ce_gain_zero_for_identical_laws_and_sign():
    assert gains.ce_gain(paper.BASELINE_LAW, paper.BASELINE_LAW, 1e21, 0.9) == pytest.approx(0.0, abs=1e-12)
    assert gains.ce_gain(paper.SMELT_LAW, paper.BASELINE_LAW, 1e21, 0.95) < 0


def test_sigmoid_calibration_recovers_and_residual_sign():
    rng = np.random.default_rng(1)
    truth = {"a": 0.4, "b": 0.25, "alpha": 6.0, "tau": 2.1, "d": -1}
    loss = rng.uniform(1.8, 2.6, 96)
    score = gains.calibrated_score(truth, loss) + 0.002 * rng.standard_normal(96)
    fitted = gains.sigmoid_calibration(loss, score, -1)
    for key in ("a", "b", "alpha", "tau"):
        assert fitted[key] == pytest.approx(truth[key], rel=0.1, abs=0.02)
    better = gains.calibrated_score(truth, loss[:5]) + 0.05          # higher accuracy at the same loss
    assert (gains.equal_loss_residuals(fitted, loss[:5], better, +1) > 0.03).all()
    with pytest.raises(ValueError):
        gains.sigmoid_calibration(loss, score, 0)

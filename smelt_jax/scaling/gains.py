"""Compute-optimal frontier, compute-equivalent (CE) gains, and the loss-to-benchmark calibration (§7–§8).

CE gain at a target compute C: take the target law's frontier loss L*_tgt(C), find the compute C_ref at
which the reference law's frontier reaches it, CE = 1 - C / C_ref. C_ref is infinite (CE = 1) when the
reference never reaches that loss (L* <= its E).
"""

from __future__ import annotations

import numpy as np

from smelt_jax.scaling.laws import SmeltLaw
from smelt_jax.platform.errors import UsageError

# Far above any training run (all of today's computing is ~1e30 FLOP/year); beyond it the frontier
# losses are numerically at E and the gains (1 - C/C_ref) are artefacts (-4e271 at C=1e300).
MAX_COMPUTE = 1e40


def ce_gain(reference: SmeltLaw, target: SmeltLaw, compute, sparsity):
    """CE(C, S) = 1 - C / C_ref (broadcasting compute and sparsity)."""
    compute = np.asarray(compute, float)
    loss = target.frontier_loss(compute, sparsity)
    return 1.0 - compute / reference.compute_for_loss(loss, sparsity)


def _gain_row(reference: SmeltLaw, target: SmeltLaw, c: float, s: float) -> dict:
    row = {"C": c, "S": s, "ce_gain": float(ce_gain(reference, target, c, s)),
           "loss_target": float(target.frontier_loss(c, s)),
           "loss_reference": float(reference.frontier_loss(c, s))}
    for tag, law in (("reference", reference), ("target", target)):
        row[f"F_{tag}"] = float(law.optimal_flops_per_token(c, s))
        row[f"D_{tag}"] = float(law.optimal_tokens(c, s))
        row[f"tpp_{tag}"] = float(law.tokens_per_parameter(c, s))
    return row


def gain_rows(reference: SmeltLaw, target: SmeltLaw, computes, sparsities, *, compute_range=None,
              reference_draws=None, target_draws=None, level: float = 0.95) -> list[dict]:
    """One row per (C, S), sorted by C then S: CE gain, frontier losses, F*, D*, TPP of both laws.

    compute_range: (C_min, C_max) of the fitted data; rows outside are flagged `extrapolated`.
    reference_draws / target_draws: paired lists of bootstrap laws; add `ce_lo`, `ce_hi` percentiles.
    """
    computes = [float(v) for v in computes]
    bad = [v for v in computes if not (np.isfinite(v) and 0 < v <= MAX_COMPUTE)]
    if bad:
        raise UsageError(f"compute must be positive and finite FLOPs, at most {MAX_COMPUTE:g}; got {bad}")
    rows = []
    for c in sorted(computes):
        for s in sorted(float(v) for v in sparsities):
            # A degenerate law can give non-finite values at a valid compute: kept as such (tables
            # write n/a, scaling.health reports them), never turned into an error here.
            with np.errstate(all="ignore"):
                row = _gain_row(reference, target, c, s)
                if compute_range is not None:
                    row["extrapolated"] = bool(c < compute_range[0] or c > compute_range[1])
                if reference_draws is not None and target_draws is not None:
                    draws = np.array([ce_gain(r, t, c, s) for r, t in zip(reference_draws, target_draws)])
                    draws = draws[np.isfinite(draws)]  # a degenerate draw has no gain to rank
                    tail = 50.0 * (1.0 - level)
                    row["ce_lo"] = float(np.percentile(draws, tail)) if draws.size else float("nan")
                    row["ce_hi"] = float(np.percentile(draws, 100.0 - tail)) if draws.size else float("nan")
            rows.append(row)
    return rows


def fitted_compute_range(flops_per_token, tokens) -> tuple[float, float]:
    """(min, max) of C = F * D over the fitted points."""
    c = np.asarray(flops_per_token, float) * np.asarray(tokens, float)
    return float(c.min()), float(c.max())


# ---------------------------------------------------------------------------------------------------
# Loss-to-benchmark calibration (§8)

def sigmoid_calibration(loss, score, direction: int):
    """y(l) = b + a / (1 + exp(-d alpha (l - tau))), a, alpha > 0; d = +1 (Completion-type, score grows
    with loss), -1 (accuracies). Least squares. Returns a dict {a, b, alpha, tau, d}."""
    import scipy.optimize
    from scipy.special import expit

    if direction not in (1, -1):
        raise UsageError("direction d must be +1 or -1")
    loss, score = np.asarray(loss, float), np.asarray(score, float)
    if len(loss) < 5 or len(loss) != len(score):
        raise UsageError("calibration needs at least 5 paired (loss, score) points")

    def residual(p):
        b, log_a, log_alpha, tau = p
        return b + np.exp(log_a) * expit(direction * np.exp(log_alpha) * (loss - tau)) - score

    span = max(np.ptp(score), 1e-6)
    best = None
    for log_alpha in (0.0, 1.0, 2.0, 3.0):
        start = np.array([score.min() - 0.1 * span, np.log(1.2 * span), log_alpha, np.median(loss)])
        res = scipy.optimize.least_squares(residual, start, method="lm", max_nfev=5000)
        if best is None or res.cost < best.cost:
            best = res
    b, log_a, log_alpha, tau = best.x
    return {"a": float(np.exp(log_a)), "b": float(b), "alpha": float(np.exp(log_alpha)), "tau": float(tau),
            "d": int(direction)}


def calibrated_score(calibration: dict, loss):
    from scipy.special import expit

    c = calibration
    return c["b"] + c["a"] * expit(c["d"] * c["alpha"] * (np.asarray(loss, float) - c["tau"]))


def equal_loss_residuals(calibration: dict, loss, score, sign: int):
    """delta = s (y - y_hat(l)): > 0 when the model beats a calibration-set model of the same loss
    (s = -1 for Completion-type scores, where lower is better; +1 for accuracies)."""
    if sign not in (1, -1):
        raise UsageError("sign s must be +1 or -1")
    return sign * (np.asarray(score, float) - calibrated_score(calibration, loss))

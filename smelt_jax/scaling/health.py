"""Is a fit worth reading? Plain checks of a fitted law and its CE-gain rows, as sentences for a report.

A fit can come back "converged" and still mean nothing: too few points for its parameters, an exponent
at zero or a coefficient that vanished (the optimizer traded one term for another), or CE gains that
are infinite because the two frontiers never meet, or a table whose loss is constant (any exponent fits
it: 1e10 as well as 1, at no cost). `assess_fit` names each of these; an empty list means none was
found.
"""

from __future__ import annotations

import math

SMELT_LAW_PARAMETERS = 6
POINTS_PER_PARAMETER = 4  # below this a 6-parameter law is not identified (the paper fits 72 points)
MIN_EXPONENT = 1e-3  # a fitted exponent below this has left its term with no dependence on its variable
MIN_COEFFICIENT = 1e-12  # a coefficient below this has switched its term off
# Fitted exponents of real data lie well below 1 (the paper's 0.37-0.70, Chinchilla's 0.28-0.35, every
# fit under fits/ at most 1.0); one above this makes its term vanish across the data (e.g. 1e10-1e23 on
# a constant-loss table): the exponent sits where nothing bounds it, so the data do not identify it.
MAX_EXPONENT = 5.0
CONSTANT_LOSS = 1e-6  # losses whose relative spread (max - min) / mean is below this carry no trend


def constant_loss(losses) -> str | None:
    """Why `losses` (the fitted points' losses) identify no law, or None: all equal, or within a relative
    spread of CONSTANT_LOSS."""
    values = [float(v) for v in losses]
    if len(values) < 2:
        return None
    low, high = min(values), max(values)
    mean = sum(values) / len(values)
    if high - low <= CONSTANT_LOSS * abs(mean):
        return (f"constant loss ({len(values)} points, all {mean:.6g} within {high - low:.2g}: no trend for "
                "any term to fit)")
    return None


def assess_fit(coefficients: dict, n_params: int = SMELT_LAW_PARAMETERS, losses=None) -> list[str]:
    """Problems of one smelt-law fit (coefficients.json as a dict; `losses`: its fitted points' losses,
    points.csv's, when known); [] when none is found."""
    problems = []
    arch = coefficients.get("arch") or "fit"
    if losses is not None and (flat := constant_loss(losses)):
        problems.append(f"{arch}: degenerate: {flat}")
    n_points = coefficients.get("n_points")
    if n_points is not None and n_points < POINTS_PER_PARAMETER * n_params:
        problems.append(f"{arch}: unidentified: {n_points} points for {n_params} parameters (want at "
                        f"least {POINTS_PER_PARAMETER * n_params})")
    if coefficients.get("converged") is False:
        problems.append(f"{arch}: the optimizer did not converge (gradient norm "
                        f"{coefficients.get('grad_norm', float('nan')):.2g})")
    values = {name: coefficients.get(name) for name in ("E", "A", "K", "a", "b", "c")}
    bad = [name for name, value in values.items()
           if value is None or not math.isfinite(float(value))]
    if bad:
        problems.append(f"{arch}: degenerate: non-finite {', '.join(bad)}")
        return problems
    for name in ("a", "c"):
        if values[name] < MIN_EXPONENT:
            problems.append(f"{arch}: degenerate: exponent {name} = {values[name]:.3g} (no dependence on "
                            f"{'F' if name == 'a' else 'D'})")
        elif values[name] > MAX_EXPONENT:
            problems.append(f"{arch}: degenerate: exponent {name} = {values[name]:.3g} (absurd, above "
                            f"{MAX_EXPONENT:g}: its term vanishes across the data, which do not identify it)")
    for name in ("A", "K"):
        if values[name] < MIN_COEFFICIENT:
            problems.append(f"{arch}: degenerate: coefficient {name} = {values[name]:.3g} (its term is off)")
    if values["E"] < MIN_COEFFICIENT:
        problems.append(f"{arch}: degenerate: irreducible loss E = {values['E']:.3g} (the endpoints do not "
                        "identify an asymptote: the other terms carry the whole loss)")
    return problems


GAIN_VALUES = {"ce_gain": "CE gain", "tpp_reference": "TPP of the reference",
               "tpp_target": "TPP of the target", "loss_target": "frontier loss of the target"}


def assess_gains(rows: list[dict]) -> list[str]:
    """Problems of CE-gain rows: gains or optimal allocations that are not finite numbers, by name."""
    problems = []
    for row in rows:
        bad = [label for key, label in GAIN_VALUES.items()
               if row.get(key) is None or not math.isfinite(row[key]) or abs(row[key]) > 1e30]
        if bad:
            problems.append(f"C={row['C']:.0e}, S={row['S']:.2f}: {', '.join(bad)} not a finite number "
                            "(a degenerate fit, or frontiers that do not meet there)")
    return problems

"""Is a fit worth reading? Plain checks of a fitted law and its CE-gain rows, as sentences for a report.

A fit can come back "converged" and still mean nothing: too few points for its parameters, an exponent
at zero or a coefficient that vanished (the optimizer traded one term for another), or CE gains that
are infinite because the two frontiers never meet. `assess_fit` names each of these; an empty list
means none was found.
"""

from __future__ import annotations

import math

SMELT_LAW_PARAMETERS = 6
POINTS_PER_PARAMETER = 4  # below this a 6-parameter law is not identified (the paper fits 72 points)
MIN_EXPONENT = 1e-3  # a fitted exponent below this has left its term with no dependence on its variable
MIN_COEFFICIENT = 1e-12  # a coefficient below this has switched its term off


def assess_fit(coefficients: dict, n_params: int = SMELT_LAW_PARAMETERS) -> list[str]:
    """Problems of one smelt-law fit (coefficients.json as a dict); [] when none is found."""
    problems = []
    arch = coefficients.get("arch") or "fit"
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

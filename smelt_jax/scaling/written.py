"""The written form of fit results: each quantity at the precision its data support, and a degenerate
fit's parameters at their bounds written as the bound, flagged, so that a change in a written file is a
change in the result, not in the CPU's last bits.

Significant digits written, per quantity (DIGITS by JSON key or table column: JSON and CSV through
`rounded`; markdown and LaTeX through tables.fmt's formats):
- coefficients (a law's parameters) and fit statistics (objective, RMSE, Epoch's sigma): 6. The L-BFGS
  stops at a relative objective change of 1e-12, which fixes the parameters to about sqrt(1e-12) = 1e-6
  relative; BFGS on Epoch's kinked objective ends no better.
- standard errors and interval ends: 3. From B bootstrap draws an SE carries a relative Monte-Carlo error
  of about 1/sqrt(2B) (1.6% at 2000 draws, 1.1% at 4000) and a 2.5% percentile more, so a 4th digit is
  noise.
- gradient norms: 2 (an optimizer diagnostic: its size says whether a fit stopped at a minimum).
- CE gains, TPP and frontier losses: the tables' fixed formats (tables.FORMATS: a CE gain to 0.01
  percentage points, its interval ends to 0.1, TPP to 0.1 below 1e4 and to 4 significant digits above,
  losses to 1e-4 nats).
- a fitted law's predictions at the data and their residuals: 1e-5 nats (PREDICTION_DECIMALS; a
  prediction carries its coefficients' 1e-6 relative precision, a few 1e-6 nats at losses of 1-5).
- anything else (inputs, compute ranges, shares, counts): 8.

Bounds: a parameter fitted as exp(raw) (E, A, K, a, c of the smelt law) has the lower bound 0, reached
only as raw runs off to -inf; where the optimizer stopped on the way (1e-37, 5e-39: whatever the CPU's
arithmetic gave) depends on the machine. Below AT_BOUND it is written as 0 and named under
"at_bound". An interval end or SE beyond UNBOUNDED (or not finite) is written as +-Infinity and the
reason is given under the parameter's "unbounded".
"""

from __future__ import annotations

import math

import numpy as np

COEFFICIENT_DIGITS = 6
SPREAD_DIGITS = 3
DIAGNOSTIC_DIGITS = 2
DEFAULT_DIGITS = 8
# JSON keys and the digits of the floats under them (a key's own number, or the numbers of its dict)
PREDICTION_DECIMALS = 5
DIGITS = {"se": SPREAD_DIGITS, "lo": SPREAD_DIGITS, "hi": SPREAD_DIGITS, "grad_norm": DIAGNOSTIC_DIGITS,
          # the preregistered verdict's checks and table: interval ends
          **{f"{name}_{end}": SPREAD_DIGITS for name in ("E", "a", "c") for end in ("lo", "hi")},
          **{name: COEFFICIENT_DIGITS for name in ("E", "A", "B", "K", "a", "b", "c", "alpha", "beta", "phi",
                                                   "objective", "rmse", "sigma")}}
AT_BOUND = 1e-12  # health.MIN_COEFFICIENT: below this a coefficient has switched its term off
UNBOUNDED = 1e30  # tables.MAX_TABLE_VALUE: beyond this a bootstrap value is a draw that ran off


def rounded(value, digits: int = DEFAULT_DIGITS, key: str | None = None):
    """`value` with every float rounded to DIGITS[key] (else `digits`) significant digits, recursively;
    dict keys sorted; NumPy scalars as Python numbers."""
    digits = DIGITS.get(key, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits, k) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(f"{float(value):.{digits}g}")
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def lower_bounded(law) -> list[str]:
    """The law's parameters fitted as exp(raw), so bounded below by 0."""
    return [name for name in law.param_names if f"log_{name}" in law.raw_names]


def settle_bounds(coefficients: dict, law) -> dict:
    """coefficients.json's content with parameters at their bound written as the bound ("at_bound" names
    them) and interval values beyond UNBOUNDED written as infinite ("unbounded" says why)."""
    return settle(coefficients, lower_bounded(law))


def settle(coefficients: dict, bounded: list[str]) -> dict:
    """`settle_bounds` for coefficients whose parameters named in `bounded` are bounded below by 0."""
    out = dict(coefficients)
    at_bound = {name: "0 (the fit drove it to its lower bound: the data do not identify this term)"
                for name in bounded if name in out and abs(out[name]) < AT_BOUND}
    for name in at_bound:
        out[name] = 0.0
    if at_bound:
        out["at_bound"] = at_bound
    if "intervals" in out:
        out["intervals"] = {name: settle_interval(values, name in bounded)
                            for name, values in out["intervals"].items()}
    return out


def settle_interval(values: dict, bounded_below: bool) -> dict:
    """One parameter's {"se", "lo", "hi"}: ends below AT_BOUND of a parameter bounded at 0 written as 0,
    values beyond UNBOUNDED as infinite with the reason."""
    out, unbounded = dict(values), []
    for key in ("se", "lo", "hi"):
        value = out.get(key)
        if value is None:
            continue
        if not math.isfinite(value) or abs(value) > UNBOUNDED:
            out[key] = math.copysign(math.inf, value) if not math.isnan(value) else math.inf
            unbounded.append(key)
        elif bounded_below and abs(value) < AT_BOUND:
            out[key] = 0.0
    if unbounded:
        out["unbounded"] = (f"{', '.join(unbounded)}: bootstrap draws beyond {UNBOUNDED:g} (refits that "
                            "ran off along a direction the data do not bound)")
    return out

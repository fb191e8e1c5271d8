"""The pre-registered `ladder` predictions (docs/results-ladder.md): pure functions of endpoint tables.

A *gap* is L(SMELT) - L(Baseline) of one matched pair at one horizon; its compute is the Baseline's
C = F x D (training FLOPs per token times tokens). The registered forms, each fitted by least squares to
nano's matched endpoints at >= 4M tokens (`nano_gaps`):

    log-linear     gap = a + b log10 C                  (crosses zero at C = 10^(-a/b) when b < 0)
    power          gap = 10^a C^b                       (never crosses zero)
    width+tokens   gap = a + b log10 F + c log10 D      (width and tokens as separate terms)

Intervals resample whole pairs (a run's horizons are branches of one trajectory, not independent
points): each draw refits every form on the drawn pairs and adds one of that fit's residuals, so the
90% interval is a prediction interval for one new pair's gap, not only for the fitted mean.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from smelt_jax.design import paper

MIN_TOKENS = 3.5e6  # "at >= 4M tokens": the 4, 7 and 10M branches (endpoints land a few thousand tokens off)
FORMS = ("log-linear", "power", "width+tokens")
LEVEL = 0.90
N_DRAWS, SEED = 4000, 0
# The paper law's break-even path: F_smelt = F_baseline, sparsity S, and a fixed tokens-per-FLOP ratio
# D / F. Central ratio and interval: the geometric middle and the ends of nano's >= 4M endpoints' span.
PAPER_SPARSITY = 0.937  # nano's and the ladder's compute-equivalent sparsity (0.936-0.938)
RMSE_BAND = math.hypot(paper.RMSE["baseline"], paper.RMSE["smelt"])


def matched_gaps(results: pd.DataFrame, min_tokens: float = MIN_TOKENS) -> pd.DataFrame:
    """Every matched (Baseline, SMELT) endpoint pair of a suite table at >= min_tokens: pair_id, scale,
    branch, tokens, flops (the Baseline's F), compute (F x D), baseline, smelt (losses) and gap."""
    base = results[results["arch"] == "baseline"].set_index(["pair_id", "branch"])
    smelt = results[results["arch"] == "smelt"].set_index(["pair_id", "branch"])
    rows = []
    for key in sorted(set(base.index) & set(smelt.index)):
        b, s = base.loc[key], smelt.loc[key]
        if b["tokens"] < min_tokens:
            continue
        rows.append({"pair_id": key[0], "scale": b["scale"], "branch": int(key[1]), "tokens": int(b["tokens"]),
                     "flops": float(b["flops_per_token"]), "compute": float(b["flops_per_token"] * b["tokens"]),
                     "baseline": float(b["val_loss"]), "smelt": float(s["val_loss"]),
                     "gap": float(s["val_loss"] - b["val_loss"])})
    return pd.DataFrame(rows)


def _design(form: str, flops, tokens) -> np.ndarray:
    flops, tokens = np.asarray(flops, float), np.asarray(tokens, float)
    one = np.ones_like(flops)
    if form == "width+tokens":
        return np.stack([one, np.log10(flops), np.log10(tokens)], axis=-1)
    return np.stack([one, np.log10(flops * tokens)], axis=-1)


def fit_form(form: str, table: pd.DataFrame) -> np.ndarray:
    """Least-squares coefficients of `form` on a gap table (columns flops, tokens, gap)."""
    target = np.log10(table["gap"]) if form == "power" else table["gap"]
    coef, *_ = np.linalg.lstsq(_design(form, table["flops"], table["tokens"]), np.asarray(target, float),
                               rcond=None)
    return coef


def predict_form(form: str, coef: np.ndarray, flops, tokens) -> np.ndarray:
    value = _design(form, flops, tokens) @ coef
    return 10.0 ** value if form == "power" else value


def _residuals(form: str, coef: np.ndarray, table: pd.DataFrame) -> np.ndarray:
    fitted = _design(form, table["flops"], table["tokens"]) @ coef
    target = np.log10(table["gap"]) if form == "power" else table["gap"]
    return np.asarray(target, float) - fitted


def break_even_10m(form: str, coef: np.ndarray, tokens: float = 10e6) -> float:
    """Compute C = F x D at which the form's gap is zero with D = `tokens` (inf when it never is)."""
    if form == "power":
        return math.inf
    if form == "log-linear":
        return 10.0 ** (-coef[0] / coef[1]) if coef[1] < 0 else math.inf
    if coef[1] >= 0:
        return math.inf
    log_f = -(coef[0] + coef[2] * math.log10(tokens)) / coef[1]
    return 10.0 ** log_f * tokens


def bootstrap(table: pd.DataFrame, points: pd.DataFrame, *, n_draws: int = N_DRAWS, seed: int = SEED,
              level: float = LEVEL) -> pd.DataFrame:
    """Per form and point (columns label, flops, tokens): the full-data prediction and the `level`
    prediction interval from resampling whole pairs (draws with fewer than two widths are redrawn), and
    the form's break-even compute at 10M tokens with its interval."""
    rng = np.random.default_rng(seed)
    pairs = sorted(table["pair_id"].unique())
    by_pair = {p: table[table["pair_id"] == p] for p in pairs}
    draws = {form: [] for form in FORMS}
    breaks = {form: [] for form in FORMS}
    while len(draws[FORMS[0]]) < n_draws:
        chosen = rng.choice(len(pairs), size=len(pairs), replace=True)
        sample = pd.concat([by_pair[pairs[i]] for i in chosen], ignore_index=True)
        if sample["flops"].nunique() < 2:
            continue
        for form in FORMS:
            coef = fit_form(form, sample)
            noise = rng.choice(_residuals(form, coef, sample), size=len(points))
            central = _design(form, points["flops"], points["tokens"]) @ coef + noise
            draws[form].append(10.0 ** central if form == "power" else central)
            breaks[form].append(break_even_10m(form, coef))
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    rows = []
    for form in FORMS:
        coef = fit_form(form, table)
        values = np.asarray(draws[form])
        best = predict_form(form, coef, points["flops"], points["tokens"])
        for j, point in enumerate(points.itertuples()):
            rows.append({"form": form, "point": point.label, "tokens": int(point.tokens),
                         "compute": float(point.flops * point.tokens), "predicted": float(best[j]),
                         "low": float(np.quantile(values[:, j], lo)), "high": float(np.quantile(values[:, j], hi))})
        crossing = np.asarray(breaks[form])
        finite = np.isfinite(crossing)
        rows.append({"form": form, "point": "break-even at 10M tokens", "tokens": int(10e6),
                     "compute": break_even_10m(form, coef), "predicted": math.nan,
                     "low": float(np.quantile(crossing, lo)) if finite.mean() > lo else math.inf,
                     "high": float(np.quantile(crossing, hi)) if finite.mean() >= hi else math.inf,
                     "share_crossing": float(finite.mean())})
    return pd.DataFrame(rows)


def paper_gap(flops_base, sparsity_base, flops_smelt, sparsity_smelt, tokens) -> np.ndarray:
    """The paper's fitted laws' L_smelt(F_s, S_s, D) - L_base(F_b, S_b, D) (as nano2's transfer table)."""
    return (paper.SMELT_LAW.predict(flops_smelt, sparsity_smelt, tokens)
            - paper.BASELINE_LAW.predict(flops_base, sparsity_base, tokens))


def paper_break_even(tokens_per_flop: float, sparsity: float = PAPER_SPARSITY, band: float = 0.0) -> tuple:
    """Computes C (ascending) where the paper law's gap along F_s = F_b, D = r F, C = F D first falls to
    `band` and, if it does, where it rises back above it: (first, last) of the region gap <= band."""
    computes = np.logspace(12, 27, 3001)
    flops = np.sqrt(computes / tokens_per_flop)
    gap = paper_gap(flops, sparsity, flops, sparsity, computes / flops)
    inside = np.nonzero(gap <= band)[0]
    if not len(inside):
        return math.inf, math.inf
    return float(computes[inside[0]]), float(computes[inside[-1]])


def tokens_per_flop_span(table: pd.DataFrame) -> tuple[float, float, float]:
    """(low, geometric middle, high) of D / F over a gap table."""
    ratio = table["tokens"] / table["flops"]
    low, high = float(ratio.min()), float(ratio.max())
    return low, math.sqrt(low * high), high

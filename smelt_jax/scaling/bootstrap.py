"""Cell bootstrap: resample whole cells (all horizons of one configuration) with replacement and refit.

A resample with replacement is a vector of integer point weights, so all draws share shapes and run as one
vectorised batch of L-BFGS fits (fit.minimise_huber), in chunks to bound memory.

Shapes: cells [n] (any hashable labels), weights [draws, n], raw [draws, p].
"""

from __future__ import annotations

import numpy as np

from smelt_jax.scaling import fit as fitting


def cell_weights(cells, n_draws: int, seed: int) -> np.ndarray:
    """[n_draws, n] point weights: draw the distinct cells with replacement; a point's weight is how often
    its cell was drawn."""
    labels, point_cell = np.unique(np.asarray(cells), return_inverse=True)
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(labels), size=(n_draws, len(labels)))
    counts = np.zeros((n_draws, len(labels)))
    np.add.at(counts, (np.arange(n_draws)[:, None], drawn), 1.0)
    return counts[:, point_cell]


def epoch_point_weights(n_rows: int, kept_rows, n_draws: int = 4000, seed: int = 42) -> np.ndarray:
    """[n_draws, len(kept_rows)] weights of Epoch AI's bootstrap: after np.random.seed(seed), each draw is
    np.random.choice(kept_rows, size=len(kept_rows), replace=True) over the original row numbers."""
    kept_rows = np.asarray(kept_rows)
    position = np.full(n_rows, -1)
    position[kept_rows] = np.arange(len(kept_rows))
    legacy = np.random.RandomState(seed)
    weights = np.zeros((n_draws, len(kept_rows)))
    for d in range(n_draws):
        np.add.at(weights[d], position[legacy.choice(kept_rows, size=len(kept_rows), replace=True)], 1.0)
    return weights


def refit(law, features, loss, weights, starts, *, chunk: int = 1000, max_iter: int = 500) -> dict:
    """Refit for every weight vector from each start [s, p]; keep each draw's best stopped start.

    Returns raw [draws, p], objective [draws], grad_norm [draws], converged [draws].
    """
    log_loss = np.log(np.asarray(loss, np.float64))
    starts = np.atleast_2d(np.asarray(starts, np.float64))
    parts = []
    for lo in range(0, len(weights), chunk):
        out = fitting.minimise_huber(law, features, log_loss, weights[lo:lo + chunk], starts, max_iter=max_iter)
        score = np.where(out["stopped"], out["objective"], np.inf)
        score = np.where(np.isfinite(score).any(1, keepdims=True), score, out["objective"])
        best = np.argmin(np.where(np.isfinite(score), score, np.inf), axis=1)
        pick = np.arange(len(best))
        parts.append({"raw": out["raw"][pick, best], "objective": out["objective"][pick, best],
                      "grad_norm": out["grad_norm"][pick, best], "converged": out["stopped"][pick, best]})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def parameter_draws(law, raw: np.ndarray) -> dict[str, np.ndarray]:
    """{parameter name: [draws]} in the law's published parametrisation (E, A, ... not logs)."""
    values = [law.from_raw(r).to_dict() for r in raw]
    return {name: np.array([v[name] for v in values]) for name in law.param_names}


def intervals(draws: dict[str, np.ndarray], level: float = 0.95) -> dict[str, dict[str, float]]:
    """Per parameter: standard error (ddof=1, as np.cov) and the percentile interval."""
    tail = 50.0 * (1.0 - level)
    out = {}
    for name, values in draws.items():
        values = values[np.isfinite(values)]
        out[name] = {"se": float(np.std(values, ddof=1)), "lo": float(np.percentile(values, tail)),
                     "hi": float(np.percentile(values, 100.0 - tail))}
    return out


def _is_law(law, raw) -> bool:
    """Whether a draw's raw parameters make a valid law (none overflows to inf): a draw that ran off
    to an infinite coefficient did not converge to anything."""
    with np.errstate(over="ignore"):
        try:
            law.from_raw(raw)
        except ValueError:
            return False
    return True


def cell_bootstrap(law, features, loss, cells, best_raw, *, n_draws: int = 2000, seed: int = 0,
                   extra_starts=None) -> dict:
    """Cell bootstrap of a Huber fit, each draw started from the full-data optimum (plus extra_starts).

    Returns {"raw": [draws, p], "converged": [draws], "intervals": {...}, "n_draws", "n_cells", "seed"}.
    """
    starts = np.atleast_2d(best_raw) if extra_starts is None else np.vstack([best_raw, extra_starts])
    weights = cell_weights(cells, n_draws, seed)
    out = refit(law, features, loss, weights, starts)
    ok = out["converged"] & np.array([_is_law(law, raw) for raw in out["raw"]], dtype=bool)
    return {"raw": out["raw"], "converged": ok, "n_draws": int(n_draws), "n_converged": int(ok.sum()),
            "n_cells": len(np.unique(np.asarray(cells))), "seed": int(seed),
            "intervals": intervals(parameter_draws(law, out["raw"][ok]))}

"""The pre-registered test of docs/results-nano.md as pure functions of a suite's results table.

Per architecture, L(F, D) = E + A / F^a + K / D^c, fitted in the Chinchilla form with N = F / 6 (so
C = 6 N D = F D): `fd_points` makes the law's table, `fit_fd` fits it with a bootstrap over endpoints
(each endpoint its own cell) or over runs, `verdict` applies the three criteria, `ce_gains` gives the
compute-equivalent gain of a target over a reference at given computes with paired-draw intervals, and
`law_free` the lowest loss each architecture reaches near a compute. Seeded, so `make fits` reproduces it.

Table columns read: run_id, branch, arch, flops_per_token, tokens, val_loss (the results store's rows).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from smelt_jax.platform.errors import UsageError
from smelt_jax.scaling import bootstrap, fit, written
from smelt_jax.scaling.laws import ChinchillaLaw

# The criteria, as written before the runs (docs/results-nano.md).
E_FLOOR = 0.1  # lower 95% bound of E above this, nats
EXPONENT_FLOOR = 0.01  # lower 95% bounds of a and c above this
MAX_RMSE = 0.02  # nats, on the fitted endpoints
LEVEL = 0.95
NEAR = 1.5  # law-free comparison: endpoints within this factor of a compute


def fd_points(results: pd.DataFrame, arch: str, resample: str = "endpoint") -> pd.DataFrame:
    """The endpoints of one architecture as the law's table: N = F / 6, D, loss and the bootstrap cell
    (`resample` "endpoint": each endpoint alone; "run": a run's horizons together)."""
    rows = results[results["arch"].astype(str) == arch]
    if rows.empty:
        raise UsageError(f"no endpoints of arch {arch!r} in the results table")
    if resample not in ("endpoint", "run"):
        raise UsageError(f"resample must be 'endpoint' or 'run', got {resample!r}")
    cell = rows["run_id"].astype(str)
    if resample == "endpoint":
        cell = cell + "/" + rows["branch"].astype(int).astype(str)
    return pd.DataFrame({"run_id": rows["run_id"].astype(str), "branch": rows["branch"].astype(int),
                         "F": rows["flops_per_token"].astype(float),
                         "N": rows["flops_per_token"].astype(float) / 6.0, "D": rows["tokens"].astype(float),
                         "loss": rows["val_loss"].astype(float), "cell": cell}).reset_index(drop=True)


FD_NAMES = {"E": "E", "A": "A", "B": "K", "alpha": "a", "beta": "c"}  # ChinchillaLaw's name -> the page's


def _as_fd(law: ChinchillaLaw) -> dict[str, float]:
    """The fit in the page's parametrisation: A = A' 6^a so that the term reads A / F^a."""
    with np.errstate(over="ignore"):  # a degenerate draw (a in the hundreds) gives A = inf, not an error
        scale = float(np.power(6.0, law.alpha))
    return {"E": law.E, "A": law.A * scale, "K": law.B, "a": law.alpha, "c": law.beta}


def fit_fd(points: pd.DataFrame, *, n_draws: int = 2000, seed: int = 0) -> dict:
    """Huber fit of one architecture's points with its bootstrap: {"law", "coefficients" (E, A, K, a, c;
    "at_bound" when one sits at its bound), "rmse", "n_points", "intervals" {name: {"lo", "hi"}}, "draws"
    [laws or None], "n_converged"}. Coefficients and intervals as `written.settle` writes them (a value at
    the bound 0 as 0, one that ran off as infinite), so the verdict reads what the files say."""
    features, loss = ChinchillaLaw.features(points), points["loss"].to_numpy(float)
    result = fit.fit_law(ChinchillaLaw, features, loss)
    law, rmse = result.law, float(result.rmse)
    boot = bootstrap.cell_bootstrap(ChinchillaLaw, features, loss, points["cell"].to_numpy(),
                                    np.asarray(result.raw), n_draws=n_draws, seed=seed)
    draws = [ChinchillaLaw.from_raw(raw) if ok else None for raw, ok in zip(boot["raw"], boot["converged"])]
    fd = np.array([list(_as_fd(d).values()) for d in draws if d is not None]).reshape(-1, 5)
    tail = 100 * (1 - LEVEL) / 2
    intervals = {name: {"lo": float(np.percentile(fd[:, i], tail)), "hi": float(np.percentile(fd[:, i], 100 - tail))}
                 for i, name in enumerate(("E", "A", "K", "a", "c"))} if len(fd) else {}
    settled = written.settle({**_as_fd(law), "intervals": intervals},
                             [FD_NAMES[name] for name in written.lower_bounded(ChinchillaLaw)])
    intervals = settled.pop("intervals")
    return {"law": law, "coefficients": settled, "rmse": rmse, "n_points": len(points),
            "intervals": intervals, "draws": draws, "n_converged": boot["n_converged"], "n_draws": n_draws,
            "converged": bool(result.converged)}


def verdict(fitted: dict) -> dict:
    """The three criteria of docs/results-nano.md: {"counts": bool, "failed": [sentences], "checks"}."""
    iv = fitted["intervals"]
    checks = {"E_lo": iv.get("E", {}).get("lo", float("nan")), "a_lo": iv.get("a", {}).get("lo", float("nan")),
              "c_lo": iv.get("c", {}).get("lo", float("nan")), "rmse": fitted["rmse"]}
    failed = []
    if not checks["E_lo"] > E_FLOOR:
        failed.append(f"E's lower 95% bound {checks['E_lo']:.3g} is not above {E_FLOOR} nats")
    for name in ("a", "c"):
        if not checks[f"{name}_lo"] > EXPONENT_FLOOR:
            failed.append(f"{name}'s lower 95% bound {checks[f'{name}_lo']:.3g} is not above {EXPONENT_FLOOR}")
    if not checks["rmse"] <= MAX_RMSE:
        failed.append(f"RMSE {checks['rmse']:.4f} nats is above {MAX_RMSE}")
    return {"counts": not failed, "failed": failed, "checks": checks}


def inside_computes(points: pd.DataFrame, shares=(0.2, 0.5, 0.8)) -> list[float]:
    """Computes at 20/50/80% of the log span of C = F D, to one significant figure."""
    c = points["F"] * points["D"]
    low, high = math.log10(float(c.min())), math.log10(float(c.max()))
    out = []
    for share in shares:
        value = 10 ** (low + share * (high - low))
        exponent = math.floor(math.log10(value))
        out.append(float(round(value / 10 ** exponent) * 10.0 ** exponent))
    return out


def _ce(reference: ChinchillaLaw, target: ChinchillaLaw, compute: float) -> float:
    with np.errstate(all="ignore"):
        return float(1.0 - compute / reference.compute_for_loss(target.frontier_loss(compute)))


def ce_gains(reference: dict, target: dict, computes) -> pd.DataFrame:
    """CE(C) = 1 - C / C_ref of target over reference (fit_fd outputs) with 95% intervals over the
    paired draws (the same draw index: the same seed resamples the same endpoint positions)."""
    rows = []
    tail = 100 * (1 - LEVEL) / 2
    for c in computes:
        draws = np.array([_ce(r, t, c) for r, t in zip(reference["draws"], target["draws"])
                          if r is not None and t is not None])
        draws = draws[np.isfinite(draws)]
        lo, hi = (np.percentile(draws, tail), np.percentile(draws, 100 - tail)) if len(draws) else (np.nan, np.nan)
        gain = _ce(reference["law"], target["law"], c)
        rows.append({"C": c, "ce_gain": gain, "ce_lo": float(lo), "ce_hi": float(hi), "n_draws": len(draws),
                     "resolved": bool(len(draws) and (lo > 0 or hi < 0))})
    return pd.DataFrame(rows)


def law_free(results: pd.DataFrame, computes, archs=("baseline", "smelt")) -> pd.DataFrame:
    """The lowest loss each architecture reaches at each compute: every run's loss interpolated
    log-linearly in compute along its horizons at C (runs whose horizons do not reach C are left out;
    a run is counted only when C lies within NEAR of one of its endpoints' computes)."""
    rows = []
    for c in computes:
        row = {"C": c}
        for arch in archs:
            best = np.nan
            for _, run in results[results["arch"].astype(str) == arch].groupby("run_id"):
                run = run.sort_values("tokens")
                comp = np.log(run["flops_per_token"].to_numpy(float) * run["tokens"].to_numpy(float))
                if not comp.min() <= math.log(c) <= comp.max():
                    continue
                if np.min(np.abs(comp - math.log(c))) > math.log(NEAR):
                    continue
                value = float(np.interp(math.log(c), comp, run["val_loss"].to_numpy(float)))
                best = value if not np.isfinite(best) else min(best, value)
            row[f"loss_{arch}"] = best
        row["delta"] = row[f"loss_{archs[1]}"] - row[f"loss_{archs[0]}"]
        rows.append(row)
    return pd.DataFrame(rows)


def split_noise_runs(results: pd.DataFrame, noise_pairs: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the rows the fits read, the rows of the repeat-seed pairs): `noise_pairs` maps a repeat's pair_id
    to the pair_id it repeats (fit.json's "noise_pairs"); repeats never enter a fit."""
    repeat = results["pair_id"].astype(str).isin(noise_pairs)
    return results[~repeat].reset_index(drop=True), results[repeat].reset_index(drop=True)


def seed_noise(results: pd.DataFrame, repeats: pd.DataFrame, noise_pairs: dict[str, str]) -> pd.DataFrame:
    """Per repeated pair and branch: each architecture's loss at both seeds and their difference, and the
    difference of the pair's SMELT - Baseline delta between the seeds (nats). Branches trained at only
    one seed are left out."""
    def losses(frame, pair_id):
        chosen = frame[frame["pair_id"].astype(str) == pair_id]
        return {(str(r["arch"]), int(r["branch"])): float(r["val_loss"]) for _, r in chosen.iterrows()}

    rows = []
    for repeat_id, original_id in sorted(noise_pairs.items()):
        first, second = losses(results, original_id), losses(repeats, repeat_id)
        for branch in sorted({b for _, b in first} & {b for _, b in second}):
            archs = ("baseline", "smelt")
            if not all((arch, branch) in first and (arch, branch) in second for arch in archs):
                continue
            row = {"pair_id": original_id, "repeat": repeat_id, "branch": branch}
            for arch in archs:
                row[f"{arch}_seed0"], row[f"{arch}_repeat"] = first[arch, branch], second[arch, branch]
                row[f"{arch}_diff"] = second[arch, branch] - first[arch, branch]
            row["delta_seed0"] = first["smelt", branch] - first["baseline", branch]
            row["delta_repeat"] = second["smelt", branch] - second["baseline", branch]
            row["delta_diff"] = row["delta_repeat"] - row["delta_seed0"]
            rows.append(row)
    return pd.DataFrame(rows)


def verdict_rows(fits: dict[str, dict], verdicts: dict[str, dict], expected_points: int) -> pd.DataFrame:
    """One row per architecture: its fitted E, a, c with 95% intervals, the RMSE, the points fitted
    against the pre-registered count, and whether the fit counts (with the failed criteria)."""
    rows = []
    for arch, fitted in fits.items():
        iv, co = fitted["intervals"], fitted["coefficients"]
        row = {"arch": arch, "n_points": fitted["n_points"], "expected_points": expected_points}
        for name in ("E", "a", "c"):
            row[name] = co[name]
            row[f"{name}_lo"] = iv.get(name, {}).get("lo", float("nan"))
            row[f"{name}_hi"] = iv.get(name, {}).get("hi", float("nan"))
        row["rmse"] = fitted["rmse"]
        row["converged_draws"] = f"{fitted['n_converged']}/{fitted['n_draws']}"
        row["counts"] = bool(verdicts[arch]["counts"]) and fitted["n_points"] == expected_points
        reasons = list(verdicts[arch]["failed"])
        if fitted["n_points"] != expected_points:
            reasons.insert(0, f"only {fitted['n_points']} of the {expected_points} pre-registered endpoints")
        row["failed"] = "; ".join(reasons) or "-"
        rows.append(row)
    return pd.DataFrame(rows)

"""Smelt-law fit (72 points, grid start) + cell bootstrap: vectorised JAX L-BFGS vs a plain scipy loop.

Both paths do the same work: screen the law's start grid, refine the best `refine` starts, then refit every
bootstrap draw from the full-data optimum with the draw's cell weights. The vectorised path runs each stage
as one jitted, vmapped batch; the scipy path calls scipy's L-BFGS-B once per start and once per draw (with
the same exact JAX value-and-gradient, jitted). The scipy loop may run fewer draws (`scipy_draws`); its
per-draw time is then scaled linearly to `draws` (draws are independent fits) and the table says so.

Run: `python -m benchmarks.bench_scaling` (or via `make bench`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _table():
    from scaling_synthetic import smelt_table

    from smelt_jax.design import paper

    return smelt_table(paper.BASELINE_LAW, "baseline", noise=0.003, seed=0)


def vectorised(table, draws: int, refine: int):
    from smelt_jax.scaling import bootstrap, fit
    from smelt_jax.scaling.laws import SmeltLaw

    x, loss = SmeltLaw.features(table), table["loss"].to_numpy()
    best = fit.fit_law(SmeltLaw, x, loss, refine=refine)
    boot = bootstrap.cell_bootstrap(SmeltLaw, x, loss, table["cell"].to_numpy(), np.array(best.raw),
                                    n_draws=draws, seed=0)
    return best.objective, boot["raw"]


def scipy_loop(table, draws: int, refine: int):
    import jax
    import jax.numpy as jnp
    import scipy.optimize

    from smelt_jax.scaling import bootstrap, fit
    from smelt_jax.scaling.laws import SmeltLaw

    x, loss = SmeltLaw.features(table), table["loss"].to_numpy()
    with jax.enable_x64(True):
        xj, yj = jnp.asarray(x), jnp.log(jnp.asarray(loss))
        value_and_grad = jax.jit(jax.value_and_grad(
            lambda raw, w: fit.huber_objective(SmeltLaw, raw, xj, yj, w)))

        def solve(start, weights):
            w = jnp.asarray(weights)
            fun = lambda r: tuple(np.asarray(v, np.float64) for v in value_and_grad(jnp.asarray(r), w))
            return scipy.optimize.minimize(fun, start, jac=True, method="L-BFGS-B",
                                           options={"maxiter": 500, "ftol": 1e-12, "gtol": 1e-10})

        starts = fit.screen_starts(SmeltLaw, x, loss, SmeltLaw.start_grid(), refine)
        fits = [solve(s, np.ones(len(loss))) for s in starts]
        best = min(fits, key=lambda r: r.fun)
        weights = bootstrap.cell_weights(table["cell"].to_numpy(), draws, seed=0)
        raws = np.array([solve(best.x, w).x for w in weights])
    return best.fun, raws


def _time(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(draws: int = 2000, scipy_draws: int = 50, refine: int = 64, repeats: int = 2) -> str:
    table = _table()
    t0 = time.perf_counter()
    vectorised(table, draws, refine)                 # first call: includes jit compilation
    first = time.perf_counter() - t0
    vec_time, (vec_obj, vec_raw) = _time(lambda: vectorised(table, draws, refine), repeats)
    sp_time, (sp_obj, sp_raw) = _time(lambda: scipy_loop(table, scipy_draws, refine), max(1, repeats - 1))
    # split the scipy time into the grid part and per-draw part to scale to `draws`
    grid_time, _ = _time(lambda: scipy_loop(table, 0, refine), 1)
    per_draw = max(sp_time - grid_time, 0.0) / max(scipy_draws, 1)
    sp_scaled = grid_time + per_draw * draws
    agree = np.median(np.abs(vec_raw[:scipy_draws, 3:] - sp_raw[:, 3:]))
    lines = [
        (f"Smelt-law fit (72 points, {refine} refined grid starts) + {draws}-draw cell bootstrap; "
         f"median of {repeats} (vectorised) / {max(1, repeats - 1)} (scipy) runs."),
        "",
        "| path | what ran | seconds | per bootstrap draw (ms) |",
        "|---|---|---|---|",
        f"| vectorised JAX L-BFGS (warm) | fit + {draws} draws | {vec_time:.2f} | {1e3 * vec_time / draws:.2f} |",
        f"| vectorised JAX L-BFGS (first call, incl. compile) | fit + {draws} draws | {first:.2f} | |",
        f"| scipy L-BFGS-B loop | fit + {scipy_draws} draws | {sp_time:.2f} | {1e3 * per_draw:.2f} |",
        (f"| scipy L-BFGS-B loop, scaled | fit + {draws} draws (fit {grid_time:.2f} s measured, draws scaled) "
         f"| {sp_scaled:.2f} | |"),
        "",
        (f"Speed-up (warm, same work): **{sp_scaled / vec_time:.1f}x**. Full-data objective: vectorised "
         f"{vec_obj:.6e}, scipy {sp_obj:.6e}; median |exponent difference| over the common draws {agree:.1e}."),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--scipy-draws", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(run(args.draws, args.scipy_draws, repeats=args.repeats))

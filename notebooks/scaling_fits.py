# %% [markdown]
# # Scaling fits, frontiers and compute-equivalent gains
# Reads the fitted laws of a fit folder (`<fits>/baseline/coefficients.json`, `<fits>/smelt/...`, as
# `make fits` writes them; default `fits/micro`, the micro replication; `fits/paper` holds the paper's
# published coefficients), draws the
# compute-optimal frontiers L*(C, S) and tabulates the CE gain of SMELT over the Baseline
# (`smelt_jax.scaling.gains`). With a results table, the endpoints are set against the fitted law.

# %% parameters
import os

FITS_DIR = os.environ.get("SMELT_FITS_DIR", "fits/micro")  # fits/paper: the paper's published laws
CHINCHILLA_DIR = os.environ.get("SMELT_CHINCHILLA_FITS_DIR", "fits/chinchilla")
RESULTS_DIR = os.environ.get("SMELT_RESULTS_DIR", "")  # a folder with results.parquet; empty: none

# %%
from pathlib import Path


import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from smelt_jax.run_files.results import read_results
from smelt_jax.scaling import gains
from smelt_jax.scaling.io import load_coefficients

laws, rows = {}, []
for arch in ("baseline", "smelt"):
    path = Path(FITS_DIR) / arch
    if (path / "coefficients.json").exists():
        data = load_coefficients(path)
        laws[arch] = data["_law"]
        rows.append({"arch": arch, **laws[arch].to_dict(), "gamma": laws[arch].gamma(),
                     "rmse": data.get("rmse"), "n_points": data.get("n_points"), "source": data.get("source")})
coefficients = pd.DataFrame(rows)
print(f"{FITS_DIR}: laws for {sorted(laws)}")
coefficients

# %% [markdown]
# ## Frontiers L*(C, S) and CE gains

# %%
SPARSITIES, COMPUTES = (0.85, 0.95, 0.97), (1e20, 1e21, 1e22)  # the paper's table
pair_file = Path(FITS_DIR) / "pair.json"  # a fit folder's own grid (a trained suite's fitted range)
if pair_file.exists():
    import json

    pair = json.loads(pair_file.read_text())
    SPARSITIES, COMPUTES = tuple(pair["sparsity"]), tuple(pair["compute"])
if {"baseline", "smelt"} <= set(laws):
    table = pd.DataFrame(gains.gain_rows(laws["baseline"], laws["smelt"], COMPUTES, SPARSITIES))
    table["ce_gain_pct"] = 100 * table["ce_gain"]
    print(table.pivot(index="C", columns="S", values="ce_gain_pct").round(1).to_string())
    compute = np.logspace(np.log10(min(COMPUTES)) - 1, np.log10(max(COMPUTES)) + 1, 60)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for s in SPARSITIES:
        for arch, style in (("baseline", "--"), ("smelt", "-")):
            left.plot(compute, laws[arch].frontier_loss(compute, s), style, label=f"{arch} S={s}")
        right.plot(compute, 100 * gains.ce_gain(laws["baseline"], laws["smelt"], compute, s), label=f"S={s}")
    left.set_xscale("log"); left.set_xlabel("compute C (FLOPs)"); left.set_ylabel("frontier loss")
    left.legend(fontsize=6)
    right.set_xscale("log"); right.set_xlabel("compute C (FLOPs)"); right.set_ylabel("CE gain (%)")
    right.legend(fontsize=6)
    figure.tight_layout()
else:
    table = pd.DataFrame()
    print("need both a baseline and a smelt law for the CE gains")
table

# %% [markdown]
# ## Chinchilla reference fit (approach 3), when present

# %%
chinchilla = Path(CHINCHILLA_DIR)
if (chinchilla / "coefficients.json").exists():
    data = load_coefficients(chinchilla)
    print({k: v for k, v in data.items() if not k.startswith("_")})
else:
    print(f"no Chinchilla fit at {chinchilla}")

# %% [markdown]
# ## Endpoints against the fitted law

# %%
results = read_results(RESULTS_DIR) if RESULTS_DIR else pd.DataFrame()
if results.empty:
    print("no results table given (SMELT_RESULTS_DIR)")
else:
    results = results.copy()
    for arch, law in laws.items():
        pick = results["arch"] == arch
        results.loc[pick, "predicted"] = law.predict(results.loc[pick, "flops_per_token"],
                                                     results.loc[pick, "sparsity"], results.loc[pick, "tokens"])
    if "predicted" in results:
        results["residual"] = results["val_loss"] - results["predicted"]
    print(results[[c for c in ("run_id", "branch", "arch", "sparsity", "tokens", "val_loss", "predicted",
                               "residual") if c in results]].to_string(index=False))

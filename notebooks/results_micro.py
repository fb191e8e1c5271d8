# %% [markdown]
# # The micro replication: from the endpoint table to the compute-equivalent gains
# Reads a suite folder as `smelt fit-suite` writes it (default `fits/micro`, the committed micro
# replication; docs/results-micro.md reads it): the endpoints (`results.csv`), the matched-pair wins, the
# law-free empirical gains, the fitted laws with their cell-bootstrap intervals, the CE-gain table, and,
# where present, the per-length gains, the ablations and the mechanistic tables.

# %% parameters
import os

SUITE_DIR = os.environ.get("SMELT_SUITE_DIR", "fits/micro")

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from smelt_jax.design import paper
from smelt_jax.scaling import endpoints
from smelt_jax.scaling.health import assess_fit
from smelt_jax.scaling.io import load_coefficients

folder = Path(SUITE_DIR)
results = pd.read_csv(folder / "results.csv")
print(f"{folder}: {len(results)} endpoints of {results['run_id'].nunique()} runs, "
      f"{results['pair_id'].nunique()} matched pairs")
results.groupby(["scale", "sparsity_label", "arch"])["val_loss"].min().unstack("arch")

# %% [markdown]
# ## Matched pairs: SMELT against its Baseline at the same horizon
# Same tokens, FLOPs per token matched within 4%: a negative delta is a SMELT win, with no law involved.

# %%
wins = endpoints.pair_wins(results)
counts = endpoints.win_counts(wins)
figure, ax = plt.subplots(figsize=(7, 3.5))
for label, group in wins.groupby("sparsity_label"):
    ax.plot(group["tokens"], group["delta"], "o", label=label, alpha=0.7)
ax.axhline(0.0, color="k", lw=0.8)
ax.set_xscale("log"); ax.set_xlabel("training tokens D"); ax.set_ylabel("SMELT - Baseline loss (nats)")
ax.legend(fontsize=7, title="sparsity"); figure.tight_layout(); plt.show()
counts

# %% [markdown]
# ## Empirical compute-equivalent gain (no law)
# Each SMELT endpoint against its Baseline's own horizons: the Baseline compute that reaches the same loss,
# interpolated in log compute. `bound` '>' means SMELT's loss is below every Baseline endpoint, so the gain
# is only a lower bound there.

# %%
empirical = endpoints.empirical_gains(results)
empirical.pivot_table(index=["scale", "sparsity_label"], columns="branch", values="ce_gain").round(3)

# %% [markdown]
# ## The fitted laws, their intervals and their health

# %%
fits = {arch: load_coefficients(folder / arch) for arch in ("baseline", "smelt")}
rows = []
for arch, data in fits.items():
    intervals = data.get("intervals", {})
    for name in data["_law"].param_names:
        interval = intervals.get(name, {})
        rows.append({"arch": arch, "parameter": name, "estimate": getattr(data["_law"], name),
                     "lo": interval.get("lo"), "hi": interval.get("hi")})
    print(f"{arch}: RMSE {data['rmse']:.4f} nats on {data['n_points']} endpoints "
          f"(paper: {paper.RMSE[arch]:.5f} on {paper.N_POINTS})")
    for problem in assess_fit({k: v for k, v in data.items() if not k.startswith("_")}):
        print("  ", problem)
pd.DataFrame(rows).pivot(index="parameter", columns="arch", values=["estimate", "lo", "hi"])

# %% [markdown]
# ## CE gains with their 95% cell-bootstrap intervals

# %%
ce = pd.read_csv(folder / "ce_gain.csv")
print(ce.to_string(index=False))
points = pd.read_csv(folder / "points.csv")
figure, ax = plt.subplots(figsize=(7, 4))
for arch, marker in (("baseline", "o"), ("smelt", "s")):
    pick = points[points["arch"] == arch]
    ax.scatter(pick["F"] * pick["D"], pick["loss"], marker=marker, s=14, label=f"{arch} endpoints")
    compute = np.logspace(np.log10((pick["F"] * pick["D"]).min()) - 0.3, np.log10((pick["F"] * pick["D"]).max()) + 0.3, 50)
    with np.errstate(all="ignore"):
        ax.plot(compute, fits[arch]["_law"].frontier_loss(compute, float(pick["S"].median())), label=f"{arch} frontier")
ax.set_xscale("log"); ax.set_xlabel("compute C = F D (FLOPs)"); ax.set_ylabel("validation loss (nats)")
ax.legend(fontsize=7); figure.tight_layout(); plt.show()

# %% [markdown]
# ## Per-source gains (E, A, K refitted per source with the aggregate exponents)

# %%
source_path = folder / "source_gain.csv"
(pd.read_csv(source_path) if source_path.exists() else pd.DataFrame()).head(24)

# %% [markdown]
# ## Per-length gains, ablations, mechanistic tables (where the folder has them)

# %%
if (folder / "length_ratio.csv").exists():
    print(pd.read_csv(folder / "length_ratio.csv").to_string(index=False))
if (folder / "ablation.csv").exists():
    ablation = pd.read_csv(folder / "ablation.csv")
    figure, axes = plt.subplots(1, 4, figsize=(12, 3), sharey=True)
    for ax, (sweep, group) in zip(axes, ablation.groupby("paper_sweep", sort=True)):
        ax.plot(group["paper_point"], group["delta"], "o-", label="micro")
        ax.plot(group["paper_point"], group["paper_delta"], "s--", label="paper")
        ax.axhline(0.0, color="k", lw=0.8); ax.set_title(sweep, fontsize=9)
    axes[0].set_ylabel("loss - reference (nats)"); axes[0].legend(fontsize=7)
    figure.tight_layout(); plt.show()
mechanistic = folder / "mechanistic"
for name in sorted(mechanistic.glob("*.csv")) if mechanistic.exists() else []:
    print(f"\n{name.name}"); print(pd.read_csv(name).head(12).to_string(index=False))
print(json.dumps(json.loads((folder / "pair.json").read_text())))

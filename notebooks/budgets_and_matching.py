# %% [markdown]
# # Budgets and matching explorer
# Per-token training FLOPs, non-embedding parameters and KV cache per token of every run of a suite, the
# matched pairs' ratios (SMELT / Baseline), and the paper's Appendix A numbers next to ours.
# Everything comes from the suite descriptors (`experiments`) and `smelt_jax.design.budget` / `smelt_jax.design.paper`.

# %% parameters
import os

SUITE = os.environ.get("SMELT_DESCRIPTOR_SUITE", "smelt16")  # smelt16, ablations200m, micro, smoke

# %%

import matplotlib.pyplot as plt
import pandas as pd

import experiments
from smelt_jax.design import paper

runs = experiments.load_suite(SUITE)
rows = []
for run in runs:
    info = run.to_dict()
    rows.append({"run_id": run.id, "pair_id": run.pair_id, "arch": run.arch, "scale": run.scale,
                 "sparsity_label": run.sparsity_label, "variant": run.variant,
                 "d_model": run.model.d_model, "n_layers": run.model.n_layers,
                 "executed_layers": run.model.executed_layers, "n_experts": run.model.n_experts,
                 **info["budget"]})
budgets = pd.DataFrame(rows)
budgets[["arch", "scale", "sparsity_label", "variant", "d_model", "n_experts", "train_flops_per_token",
         "params_total", "kv_per_token", "sparsity"]]

# %% [markdown]
# ## Matched pairs: SMELT (or looped) / Baseline on the three budgets

# %%
pairs = []
for pair_id, group in budgets.groupby("pair_id", sort=True):
    reference = group[group["arch"] == "baseline"]
    for _, other in group[group["arch"] != "baseline"].iterrows():
        if reference.empty:
            continue
        base = reference.iloc[0]
        pairs.append({"pair_id": pair_id, "arch": other["arch"], "variant": other["variant"],
                      "flops_ratio": other["train_flops_per_token"] / base["train_flops_per_token"],
                      "params_ratio": other["params_total"] / base["params_total"],
                      "kv_ratio": other["kv_per_token"] / base["kv_per_token"],
                      "sparsity_baseline": base["sparsity"], "sparsity_other": other["sparsity"]})
pairs = pd.DataFrame(pairs)
print(pairs.describe().loc[["mean", "min", "max"]] if not pairs.empty else "no matched pairs in this suite")
pairs

# %% [markdown]
# ## Against the paper (Appendix A; smelt16 only)

# %%
paper_rows = []
for _, row in budgets.iterrows():
    if row["scale"] in paper.SCALES and row["sparsity_label"] in paper.SPARSITY_LABELS and not row["variant"]:
        published = paper.appendix_a(row["scale"], row["sparsity_label"],
                                     "baseline" if row["arch"] == "baseline" else "smelt")
        paper_rows.append({"arch": row["arch"], "scale": row["scale"], "sparsity_label": row["sparsity_label"],
                           "total_B_ours": row["params_total"] / 1e9, "total_B_paper": published["total"],
                           "S_ours_pct": 100 * (row["sparsity"] or 0.0), "S_paper_pct": published["sparsity"]})
comparison = pd.DataFrame(paper_rows)
comparison

# %%
if not pairs.empty:
    figure, axis = plt.subplots(figsize=(6, 3))
    for column in ("flops_ratio", "params_ratio", "kv_ratio"):
        axis.plot(range(len(pairs)), pairs[column], "o", label=column)
    axis.axhline(1.0, color="gray", lw=0.5)
    axis.set_xlabel("pair")
    axis.set_ylabel("ratio to Baseline")
    axis.legend()
    figure.tight_layout()

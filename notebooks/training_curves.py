# %% [markdown]
# # Training curves of a suite
# Reads every run's `metrics.jsonl` under `<runs root>/<suite>/` (the stable phase and each decay branch)
# with `smelt_jax.train.metrics_log.read_metrics` (a torn line is skipped with a warning) and plots loss
# against cumulative training tokens (`tokens`; `step_tokens` is one step's loss-bearing tokens).
# Steps logged twice (a resumed run repeats the steps after its checkpoint) keep their last record;
# evaluation lines (`{"step", "eval": {...}}`) give the validation losses.

# %% parameters
import os

RUNS_DIR = os.environ.get("SMELT_RUNS_DIR", "runs")
SUITE = os.environ.get("SMELT_SUITE", "smoke")

# %%
from pathlib import Path


import matplotlib.pyplot as plt
import pandas as pd

from smelt_jax.run_files.readers import Skipped, load_item
from smelt_jax.run_files.results import read_results
from smelt_jax.train.metrics_log import latest_per_step, read_metrics

suite_dir = Path(RUNS_DIR) / SUITE
train_rows, eval_rows = [], []
for metrics_file in sorted(suite_dir.glob("*/*/metrics.jsonl")):
    run_id, phase = metrics_file.parent.parent.name, metrics_file.parent.name
    records = load_item(metrics_file, read_metrics)  # a bad file is named and skipped; the rest plotted
    if isinstance(records, Skipped):
        print(records.line())
        continue
    for record in records:
        if "eval" in record and isinstance(record["eval"], dict):
            eval_rows.append({"run_id": run_id, "phase": phase, "step": record.get("step"), **record["eval"]})
    for record in latest_per_step(records):
        if "loss" in record:
            train_rows.append({"run_id": run_id, "phase": phase, **record})
curves = pd.DataFrame(train_rows)
evals = pd.DataFrame(eval_rows)
print(f"{suite_dir}: {curves['run_id'].nunique() if not curves.empty else 0} runs, "
      f"{len(curves)} metric lines, {len(evals)} evaluations")

# %%
COMMITTED = Path("fits/micro/results.csv")  # the micro replication's endpoints, committed
if curves.empty and COMMITTED.exists():
    print(f"no metrics under {suite_dir} (train a run, or point SMELT_RUNS_DIR / SMELT_SUITE elsewhere); "
          f"showing the committed endpoints of {COMMITTED}: validation loss at each decay horizon")
    endpoints = pd.read_csv(COMMITTED)
    figure, axes = plt.subplots(1, 4, figsize=(13, 3.2), sharey=True)
    for axis, (scale, group) in zip(axes, endpoints.groupby("scale", sort=False)):
        for (label, arch), run in group.groupby(["sparsity_label", "arch"]):
            axis.plot(run["tokens"], run["val_loss"], "o-" if arch == "smelt" else "s--", ms=3, lw=1,
                      label=f"{arch} {label}")
        axis.set_title(f"micro {scale}", fontsize=9); axis.set_xscale("log"); axis.set_xlabel("tokens")
    axes[0].set_ylabel("validation loss"); axes[0].legend(fontsize=5)
    figure.tight_layout()
elif curves.empty:
    print("no metrics yet: train a run (smelt train RUN_ID) or point SMELT_RUNS_DIR / SMELT_SUITE elsewhere")
else:
    figure, axis = plt.subplots(figsize=(7, 4))
    for (run_id, phase), group in curves.groupby(["run_id", "phase"], sort=True):
        axis.plot(group["tokens"], group["loss"], label=f"{run_id.split('-')[-2]} {phase}", lw=1)
    axis.set_xlabel("tokens")
    axis.set_ylabel("training loss")
    axis.set_xscale("log")
    axis.legend(fontsize=6)
    figure.tight_layout()

# %%
if not curves.empty:
    last = curves.sort_values("step").groupby(["run_id", "phase"]).tail(1)
    columns = [c for c in ("run_id", "phase", "step", "tokens", "loss", "ce", "mfu", "tokens_per_s")
               if c in last]
    print(last[columns].to_string(index=False))

# %% [markdown]
# ## Endpoints (the suite's results table)

# %%
results = read_results(suite_dir)
results if not results.empty else print("no endpoints yet")

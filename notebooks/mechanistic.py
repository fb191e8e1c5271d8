# %% [markdown]
# # Mechanistic analyses (docs/paper.md §9)
# The tables `smelt analyze RUN_ID --out DIR` writes (one CSV each): routing overlap against k²/n,
# residual-write ratios and cosines, attention-stage cosines, attended-token overlap, sink mass, Gu et
# al.'s sink rate and the Dyck head (default: the committed micro replication's largest SMELT model).
# Without an analysis folder, the same library functions run on a small
# randomly initialised looped model and random tokens, to show the tables' shapes (numbers meaningless).

# %% parameters
import os

# output of `smelt analyze`; default: the micro replication's largest SMELT model (docs/results-micro.md)
ANALYSIS_DIR = os.environ.get("SMELT_ANALYSIS_DIR", "fits/micro/mechanistic/smelt")

# %%
from pathlib import Path


import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from smelt_jax.analysis import attention, mechanistic

if ANALYSIS_DIR and Path(ANALYSIS_DIR).is_dir():
    tables = {path.stem: pd.read_csv(path) for path in sorted(Path(ANALYSIS_DIR).glob("*.csv"))}
    print(f"{ANALYSIS_DIR}: {sorted(tables)}")
else:
    from flax import nnx

    from smelt_jax.analysis.run_analysis import capture_rows
    from smelt_jax.design.config import ModelConfig
    from smelt_jax.model import Decoder

    cfg = ModelConfig(vocab=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=8,
                      top_k=2, expert_ffn=32, loop_start=1, loop_length=1, loop_repeats=2, seq_len=64)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 256, (4, 64)).astype(np.int32)
    captures = capture_rows(model, tokens, np.ones_like(tokens),
                            np.broadcast_to(np.arange(64, dtype=np.int32), tokens.shape), batch_size=4)
    probs = {key: {"attn_probs": value["attn_probs"]} for key, value in captures.items()}
    tables = {
        "routing_overlap": mechanistic.routing_overlap(captures, cfg.n_experts),
        "residual_write_ratios": mechanistic.residual_write_ratios(captures),
        "residual_write_cosine_summary": mechanistic.summarize_pairs(mechanistic.residual_write_cosines(captures)),
        "attention_stage_cosines": mechanistic.attention_stage_cosines(captures),
        "attended_token_overlap_summary": mechanistic.summarize_pairs(
            attention.attended_token_overlap(probs), "mean_overlap"),
        "attention_sink_mass": attention.attention_sink_mass(probs, np.ones_like(tokens)),
        "gu_sink_rate": attention.gu_sink_rate(probs),
    }
    print("demo: random model, random tokens")

# %% [markdown]
# ## Routing overlap (paper: ≈ 8 at S = 0, 2–3 at S ≈ 97% against 8²/504 = 0.13)

# %%
tables.get("routing_overlap")

# %% [markdown]
# ## Residual writes (paper: ratios 1.2–3.5×; same-layer cosine 0.56 vs 0.16 unrelated)

# %%
print(tables.get("residual_write_ratios"))
tables.get("residual_write_cosine_summary")

# %% [markdown]
# ## Attention-stage cosines (paper: norm 0.84–0.93, Q/K 0.89–0.93, V 0.65–0.74, PV 0.56–0.69, out 0.49–0.64)

# %%
stages = tables.get("attention_stage_cosines")
if stages is not None and not stages.empty:
    order = list(mechanistic.ATTENTION_STAGES)
    summary = stages.groupby("stage")["mean_cosine"].agg(["mean", "min", "max"]).reindex(order)
    figure, axis = plt.subplots(figsize=(5, 3))
    axis.bar(range(len(order)), summary["mean"])
    axis.set_xticks(range(len(order)), order, rotation=30)
    axis.set_ylabel("cosine, visit 1 vs 2")
    figure.tight_layout()
    print(summary)

# %% [markdown]
# ## Attended-token overlap, sinks, the Dyck head

# %%
for name in ("attended_token_overlap_summary", "gu_sink_rate", "dyck_head_ablation", "dyck_head_attention"):
    if name in tables:
        print(f"--- {name}")
        print(tables[name].head(8).to_string(index=False))
sinks = tables.get("attention_sink_mass")
if sinks is not None and not sinks.empty:
    print(sinks.groupby(["layer", "visit"])["sink_mass"].mean().unstack())

"""Numbers published in the SMELT paper (arXiv 2609.01343), for comparison only: the one module that
types them in.

Nothing here configures a run or computes anything: descriptors compute their budgets and
`smelt_jax.scaling` fits laws; these are what the paper reports, so tests, `smelt match` and the
`fits/paper` tables can compare against them.

- Appendix A (the grid of models): `APPENDIX_A_BASELINE`, `APPENDIX_A_SMELT`, `appendix_a(...)`;
  the worked example `WORKED_EXAMPLE_FLOPS`; the ablations `ABLATION_LOSS`; the §9 ranges `MECHANISTIC`.
- The fitted scaling laws (docs/paper.md §7): `BASELINE_LAW`, `SMELT_LAW` (`SmeltLaw` coefficients), `RMSE`,
  `N_POINTS`, and the CE-gain / tokens-per-parameter tables they are compared against (`CE_GAIN` over
  `COMPUTES` x `SPARSITIES`, `TPP_1E21`, `GAMMA`, `COMPUTE_RANGE`).
"""

from __future__ import annotations

from smelt_jax.scaling.laws import SmeltLaw

SCALES = ("100m", "200m", "600m", "1.6b")
SPARSITY_LABELS = ("s0", "s85", "s95", "s97")

# ---------------------------------------------------------------------------------------- Appendix A

# Appendix A, per (scale, sparsity label): billions of non-embedding parameters, S in %.
APPENDIX_A_BASELINE = {
    "100m": {"d_model": 672, "n_layers": 10, "experts": (8, 64, 192, 336),
             "active": (.100, .100, .101, .102), "sparsity": (0, 86.0, 95.2, 97.2),
             "total": (.10, .71, 2.12, 3.70)},
    "200m": {"d_model": 1280, "n_layers": 12, "experts": (8, 64, 192, 336),
             "active": (.207, .207, .209, .212), "sparsity": (0, 84.3, 94.6, 96.9),
             "total": (.21, 1.32, 3.87, 6.74)},
    "600m": {"d_model": 1792, "n_layers": 20, "experts": (8, 64, 192, 336),
             "active": (.663, .665, .670, .675), "sparsity": (0, 84.5, 94.7, 96.9),
             "total": (.66, 4.28, 12.54, 21.83)},
    "1.6b": {"d_model": 2304, "n_layers": 30, "experts": (8, 64, 192, 336),
             "active": (1.629, 1.632, 1.641, 1.651), "sparsity": (0, 84.5, 94.7, 96.9),
             "total": (1.63, 10.55, 30.94, 53.89)},
}

APPENDIX_A_SMELT = {
    "100m": {"d_model": (576, 576, 576, 576), "experts": (16, 96, 288, 504),
             "active": (.071, .067, .069, .070), "sparsity": (0, 86.8, 95.5, 97.4),
             "total": (.10, .71, 2.12, 3.70), "flops_ratio": (1.081, 1.024, 1.031, 1.039),
             "kv_ratio": (1.018, .964, .964, .964)},
    "200m": {"d_model": (1056, 1056, 1056, 1056), "experts": (16, 96, 288, 504),
             "active": (.142, .140, .142, .145), "sparsity": (0, 84.6, 94.7, 96.9),
             "total": (.21, 1.32, 3.89, 6.78), "flops_ratio": (1.039, 1.021, 1.029, 1.037),
             "kv_ratio": (1.031, 1.031, 1.031, 1.031)},
    "600m": {"d_model": (1408, 1408, 1512, 1512), "experts": (16, 96, 288, 504),
             "active": (.458, .443, .453, .459), "sparsity": (0, 85.1, 94.7, 96.9),
             "total": (.67, 4.31, 12.44, 21.70), "flops_ratio": (1.046, 1.007, 1.024, 1.031),
             "kv_ratio": (1.031, 1.031, .984, .984)},
    "1.6b": {"d_model": (1848, 1848, 1848, 1848), "experts": (16, 96, 288, 504),
             "active": (1.101, 1.081, 1.091, 1.103), "sparsity": (0, 84.6, 94.8, 97.0),
             "total": (1.64, 10.45, 30.90, 53.90), "flops_ratio": (1.022, 1.000, 1.004, 1.008),
             "kv_ratio": (.984, .984, .984, .984)},
}

# The worked example of docs/paper.md §3: 200M, S~95%, training FLOPs per token.
WORKED_EXAMPLE_FLOPS = {"baseline": 1.33e9, "smelt": 1.37e9}

# §6 ablations at 200M, S~85% (validation loss, single runs).
ABLATION_LOSS = {
    "span": {0: 1.9445, 2: 1.9384, 4: 1.9275, 6: 1.9257, 8: 1.9374, 10: 1.9413, 12: 1.9322},
    "depth_baseline": {9: 1.9638, 12: 1.9445, 15: 1.9457, 18: 1.9542},
    "depth_looped": {8: 1.9591, 10: 1.9389, 12: 1.9257, 14: 1.9433},
    "loops": {1: 1.9445, 2: 1.9257, 3: 1.9385, 4: 1.9360},
}


# §9 mechanistic analyses (visit 1 vs visit 2 of a repeated layer), as (low, high) ranges over layers or
# heads. Routing overlap is |top-8(v1) & top-8(v2)| / 8 at S~97% (2-3 of 8; ~8 of 8 at S~0 with 16 experts).
MECHANISTIC = {
    "routing_overlap_fraction": (2 / 8, 3 / 8),
    "write_norm_ratio": (1.2, 3.5),  # ||dx(2)|| / ||dx(1)|| for dx, dx_attn, dx_moe: all > 1
    "write_cosine_same_layer": (0.42, 0.65),  # mean 0.56
    "write_cosine_unrelated": (0.16, 0.16),
    "stage_cosine_normed_input": (0.84, 0.93), "stage_cosine_q": (0.89, 0.93), "stage_cosine_k": (0.89, 0.93),
    "stage_cosine_v": (0.65, 0.74), "stage_cosine_pv": (0.56, 0.69), "stage_cosine_attn_out": (0.49, 0.64),
    "attended_overlap_same_head": (0.56, 0.66), "attended_overlap_control": (0.28, 0.34),
}


def appendix_a(scale: str, sparsity_label: str, arch: str) -> dict[str, float]:
    """The paper's row for one model: active and total params (B), S (%), and ratios for SMELT."""
    i = SPARSITY_LABELS.index(sparsity_label)
    table = APPENDIX_A_BASELINE if arch == "baseline" else APPENDIX_A_SMELT
    row = table[scale]
    out = {key: row[key][i] for key in ("active", "total", "sparsity")}
    out["n_experts"] = row["experts"][i]
    if arch != "baseline":
        out["flops_ratio"] = row["flops_ratio"][i]
        out["kv_ratio"] = row["kv_ratio"][i]
        out["d_model"] = row["d_model"][i]
    else:
        out["d_model"] = row["d_model"]
    return out


# ------------------------------------------------------------------------------- fitted scaling laws

BASELINE_LAW = SmeltLaw(E=1.4439, A=1.366e3, K=1.975e6, a=0.3703, b=0.1530, c=0.6594)
SMELT_LAW = SmeltLaw(E=1.4493, A=1.963e3, K=5.264e6, a=0.3892, b=0.1460, c=0.7011)
RMSE = {"baseline": 0.00554, "smelt": 0.00952}
N_POINTS = 72

COMPUTES = (1e20, 1e21, 1e22)
SPARSITIES = (0.85, 0.95, 0.97)
# CE gain in percent, [low, high] of the 95% cell-bootstrap interval, per (C, S)
CE_GAIN = {
    (1e20, 0.85): (10.0, 1, 22), (1e20, 0.95): (7.8, 3, 15), (1e20, 0.97): (6.8, 4, 14),
    (1e21, 0.85): (18.0, 8, 28), (1e21, 0.95): (15.8, 10, 25), (1e21, 0.97): (14.7, 8, 25),
    (1e22, 0.85): (23.5, 8, 42), (1e22, 0.95): (20.9, 0, 48), (1e22, 0.97): (19.6, 0, 51),
}
# tokens per parameter at 1e21: (Baseline, SMELT)
TPP_1E21 = {0.85: (56, 56), 0.95: (78, 75), 0.97: (91, 86)}
GAMMA = {"baseline": 0.237, "smelt": 0.250}

# Approximate fitted compute range C = F D of the 72 sparse endpoints: F ~ 6 x active parameters
# (docs/paper.md §4: 0.100e9 at 100M S~85%, 1.651e9 at 1.6B S~97%; attention FLOPs ignored), D = 20.5e9 .. 215.6e9
# (docs/paper.md §5). Used only to flag extrapolation (the paper marks 1e22 as extrapolated).
COMPUTE_RANGE = (6 * 0.100e9 * 20.5e9, 6 * 1.651e9 * 215.6e9)

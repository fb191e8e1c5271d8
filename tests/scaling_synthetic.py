"""Synthetic run tables drawn from known laws (shared by the scaling tests and the benchmark)."""

import numpy as np
import pandas as pd

from smelt_jax.design import paper

# per-token FLOPs of the four scales and the six horizons (tokens) of docs/paper.md §4-§5
FLOPS = (6.0e8, 1.24e9, 4.0e9, 9.8e9)
SPARSITY = (0.85, 0.95, 0.97)
HORIZONS = (20.5e9, 31.0e9, 62.4e9, 114.9e9, 167.3e9, 215.6e9)


def smelt_table(law, arch: str, noise: float, seed: int) -> pd.DataFrame:
    """72 rows (4 scales x 3 sparsities x 6 horizons); multiplicative log-normal noise of size `noise`."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, f in enumerate(FLOPS):
        for s in SPARSITY:
            for d in HORIZONS:
                loss = law.predict(f, s, d) * np.exp(noise * rng.standard_normal())
                rows.append({"arch": arch, "F": f, "S": s, "D": d, "loss": float(loss), "cell": f"{i}-{s}"})
    return pd.DataFrame(rows)


def paper_pair_table(noise: float = 0.003, seed: int = 0) -> pd.DataFrame:
    return pd.concat([smelt_table(paper.BASELINE_LAW, "baseline", noise, seed),
                      smelt_table(paper.SMELT_LAW, "smelt", noise, seed + 1)], ignore_index=True)

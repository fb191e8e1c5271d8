"""A suite's endpoint table (the results store's rows: one per run and decay branch) turned into what the
paper reports besides the law itself: the law's input points, the matched-pair wins, an empirical
compute-equivalent gain per pair that needs no law, and per-source gains from a refit of E, A, K with the
aggregate exponents held fixed (paper §8).

Every function is a pure function of the table (and of fitted laws where named), so `make fits`
regenerates the same numbers from the committed `fits/<suite>/results.csv`.

Columns read: run_id, branch, pair_id, arch, scale, sparsity_label, sparsity, flops_per_token, tokens,
val_loss, and `loss_<source>` per corpus source.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from smelt_jax.platform.errors import UsageError
from smelt_jax.scaling import fit, gains
from smelt_jax.scaling.laws import SmeltLaw, SmeltLawFixedExponents

FIT_COLUMNS = ("arch", "scale", "sparsity_label", "branch", "F", "S", "D", "loss", "cell")
STORE_COLUMNS = ("run_id", "branch", "pair_id", "arch", "scale", "sparsity_label", "sparsity",
                 "flops_per_token", "tokens", "val_loss")
DENSE_LABEL = "s0"  # the S~0 controls: they anchor S and stay out of the fits (paper §7)


def check_table(results: pd.DataFrame, where: str = "results table") -> pd.DataFrame:
    missing = [c for c in STORE_COLUMNS if c not in results.columns]
    if missing:
        raise UsageError(f"{where}: missing column(s) {', '.join(missing)} (expected the results store's "
                         "rows: `smelt results export --suite SUITE`)")
    return results


def export_table(results: pd.DataFrame) -> pd.DataFrame:
    """The results store's rows as a suite folder keeps them (`fits/<suite>/results.csv`): every endpoint,
    the store's columns and per-source losses, sorted by run and branch; the provenance columns
    (git_commit, time) are left out so a retrained suite that reproduces its numbers writes the same file."""
    check_table(results)
    columns = [*STORE_COLUMNS, *[c for c in ("params",) if c in results.columns],
               *[f"loss_{s}" for s in source_names(results)]]
    return results[columns].sort_values(["run_id", "branch"], kind="stable").reset_index(drop=True)


def source_names(results: pd.DataFrame) -> list[str]:
    """Corpus sources with a per-source loss column (`loss_<source>`), sorted."""
    return sorted(c[len("loss_"):] for c in results.columns if c.startswith("loss_"))


def fit_points(results: pd.DataFrame, loss_column: str = "val_loss") -> pd.DataFrame:
    """Results-store rows -> the smelt law's input table: sparse endpoints only (the paper excludes
    S~0), one row per endpoint, `cell` = the run (its horizons are resampled together)."""
    check_table(results)
    sparse = results[results["sparsity_label"].astype(str) != DENSE_LABEL]
    table = pd.DataFrame({
        "arch": sparse["arch"].astype(str), "scale": sparse["scale"].astype(str),
        "sparsity_label": sparse["sparsity_label"].astype(str), "branch": sparse["branch"].astype(int),
        "F": sparse["flops_per_token"].astype(float), "S": sparse["sparsity"].astype(float),
        "D": sparse["tokens"].astype(float), "loss": sparse[loss_column].astype(float),
        "cell": sparse["run_id"].astype(str)})
    return table.sort_values(["arch", "scale", "sparsity_label", "branch"], kind="stable") \
        .reset_index(drop=True)[list(FIT_COLUMNS)]


def _side_by_side(table: pd.DataFrame, keys: list[str], values: list[str]) -> pd.DataFrame:
    """The Baseline's and SMELT's rows of `table` joined on `keys`: each value as `<value>_baseline` and
    `<value>_smelt`, sorted by the keys."""
    base = table[table["arch"] == "baseline"][keys + values]
    smelt = table[table["arch"] == "smelt"][keys + values]
    both = base.merge(smelt, on=keys, suffixes=("_baseline", "_smelt"))
    return both.sort_values(keys, kind="stable").reset_index(drop=True)


def _pairs(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (pair, branch) with both architectures: their F, D and validation loss side by side."""
    check_table(results)
    return _side_by_side(results, ["pair_id", "scale", "sparsity_label", "branch"],
                         ["flops_per_token", "tokens", "val_loss"])


def pair_wins(results: pd.DataFrame) -> pd.DataFrame:
    """Matched-pair endpoints: SMELT's validation loss against its Baseline's at the same branch (same
    tokens, FLOPs matched within 4%), as the paper counts wins. delta = SMELT - Baseline (< 0: a win)."""
    both = _pairs(results)
    out = pd.DataFrame({
        "pair_id": both["pair_id"], "scale": both["scale"], "sparsity_label": both["sparsity_label"],
        "branch": both["branch"].astype(int), "tokens": both["tokens_baseline"].astype(int),
        "loss_baseline": both["val_loss_baseline"], "loss_smelt": both["val_loss_smelt"]})
    out["delta"] = out["loss_smelt"] - out["loss_baseline"]
    out["win"] = out["delta"] < 0
    return out


def sign_test_p(wins: int, n: int) -> float:
    """Two-sided exact sign test: the probability, under "each architecture wins a pair with chance 1/2",
    of a split at least as uneven as `wins` of `n` (ties are not counted in `n`); 1.0 for n = 0."""
    if n == 0:
        return 1.0
    extreme = min(wins, n - wins)
    tail = sum(math.comb(n, k) for k in range(extreme + 1)) / 2.0 ** n
    return float(min(1.0, 2.0 * tail))


def _win_summary(wins: pd.DataFrame) -> dict:
    """Wins, endpoints, mean and median delta (nats) of some `pair_wins` rows, and the sign test's p over
    the pairs that are not tied."""
    decided = int((wins["delta"] != 0).sum())
    return {"wins": int(wins["win"].sum()), "endpoints": len(wins), "mean_delta": float(wins["delta"].mean()),
            "median_delta": float(wins["delta"].median()), "sign_p": sign_test_p(int(wins["win"].sum()), decided)}


def win_counts(wins: pd.DataFrame) -> pd.DataFrame:
    """Wins per sparsity level and overall: wins, endpoints, mean and median delta (nats)."""
    return pd.DataFrame([{"sparsity_label": label, **_win_summary(group)}
                         for label, group in [*wins.groupby("sparsity_label", sort=True), ("all", wins)]])


def empirical_gains(results: pd.DataFrame) -> pd.DataFrame:
    """A compute-equivalent gain per matched endpoint that needs no fitted law.

    For SMELT's endpoint at branch k (compute C = F_smelt x D_k), the Baseline compute C_ref reaching the
    same loss is read off the Baseline's own horizons (its endpoints at every branch: loss against
    log compute, linearly interpolated); CE = 1 - C / C_ref. Outside the Baseline's measured losses the
    gain is not interpolated: `bound` says whether SMELT's loss is below the Baseline's lowest ('>': CE
    is at least the value at the Baseline's last horizon) or above its highest ('<').
    """
    both = _pairs(results)
    rows = []
    for pair_id, group in both.groupby("pair_id", sort=True):
        group = group.sort_values("branch")
        base_c = np.log(group["flops_per_token_baseline"].to_numpy(float) * group["tokens_baseline"].to_numpy(float))
        base_loss = group["val_loss_baseline"].to_numpy(float)
        order = np.argsort(base_loss)  # interpolate log C as a function of loss
        loss_sorted, c_sorted = base_loss[order], base_c[order]
        for _, row in group.iterrows():
            c = float(row["flops_per_token_smelt"]) * float(row["tokens_smelt"])
            loss = float(row["val_loss_smelt"])
            bound = ">" if loss < loss_sorted[0] else "<" if loss > loss_sorted[-1] else ""
            c_ref = float(np.exp(np.interp(loss, loss_sorted, c_sorted)))
            rows.append({"pair_id": pair_id, "scale": row["scale"], "sparsity_label": row["sparsity_label"],
                         "branch": int(row["branch"]), "C": c, "loss_smelt": loss, "C_ref": c_ref,
                         "ce_gain": 1.0 - c / c_ref, "bound": bound})
    return pd.DataFrame(rows)


def source_wins(results: pd.DataFrame) -> pd.DataFrame:
    """Per corpus source and branch, over the sparse matched pairs: SMELT's wins and the mean and median
    delta (SMELT - Baseline, nats) of that source's validation loss; the law-free per-source reading."""
    rows = []
    sparse = results[results["sparsity_label"].astype(str) != DENSE_LABEL]
    for source in source_names(results):
        column = f"loss_{source}"
        table = sparse.drop(columns=["val_loss"]).rename(columns={column: "val_loss"})
        wins = pair_wins(table)
        for branch, group in wins.groupby("branch", sort=True):
            rows.append({"source": source, "branch": int(branch), "tokens": int(group["tokens"].iloc[0]),
                         **_win_summary(group)})
    return pd.DataFrame(rows)


def source_laws(results: pd.DataFrame, aggregate: dict[str, SmeltLaw]) -> dict[str, dict[str, SmeltLaw]]:
    """{source: {arch: law}}: each architecture's law refitted to one source's validation loss with E, A, K
    free and a, b, c held at the aggregate fit's values (the paper's per-domain recipe, §8)."""
    out = {}
    for source in source_names(results):
        points = fit_points(results, f"loss_{source}")
        laws = {}
        for arch, law in aggregate.items():
            table = points[points["arch"] == arch]
            fixed = SmeltLawFixedExponents.of(law)
            laws[arch] = fit.fit_law(fixed, fixed.features(table), table["loss"].to_numpy(float)).law
        out[source] = laws
    return out


def source_gains(laws: dict[str, dict[str, SmeltLaw]], computes, sparsities, *,
                 compute_range=None) -> pd.DataFrame:
    """CE gain of SMELT over the Baseline per source at each (C, S), from `source_laws`."""
    rows = []
    for source, by_arch in sorted(laws.items()):
        for row in gains.gain_rows(by_arch["baseline"], by_arch["smelt"], computes, sparsities,
                                   compute_range=compute_range):
            rows.append({"source": source, "C": row["C"], "S": row["S"], "ce_gain": row["ce_gain"],
                         "E_baseline": by_arch["baseline"].E, "E_smelt": by_arch["smelt"].E,
                         "extrapolated": row.get("extrapolated")})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------
# Per-length gains (paper §8) from `lengths.csv`: one row per (run, branch, length bucket) of the
# validation loss by document length (`smelt eval --json`: validation.by_length).

# The paper compares documents of 512-4096 tokens with documents of 32-256. The embedded corpus (byte-level
# source files and prose) has almost no documents under 256 bytes (0.2% of the micro evaluation's tokens), so the
# micro ratio compares documents of at most 1024 tokens with documents longer than 4096 (docs/results-micro.md).
SHORT_BUCKETS = (32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
LONG_BUCKETS = (float("inf"),)


LENGTH_COLUMNS = ("run_id", "branch", "pair_id", "arch", "scale", "sparsity_label", "bucket", "n_tokens",
                  "n_documents", "loss")


def length_rows(payload: dict, results: pd.DataFrame) -> list[dict]:
    """Rows of `lengths.csv` from one `smelt eval --json` payload (validation.by_length; the overflow
    bucket, JSON null, becomes inf), labelled from the suite's results table by run id."""
    check_table(results)
    match = results[results["run_id"] == payload["run_id"]]
    if match.empty:
        raise UsageError(f"{payload['run_id']}: not in the results table")
    labels = match.iloc[0]
    return [{"run_id": payload["run_id"], "branch": int(payload["branch"]), "pair_id": labels["pair_id"],
             "arch": labels["arch"], "scale": labels["scale"], "sparsity_label": labels["sparsity_label"],
             "bucket": float("inf") if row["bucket"] is None else float(row["bucket"]),
             "n_tokens": int(row["n_tokens"]), "n_documents": int(row["n_documents"]),
             "loss": float("nan") if row["loss"] is None else float(row["loss"])}
            for row in payload["validation"]["by_length"]]


def length_gains(lengths: pd.DataFrame) -> pd.DataFrame:
    """Per pair, branch and bucket: the Baseline's and SMELT's loss and the gain (Baseline - SMELT, nats;
    > 0: SMELT is better on documents of that length)."""
    both = _side_by_side(lengths, ["pair_id", "scale", "sparsity_label", "branch", "bucket"], ["n_tokens", "loss"])
    both["gain"] = both["loss_baseline"] - both["loss_smelt"]
    return both


def _mean_gain(rows: pd.DataFrame, buckets) -> float:
    """Token-weighted mean gain over the rows in `buckets` (NaN when they hold no tokens)."""
    part = rows[rows["bucket"].isin(buckets)]
    weight = part["n_tokens_baseline"].to_numpy(float)
    return float(np.average(part["gain"], weights=weight)) if weight.sum() else float("nan")


def length_ratios(gains_by_bucket: pd.DataFrame) -> pd.DataFrame:
    """Per pair and branch: the token-weighted mean gain over long documents, over short ones
    (`LONG_BUCKETS`, `SHORT_BUCKETS`), and their ratio (the paper's 1.52 at its scale: gains grow with
    document length)."""
    rows = []
    for (pair_id, branch), group in gains_by_bucket.groupby(["pair_id", "branch"], sort=True):
        usable = group[(group["n_tokens_baseline"] > 0) & np.isfinite(group["gain"])]
        short, long = _mean_gain(usable, SHORT_BUCKETS), _mean_gain(usable, LONG_BUCKETS)
        rows.append({"pair_id": pair_id, "branch": int(branch), "sparsity_label": group["sparsity_label"].iloc[0],
                     "gain_short": short, "gain_long": long,
                     "ratio": long / short if np.isfinite(short) and short else float("nan")})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------
# Ablations (paper §6) from `ablations.csv`: one row per ablation point with its validation loss and
# the point of the paper's grid it corresponds to (paper_sweep, paper_point: keys of paper.ABLATION_LOSS).

ABLATION_COLUMNS = ("sweep", "variant", "arch", "paper_sweep", "paper_point", "run_id", "branch", "val_loss")


def ablation_table(ablations: pd.DataFrame, paper_losses: dict[str, dict[int, float]]) -> pd.DataFrame:
    """Each point beside the paper's: losses and differences from each side's reference point (the
    unlooped Baseline at the reference depth: span 0 = its depth = r 1), so the shapes compare across
    scales. delta < 0: better than the reference."""
    missing = [c for c in ABLATION_COLUMNS if c not in ablations.columns]
    if missing:
        raise UsageError(f"ablations table: missing column(s) {', '.join(missing)}")
    ours_ref = float(ablations[(ablations["sweep"] == "span") & (ablations["paper_point"] == 0)]["val_loss"].iloc[0])
    paper_ref = paper_losses["span"][0]
    out = ablations[list(ABLATION_COLUMNS)].copy()
    out["delta"] = out["val_loss"] - ours_ref
    out["paper_loss"] = [paper_losses[s][int(p)] for s, p in zip(out["paper_sweep"], out["paper_point"])]
    out["paper_delta"] = out["paper_loss"] - paper_ref
    best = out.groupby("paper_sweep")["val_loss"].transform("min") == out["val_loss"]
    paper_best = out.groupby("paper_sweep")["paper_loss"].transform("min") == out["paper_loss"]
    out["best"], out["paper_best"] = best, paper_best
    return out.reset_index(drop=True)

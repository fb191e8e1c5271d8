"""A suite's endpoint table read beside the laws (smelt_jax.scaling.endpoints) and the suite folder that
`smelt fit-suite` writes from it: each number checked against a hand-made case."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from smelt_jax.design import paper
from smelt_jax.platform.errors import UsageError
from smelt_jax.scaling import endpoints, fit
from smelt_jax.scaling.laws import SmeltLaw, SmeltLawFixedExponents
from smelt_jax.scaling.suite_fits import fit_suite_table

TOKENS = (20e9, 40e9, 80e9, 160e9)


def _store(loss_of, scales=(("a", 6e8), ("b", 1.2e9)), labels=(("s0", 0.0), ("s85", 0.85), ("s95", 0.95)),
           sources=()):
    """Results-store rows: every (scale, label, arch) a run with one endpoint per horizon."""
    rows = []
    for scale, flops in scales:
        for label, sparsity in labels:
            for arch in ("baseline", "smelt"):
                for branch, tokens in enumerate(TOKENS):
                    loss = loss_of(arch, flops, sparsity, tokens)
                    row = {"run_id": f"t-{scale}-{label}-{arch}-0000", "branch": branch, "pair_id": f"t-{scale}-{label}",
                           "arch": arch, "scale": scale, "sparsity_label": label, "sparsity": sparsity,
                           "flops_per_token": flops, "tokens": tokens, "val_loss": loss, "params": 1,
                           "git_commit": "abc", "time": "now"}
                    for k, source in enumerate(sources):
                        row[f"loss_{source}"] = loss + 0.1 * k
                    rows.append(row)
    return pd.DataFrame(rows)


def _paper_loss(arch, flops, sparsity, tokens):
    law = paper.BASELINE_LAW if arch == "baseline" else paper.SMELT_LAW
    return float(law.predict(flops, sparsity, tokens))


def test_fit_points_drop_the_dense_controls_and_keep_one_cell_per_run():
    points = endpoints.fit_points(_store(_paper_loss))
    assert set(points["sparsity_label"]) == {"s85", "s95"} and len(points) == 2 * 2 * 2 * len(TOKENS)
    assert points.groupby("cell").size().eq(len(TOKENS)).all()
    assert list(points.columns) == list(endpoints.FIT_COLUMNS)


def test_export_leaves_out_provenance_and_sorts():
    table = _store(_paper_loss, sources=("code", "prose")).sample(frac=1.0, random_state=0)
    out = endpoints.export_table(table)
    assert "git_commit" not in out.columns and "time" not in out.columns
    assert {"loss_code", "loss_prose", "params"} <= set(out.columns)
    assert list(zip(out["run_id"], out["branch"])) == sorted(zip(out["run_id"], out["branch"]))


def test_a_table_without_the_store_columns_is_a_user_error():
    with pytest.raises(UsageError, match="missing column"):
        endpoints.fit_points(pd.DataFrame({"F": [1.0], "D": [2.0], "loss": [3.0]}))


def test_wins_count_endpoints_where_smelt_is_lower():
    table = _store(lambda arch, f, s, d: 3.0 - (0.01 if arch == "smelt" and s > 0.9 else -0.02 if arch == "smelt" else 0))
    wins = endpoints.pair_wins(table)
    assert len(wins) == 2 * 3 * len(TOKENS)
    counts = endpoints.win_counts(wins).set_index("sparsity_label")
    assert counts.loc["s95", "wins"] == 2 * len(TOKENS) and counts.loc["s85", "wins"] == 0
    assert counts.loc["all", "endpoints"] == len(wins)
    assert counts.loc["s95", "mean_delta"] == pytest.approx(-0.01)


def test_empirical_gain_reads_the_baselines_own_horizons():
    """Baseline loss linear in log compute; SMELT reaches at each horizon the Baseline's loss at twice its
    compute, so CE = 1 - 1/2 where that lies inside the Baseline's horizons."""
    def loss(arch, flops, sparsity, tokens):
        compute = flops * tokens * (2.0 if arch == "smelt" else 1.0)
        return 10.0 - 0.1 * math.log(compute)
    gains = endpoints.empirical_gains(_store(loss))
    inside = gains[gains["bound"] == ""]
    assert len(inside) > 0 and np.allclose(inside["ce_gain"], 0.5)
    beyond = gains[gains["bound"] == ">"]  # SMELT's last horizon is below every Baseline endpoint
    assert set(beyond["branch"]) == {len(TOKENS) - 1}
    assert (beyond["ce_gain"] < 0.5).all()  # only a lower bound there: the Baseline's last compute


def test_fixed_exponent_refit_recovers_e_a_k():
    truth = SmeltLaw(E=1.7, A=900.0, K=3e5, a=0.35, b=0.15, c=0.6)
    table = endpoints.fit_points(_store(lambda arch, f, s, d: float(truth.predict(f, s, d))))
    law = SmeltLawFixedExponents.of(truth)
    result = fit.fit_law(law, law.features(table), table["loss"].to_numpy(float))
    got = result.law
    assert (got.a, got.b, got.c) == (truth.a, truth.b, truth.c)
    assert got.E == pytest.approx(truth.E, rel=1e-4) and got.K == pytest.approx(truth.K, rel=1e-3)
    assert got.A == pytest.approx(truth.A, rel=1e-3)


def test_length_ratio_compares_long_with_short_documents():
    rows = []
    for arch, gain in (("baseline", 0.0), ("smelt", 1.0)):
        for bucket, n, extra in ((64.0, 10, 0.1), (1024.0, 30, 0.1), (2048.0, 50, 0.0), (float("inf"), 100, 0.3)):
            rows.append({"run_id": arch, "branch": 5, "pair_id": "p", "arch": arch, "scale": "xs",
                         "sparsity_label": "s95", "bucket": bucket, "n_tokens": n, "n_documents": 1,
                         "loss": 3.0 - gain * extra})
    by_bucket = endpoints.length_gains(pd.DataFrame(rows))
    assert dict(zip(by_bucket["bucket"], by_bucket["gain"].round(6))) == {64.0: 0.1, 1024.0: 0.1, 2048.0: 0.0,
                                                                          float("inf"): 0.3}
    ratio = endpoints.length_ratios(by_bucket).iloc[0]
    assert ratio["gain_short"] == pytest.approx(0.1) and ratio["gain_long"] == pytest.approx(0.3)
    assert ratio["ratio"] == pytest.approx(3.0)


def test_length_rows_label_an_eval_payload():
    table = _store(_paper_loss)
    payload = {"run_id": "t-a-s85-smelt-0000", "branch": 3, "validation": {"by_length": [
        {"bucket": 128.0, "n_tokens": 5, "n_documents": 1, "loss": 2.5},
        {"bucket": None, "n_tokens": 9, "n_documents": 2, "loss": None}]}}
    rows = endpoints.length_rows(payload, table)
    assert rows[0]["arch"] == "smelt" and rows[0]["pair_id"] == "t-a-s85" and rows[1]["bucket"] == float("inf")
    assert math.isnan(rows[1]["loss"]) and list(rows[0]) == list(endpoints.LENGTH_COLUMNS)


def test_ablation_table_sets_each_point_against_its_reference():
    rows = [{"sweep": "span", "variant": "span0", "arch": "baseline", "paper_sweep": "span", "paper_point": 0,
             "run_id": "r0", "branch": 5, "val_loss": 3.0},
            {"sweep": "span", "variant": "span3", "arch": "looped", "paper_sweep": "span", "paper_point": 6,
             "run_id": "r1", "branch": 0, "val_loss": 2.9},
            {"sweep": "loops", "variant": "r4", "arch": "looped", "paper_sweep": "loops", "paper_point": 4,
             "run_id": "r2", "branch": 0, "val_loss": 3.05}]
    table = endpoints.ablation_table(pd.DataFrame(rows), paper.ABLATION_LOSS).set_index("variant")
    assert table.loc["span3", "delta"] == pytest.approx(-0.1) and table.loc["r4", "delta"] == pytest.approx(0.05)
    assert table.loc["span3", "paper_loss"] == 1.9257
    assert table.loc["span3", "paper_delta"] == pytest.approx(1.9257 - 1.9445)
    assert bool(table.loc["span3", "best"]) and bool(table.loc["span3", "paper_best"])


def test_suite_folder_is_a_deterministic_function_of_results_csv(tmp_path):
    """`smelt fit-suite`: the paper's laws as data -> fits near the truth, every table, and a second run
    writes the same bytes."""
    folder = tmp_path / "suite"
    folder.mkdir()
    endpoints.export_table(_store(_paper_loss, sources=("code", "prose"))).to_csv(
        folder / "results.csv", index=False, float_format="%.8g")
    (folder / "fit.json").write_text('{"bootstrap_draws": 8}')
    paths = fit_suite_table(folder)
    names = {p.relative_to(folder).as_posix() for p in paths} | {"baseline/coefficients.json",
                                                                  "smelt/coefficients.json", "pair.json"}
    for name in ("points.csv", "ce_gain.md", "wins.md", "win_counts.md", "empirical_gain.md",
                 "source_gain.md", "baseline/residuals.md", "loss_vs_compute.png"):
        assert name in names, name
    first = {name: (folder / name).read_bytes() for name in names if not name.endswith((".png", ".pdf"))}
    fit_suite_table(folder)
    assert {name: (folder / name).read_bytes() for name in first} == first
    residuals = pd.read_csv(folder / "smelt" / "residuals.csv")
    assert residuals["residual"].abs().max() < 1e-3  # the data are the law itself


def test_mechanistic_summary_sets_each_measure_beside_the_papers_range():
    from smelt_jax.analysis.mechanistic import summary_beside_paper

    tables = {
        "routing_overlap": pd.DataFrame({"layer": [1, 2], "k": [2, 2], "overlap_fraction": [0.3, 0.5],
                                         "random_reference": [0.1, 0.1]}),
        "residual_write_cosines": pd.DataFrame({"pair": ["same_layer", "unrelated"], "mean_cosine": [0.5, 0.2]}),
        "attention_sink_mass": pd.DataFrame({"layer": [1, 1, 1, 1], "visit": [1, 2, 1, 2], "head": [0, 0, 1, 1],
                                             "sink_mass": [0.4, 0.1, 0.2, 0.3]}),
    }
    summary = summary_beside_paper(tables, paper.MECHANISTIC).set_index("measure")
    assert summary.loc["routing_overlap_fraction", "mean"] == pytest.approx(0.4)
    assert bool(summary.loc["routing_overlap_fraction", "inside"]) is False  # paper: 0.25-0.375
    assert bool(summary.loc["write_cosine_same_layer", "inside"]) is True  # paper: 0.42-0.65
    assert summary.loc["routing_overlap_random", "mean"] == pytest.approx(0.05)
    assert summary.loc["sink_v2_below_v1", "mean"] == pytest.approx(0.5)  # head 0 falls, head 1 rises


def test_source_wins_read_each_sources_loss():
    table = _store(lambda arch, f, s, d: 3.0 - (0.05 if arch == "smelt" else 0.0), sources=("code", "prose"))
    table.loc[table["arch"] == "smelt", "loss_prose"] += 0.2  # SMELT worse on prose only
    wins = endpoints.source_wins(table).set_index(["source", "branch"])
    assert (wins.loc["code", "wins"] == wins.loc["code", "endpoints"]).all()
    assert (wins.loc["prose", "wins"] == 0).all()
    assert wins.loc[("prose", 0), "mean_delta"] == pytest.approx(0.15)
    assert wins.loc[("code", 0), "endpoints"] == 2 * 2  # sparse pairs only: 2 scales x 2 sparse levels

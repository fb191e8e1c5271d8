"""`smelt fit / gain / tables / fits-all` end to end on small inputs, and input validation errors."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scaling_synthetic import paper_pair_table

from smelt_jax.design import paper
from smelt_jax.cli import main
from smelt_jax.scaling import figures, io, pipeline


@pytest.fixture(scope="module")
def paper_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper")
    pipeline.write_paper_fits(root)
    return root


def test_gain_cli_reproduces_paper_table(paper_dir, capsys):
    """Acceptance: `smelt gain` on the published coefficients: CE within 0.2 points, TPP within 1."""
    code = main(["gain", "--reference", str(paper_dir / "baseline"), "--target",
                 str(paper_dir / "smelt" / "coefficients.json"), "--compute", "1e20", "1e21", "1e22",
                 "--sparsity", "0.85", "0.95", "0.97", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 9
    for row in rows:
        assert 100 * row["ce_gain"] == pytest.approx(paper.CE_GAIN[(row["C"], row["S"])][0], abs=0.2)
        if row["C"] == 1e21:
            assert np.abs(np.array([row["tpp_reference"], row["tpp_target"]]) - paper.TPP_1E21[row["S"]]).max() <= 1
    assert main(["gain", "--reference", str(paper_dir / "baseline"), "--target", str(paper_dir / "smelt")]) == 0
    table = capsys.readouterr().out
    assert "| 1e+21 | 0.95 | 15.68% |" in table


def test_fit_bootstrap_gain_and_tables(tmp_path, capsys, monkeypatch):
    table = paper_pair_table(noise=0.002, seed=5)
    path = tmp_path / "runs.parquet"
    table.to_parquet(path)
    for arch in ("baseline", "smelt"):
        assert main(["fit", "--law", "smelt", "--input", str(path), "--out", str(tmp_path / arch),
                     "--arch", arch, "--bootstrap", "40", "--seed", "3"]) == 0
        coefficients = json.loads((tmp_path / arch / "coefficients.json").read_text())
        assert set("EAKabc") <= set(coefficients) and coefficients["n_points"] == 72
        assert coefficients["intervals"]["a"]["lo"] < coefficients["a"] < coefficients["intervals"]["a"]["hi"]
        assert 0 < coefficients["share_within_delta"] <= 1 and coefficients["rmse"] < 0.01
    capsys.readouterr()
    assert main(["gain", "--reference", str(tmp_path / "baseline"), "--target", str(tmp_path / "smelt"),
                 "--compute", "1e21", "1e23", "--sparsity", "0.95", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["extrapolated"] for r in rows] == [False, True]
    assert all(r["ce_lo"] <= r["ce_gain"] <= r["ce_hi"] for r in rows)
    (tmp_path / "pair.json").write_text(json.dumps({"reference": "baseline", "target": "smelt",
                                                    "compute": [1e21], "sparsity": [0.95]}))
    saved = {}  # every figure `smelt tables` writes, by file stem, to read its drawn range back
    original_save = figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda fig, out, stem: saved.setdefault(
        (Path(out).name, stem), fig) and original_save(fig, out, stem))
    assert main(["tables", str(tmp_path)]) == 0
    for name in ("ce_gain.md", "ce_gain.csv", "ce_gain.tex", "ce_gain.png", "ce_gain.pdf",
                 "baseline/coefficients.md", "smelt/loss_vs_compute.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    # the figures span the data's compute range (F x D of the fitted table), not the paper's 1e18-1e23,
    # at the table's sparsities
    data = (float((table["F"] * table["D"]).min()), float((table["F"] * table["D"]).max()))
    for key in (("smelt", "loss_vs_compute"), (tmp_path.name, "loss_vs_compute"), (tmp_path.name, "ce_gain")):
        ax = saved[key].axes[0]
        solid = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert solid, key
        for line in solid:
            x = np.asarray(line.get_xdata(), float)
            assert (x.min(), x.max()) == pytest.approx(data), key
        assert ax.get_xlim() == pytest.approx((data[0] / figures.AXIS_MARGIN, data[1] * figures.AXIS_MARGIN)), key
    assert {line.get_label().split("=")[-1] for line in saved[("smelt", "loss_vs_compute")].axes[0].get_lines()
            if not line.get_label().startswith("_")} == {"0.85", "0.95", "0.97"}


def test_chinchilla_fit_cli(tmp_path):
    table, _, _ = io.chinchilla_table()
    path = tmp_path / "chin.csv"
    table.to_csv(path, index=False)
    assert main(["fit", "--law", "chinchilla", "--method", "huber-likelihood", "--input", str(path),
                 "--out", str(tmp_path / "out")]) == 0
    c = json.loads((tmp_path / "out" / "coefficients.json").read_text())
    assert {"E", "A", "B", "alpha", "beta"} <= set(c) and c["n_points"] == 240
    assert c["B"] == pytest.approx(2085.4, rel=0.02)


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.drop(columns=["D"]), "missing column"),
    (lambda t: t.assign(loss=np.where(np.arange(len(t)) == 3, np.nan, t["loss"])), "NaN"),
    (lambda t: t.assign(F=-t["F"]), "must be > 0"),
    (lambda t: t.assign(S=1.0), r"\[0, 1\)"),
    (lambda t: t.head(6), "too few"),
])
def test_bad_tables_get_clear_errors(tmp_path, capsys, mutate, message):
    table = mutate(paper_pair_table(noise=0.0)[lambda t: t.arch == "smelt"])
    path = tmp_path / "bad.csv"
    table.to_csv(path, index=False)
    assert main(["fit", "--law", "smelt", "--input", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "smelt: error:" in err
    assert pd.Series([err]).str.contains(message).item(), err


def test_missing_input_and_bad_gain_args(tmp_path, paper_dir, capsys):
    assert main(["fit", "--law", "smelt", "--input", str(tmp_path / "nope.csv"), "--out", str(tmp_path)]) == 2
    assert main(["gain", "--reference", str(paper_dir / "baseline"), "--target", str(paper_dir / "smelt"),
                 "--sparsity", "1.5"]) == 2
    assert main(["gain", "--reference", str(tmp_path), "--target", str(paper_dir / "smelt")]) == 2
    assert "no coefficients" in capsys.readouterr().err


def test_fits_all_is_deterministic(tmp_path):
    """Two regenerations give byte-identical text outputs (small Chinchilla bootstrap for speed)."""
    for run in ("a", "b"):
        assert main(["fits-all", "--fits-dir", str(tmp_path / run), "--chinchilla-draws", "50"]) == 0
    texts = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                   if p.suffix in (".json", ".md", ".csv", ".tex"))
    assert len(texts) >= 12
    for rel in texts:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel

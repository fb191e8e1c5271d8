"""Every notebook executes on a small fixture (runs with metrics, a results table, fits, analysis CSVs)."""

import json
from pathlib import Path

import pandas as pd
import pytest

from smelt_jax.analysis import notebooks_runner
from smelt_jax.design import paper
from smelt_jax.run_files.results import EndpointResult, append_result

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXPECTED = {"budgets_and_matching", "training_curves", "scaling_fits", "mechanistic", "results_micro"}


def _suite_folder(folder: Path) -> None:
    """A suite folder as `smelt fit-suite` writes it, from synthetic endpoints of the paper's laws."""
    from smelt_jax.scaling.endpoints import export_table
    from smelt_jax.scaling.suite_fits import fit_suite_table

    rows = []
    for arch, law in (("baseline", paper.BASELINE_LAW), ("smelt", paper.SMELT_LAW)):
        for scale, flops in (("a", 6e8), ("b", 1.2e9)):
            for label, sparsity in (("s0", 0.0), ("s85", 0.85), ("s95", 0.95)):
                for branch, tokens in enumerate((20e9, 60e9, 200e9)):
                    rows.append({"run_id": f"fx-{scale}-{label}-{arch}-0", "branch": branch,
                                 "pair_id": f"fx-{scale}-{label}", "arch": arch, "scale": scale,
                                 "sparsity_label": label, "sparsity": sparsity, "flops_per_token": flops,
                                 "tokens": tokens, "val_loss": float(law.predict(flops, sparsity, tokens)),
                                 "loss_code": float(law.predict(flops, sparsity, tokens)) + 0.02})
    folder.mkdir(parents=True)
    export_table(pd.DataFrame(rows)).to_csv(folder / "results.csv", index=False)
    (folder / "fit.json").write_text('{"bootstrap_draws": 4}')
    fit_suite_table(folder)


def _fixture(root: Path) -> Path:
    suite = "fixture"
    root.mkdir(parents=True, exist_ok=True)
    (root / "suite.txt").write_text(suite)
    for arch, offset in (("baseline", 0.0), ("smelt", -0.05)):
        run_id = f"{suite}-tiny-s85-{arch}-0000000{len(arch)}"
        for phase in ("stable", "branch0"):
            lines = [{"step": s, "tokens": 128 * s, "loss": 5.0 / s + offset, "ce": 5.0 / s, "mfu": 0.1,
                      "tokens_per_s": 1e3} for s in range(1, 5)]
            lines.append({"step": 4, "eval": {"overall": 2.0 + offset, "code": 2.1}})
            folder = root / "runs" / suite / run_id / phase
            folder.mkdir(parents=True)
            (folder / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
        append_result(EndpointResult(
            run_id=run_id, branch=0, pair_id=f"{suite}-tiny-s85", suite=suite, arch=arch, scale="tiny",
            sparsity_label="s85", sparsity=0.85, flops_per_token=1e6, params=10**6, tokens=512,
            cumulative_flops=5.12e8, val_loss=2.0 + offset, losses_by_source={"code": 2.1}),
            root / "runs" / suite)
    for arch, exponent in (("baseline", 0.37), ("smelt", 0.39)):
        folder = root / "fits" / arch
        folder.mkdir(parents=True)
        (folder / "coefficients.json").write_text(json.dumps(
            {"law": "smelt", "arch": arch, "E": 1.5, "A": 1500.0, "K": 2e6, "a": exponent, "b": 0.15,
             "c": 0.66, "rmse": 0.01, "n_points": 8, "source": "fixture"}))
    _suite_folder(root / "suite")
    analysis = root / "analysis"
    analysis.mkdir()
    pd.DataFrame([{"layer": 1, "k": 2, "n_experts": 8, "n_tokens": 64, "mean_overlap": 0.7,
                   "random_reference": 0.5, "overlap_fraction": 0.35}]).to_csv(analysis / "routing_overlap.csv",
                                                                              index=False)
    pd.DataFrame([{"layer": 1, "stage": stage, "mean_cosine": 0.5, "n_vectors": 64}
                  for stage in ("normed_input", "q", "k", "v", "pv", "attn_out")]).to_csv(
        analysis / "attention_stage_cosines.csv", index=False)
    pd.DataFrame([{"layer": layer, "visit": visit, "head": 0, "sink_mass": 0.3, "n_queries": 10}
                  for layer, visit in ((0, 1), (1, 1), (1, 2))]).to_csv(analysis / "attention_sink_mass.csv",
                                                                        index=False)
    return root


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook executed once on the fixture: {name: executed notebook}."""
    runs = notebooks_runner.run_all(NOTEBOOKS, fixture=_fixture(tmp_path_factory.mktemp("nb")), write=False,
                                    timeout=120)
    return {name: notebook for name, _, notebook in runs}


def test_every_notebook_executes_on_a_fixture(executed):
    assert {p.stem for p in NOTEBOOKS.glob("*.py")} == EXPECTED
    assert set(executed) == EXPECTED


def test_fixture_environment_and_a_failing_notebook_is_reported(tmp_path):
    env = notebooks_runner.fixture_environment(_fixture(tmp_path / "fx"))
    assert env["SMELT_SUITE"] == "fixture" and env["SMELT_RESULTS_DIR"].endswith("runs/fixture")
    assert "SMELT_CHINCHILLA_FITS_DIR" not in env  # absent paths are not set
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.py").write_text("# %%\nraise ValueError('cell failed on purpose')\n")
    with pytest.raises(RuntimeError, match="cell failed on purpose"):
        notebooks_runner.run_all(broken, write=False, timeout=60)


@pytest.mark.parametrize("name", ["training_curves", "scaling_fits", "results_micro"])
def test_executed_notebooks_show_their_figures_inline(executed, name):
    """No Agg backend in the notebooks: an executed notebook carries its figures as image outputs."""
    images = [output for cell in executed[name].cells for output in cell.get("outputs", [])
              if "image/png" in output.get("data", {})]
    assert images, f"{name}: no inline figure in the executed notebook"

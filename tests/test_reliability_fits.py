"""`smelt fit-suite` and `smelt fit` on bad tables (issue 27, item 4 and the zero-byte CSV of item 9):
exit 2 with one line naming the run and branch of a bad row, and a suite folder written whole or not
at all."""

from __future__ import annotations

import math
import shutil

import pytest

from smelt_jax.cli import main
from smelt_jax.scaling import endpoints, pipeline, suite_fits
from tests.test_scaling_endpoints import _paper_loss, _store


def _folder_bytes(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A fitted suite folder (results.csv of the paper's laws as data, 4 bootstrap draws)."""
    folder = tmp_path_factory.mktemp("fitted") / "suite"
    folder.mkdir()
    endpoints.export_table(_store(_paper_loss)).to_csv(folder / "results.csv", index=False, float_format="%.8g")
    (folder / "fit.json").write_text('{"bootstrap_draws": 4}')
    (folder / "README.md").write_text("notes kept across refits\n")
    suite_fits.fit_suite_table(folder)
    return folder


@pytest.fixture
def suite(fitted, tmp_path):
    shutil.copytree(fitted, tmp_path / "suite")
    return tmp_path / "suite"


@pytest.mark.parametrize("value", [math.nan, -1.0, "oops"])
def test_bad_row_exits_2_names_the_run_and_leaves_the_folder_as_it_was(suite, value, capsys):
    before = _folder_bytes(suite)
    table = (suite / "results.csv").read_text().splitlines()
    header = table[0].split(",")
    row = table[5].split(",")
    run_id, branch = row[header.index("run_id")], row[header.index("branch")]
    row[header.index("val_loss")] = str(value)
    table[5] = ",".join(row)
    (suite / "results.csv").write_text("\n".join(table) + "\n")
    before["results.csv"] = (suite / "results.csv").read_bytes()
    assert main(["fit-suite", str(suite)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and f"run {run_id} branch {branch}: val_loss=" in captured.err
    assert captured.out == ""
    assert _folder_bytes(suite) == before
    assert [p.name for p in suite.parent.iterdir()] == ["suite"]  # no staging folder left


@pytest.mark.integration
def test_a_failure_mid_write_leaves_the_old_folder_whole(suite, monkeypatch):
    """An error after points.csv and the fits were rewritten (here: the endpoint tables) leaves every
    old file, the old ce_gain.md beside the old points.csv."""
    before = _folder_bytes(suite)
    table = (suite / "results.csv").read_text().replace("0.95,", "0.9,")  # another fit: new bytes
    (suite / "results.csv").write_text(table)
    before["results.csv"] = (suite / "results.csv").read_bytes()

    def broken(*_args, **_kwargs):
        raise ValueError("disk went away")
    monkeypatch.setattr(suite_fits, "write_endpoint_tables", broken)
    with pytest.raises(ValueError, match="disk went away"):
        suite_fits.fit_suite_table(suite)
    assert _folder_bytes(suite) == before
    monkeypatch.undo()
    paths = suite_fits.fit_suite_table(suite)
    assert all(path.is_file() and path.parent.name in ("suite", "baseline", "smelt") for path in paths)
    after = _folder_bytes(suite)
    assert after["README.md"] == before["README.md"] and after["points.csv"] != before["points.csv"]
    assert '"input": "' + str(suite / "points.csv") in after["smelt/coefficients.json"].decode()


def test_table_too_small_to_fit_exits_2(tmp_path, capsys):
    folder = tmp_path / "small"
    folder.mkdir()
    endpoints.export_table(_store(_paper_loss, scales=(("a", 6e8),), labels=(("s85", 0.85),))).head(3) \
        .to_csv(folder / "results.csv", index=False)
    assert main(["fit-suite", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no fit" in err
    assert sorted(p.name for p in folder.iterdir()) == ["results.csv"]


@pytest.mark.parametrize("command", [["fit", "--law", "smelt", "--input", "{csv}", "--out", "{out}"],
                                     ["fit-suite", "{dir}"]])
def test_zero_byte_csv_is_one_line(tmp_path, command, capsys):
    (tmp_path / "results.csv").write_bytes(b"")
    argv = [a.format(csv=tmp_path / "results.csv", out=tmp_path / "out", dir=tmp_path) for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty file" in err and "Traceback" not in err


def test_fits_all_skips_a_staging_folder_left_by_a_killed_fit_suite(tmp_path, monkeypatch):
    for name in ("suite", ".suite.fitting-abc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.csv").write_text("x\n")
    fitted = []
    monkeypatch.setattr(pipeline, "write_paper_fits", lambda out: [])
    monkeypatch.setattr(pipeline, "write_chinchilla_fits", lambda out, draws: [])
    monkeypatch.setattr(suite_fits, "fit_suite_table", lambda folder: fitted.append(folder.name) or [])
    suite_fits.fits_all(tmp_path)
    assert fitted == ["suite"]

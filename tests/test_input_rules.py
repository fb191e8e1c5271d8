"""Small input rules (issue 43's low items): a duplicate YAML key is refused in one line; the XLA
compilation cache goes to the user's cache folder, never into the package."""

from __future__ import annotations

from smelt_jax.cli import main
from tests.custom_run_helpers import TINY_SPEC, write_spec_file


def test_a_duplicate_yaml_key_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    write_spec_file(path, TINY_SPEC)
    path.write_text(path.read_text() + "arch: baseline\n")
    assert main(["train", "--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key arch given twice" in err and str(path) in err, err


def test_the_compilation_cache_goes_to_the_users_cache_folder(monkeypatch, tmp_path):
    from smelt_jax.platform.paths import PACKAGE_DIR, checkout_root
    from smelt_jax.train.compile_cache import default_cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "smelt_jax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    folder = default_cache_dir()
    assert PACKAGE_DIR not in folder.parents and checkout_root() not in folder.parents


def test_a_binary_results_csv_is_refused_naming_the_file(tmp_path, capsys):
    (tmp_path / "results.csv").write_bytes(bytes(range(128, 256)) * 20)
    assert main(["fit-suite", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "results.csv") in err and "not a text CSV" in err, err

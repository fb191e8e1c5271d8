"""The one storage module decides which locations exist: local paths and gs:// (issue 24 item 3), and
refuses every other URL scheme with one line before anything is written (issue 27 item 7: before,
`--runs-dir s3://b/x` trained into the local folder ./s3:/b/x and exited 0, and `sweep status
--runs-dir FILE` printed plausible counts)."""

from __future__ import annotations

import pytest

from smelt_jax.platform import storage
from smelt_jax.cli import main
from smelt_jax.platform.errors import UsageError
from smelt_jax.platform.storage import UnsupportedLocation


@pytest.mark.parametrize("url", ["s3://b/x", "http://host/runs", "file:///tmp/x", "hdfs://nn/x",
                                 "az://container/x"])
def test_other_schemes_are_refused_everywhere(url):
    for fn in (storage.check, storage.as_path, storage.normalize):
        with pytest.raises(UnsupportedLocation) as err:
            fn(url)
        assert "\n" not in str(err.value) and url.split("://")[0] + "://" in str(err.value)
    assert isinstance(UnsupportedLocation("x"), UsageError)  # one line, exit 2


@pytest.mark.parametrize("url", ["gs://bucket/runs", "runs", "/tmp/a:b", "./s3:b", "relative/x://y"])
def test_local_paths_and_gs_pass(url):
    assert storage.check(url) == url
    storage.as_path(url)  # no error
    assert storage.is_gcs(url) == url.startswith("gs://")


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        storage.require_folder(tmp_path / "f", "runs root")
    storage.require_folder(tmp_path, "runs root")
    storage.require_folder(tmp_path / "not-yet", "runs root")  # made when written
    storage.require_folder("gs://bucket/prefix", "runs root")


def test_smelt_train_refuses_an_s3_runs_dir_before_start_up(tmp_path, monkeypatch, capsys):
    import experiments
    monkeypatch.chdir(tmp_path)
    run_id = experiments.load_suite("smoke")[0].id
    assert main(["train", run_id, "--runs-dir", "s3://b/x", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported location scheme s3://" in err[0]
    assert list(tmp_path.iterdir()) == []  # no ./s3:/b/x


def test_smelt_train_and_sweep_status_refuse_a_file_as_runs_dir(tmp_path, monkeypatch, capsys):
    import experiments
    (tmp_path / "runs").write_text("not a folder")
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "status", "--suite", "micro", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    run_id = experiments.load_suite("smoke")[0].id
    assert main(["train", run_id, "--runs-dir", str(tmp_path / "runs"), "--quiet"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err

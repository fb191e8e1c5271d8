"""Issue 53, item 3: one checked door for outside values (`smelt_jax/platform/env.py`). A bad environment
variable is one line naming it (exit 2) before anything is written; an empty one counts as unset; a
relative XDG_CACHE_HOME is ignored; JAX_PLATFORMS naming a platform the machine lacks is one line, not
chained tracebacks; an unreachable gs:// runs root fails in seconds with one line and the cause (a closed
local port stands in for the bucket) in `sweep status`, `results collect` and `train`."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from gcs_emulator import gcs_emulator  # noqa: F401 — the fixture
from smelt_jax.cli import main
from smelt_jax.platform import env, storage
from tests.custom_run_helpers import TINY_SPEC, write_spec_file

PACKAGE = Path(__file__).resolve().parents[1] / "smelt_jax"


def _refused(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("smelt: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMELT_RUNS_DIR", raising=False)
    return tmp_path


@pytest.mark.parametrize("value", ["5m", "nan", "-1", "0", "inf", " "])
def test_a_bad_lock_stale_seconds_is_one_line_before_anything_is_written(workdir, monkeypatch, capsys, value):
    spec = write_spec_file(workdir / "run.yaml", TINY_SPEC)
    monkeypatch.setenv("SMELT_LOCK_STALE_SECONDS", value)
    _refused(capsys, ["train", "--config", str(spec)], "SMELT_LOCK_STALE_SECONDS")
    assert not (workdir / "runs").exists()
    with pytest.raises(env.EnvError):
        env.lock_stale_seconds()


def test_lock_stale_seconds_reads_a_number_and_defaults_when_unset_or_empty(monkeypatch):
    from smelt_jax.train.lock import stale_seconds
    monkeypatch.setenv("SMELT_LOCK_STALE_SECONDS", "2.5")
    assert stale_seconds() == 2.5
    monkeypatch.setenv("SMELT_LOCK_STALE_SECONDS", "")
    assert stale_seconds() == env.DEFAULT_LOCK_STALE_SECONDS == 300


def test_an_empty_runs_dir_is_the_default_runs_folder_not_the_current_one(workdir, monkeypatch):
    from smelt_jax.run_files.rundir import runs_root
    from tests.custom_run_helpers import skip_training
    monkeypatch.setenv("SMELT_RUNS_DIR", "")
    assert runs_root() == Path("runs")
    skip_training(monkeypatch)
    spec = write_spec_file(workdir / "run.yaml", TINY_SPEC)
    assert main(["train", "--config", str(spec)]) == 0
    assert (workdir / "runs" / "custom").is_dir() and not (workdir / "custom").exists()


def test_a_relative_xdg_cache_home_is_ignored(workdir, monkeypatch):
    from smelt_jax.train.compile_cache import default_cache_dir
    monkeypatch.setenv("HOME", str(workdir / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_dir() == workdir / "home" / ".cache" / "smelt_jax" / "xla"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert default_cache_dir() == workdir / "home" / ".cache" / "smelt_jax" / "xla"
    monkeypatch.setenv("XDG_CACHE_HOME", str(workdir / "abs"))
    assert default_cache_dir() == workdir / "abs" / "smelt_jax" / "xla"
    monkeypatch.delenv("SMELT_XLA_CACHE", raising=False)
    assert env.xla_cache_dir() == str(workdir / "abs" / "smelt_jax" / "xla")


def test_jax_platforms_naming_a_missing_device_is_refused(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    with pytest.raises(env.EnvError, match="JAX_PLATFORMS=tpu asks for tpu"):
        env.check_jax_platforms(dev, {"JAX_PLATFORMS": "tpu"})
    with pytest.raises(env.EnvError, match="not a JAX platform"):
        env.check_jax_platforms(dev, {"JAX_PLATFORMS": "cpu,tpuu"})
    env.check_jax_platforms(dev, {"JAX_PLATFORMS": "cpu"})
    env.check_jax_platforms(dev, {"JAX_PLATFORMS": ""})
    (dev / "accel0").touch()
    env.check_jax_platforms(dev, {"JAX_PLATFORMS": "tpu"})


@pytest.mark.skipif(any(Path("/dev").glob("accel*")) or Path("/dev/vfio").exists(), reason="a TPU is present")
@pytest.mark.parametrize("argv", [["fit", "--law", "chinchilla", "--input", "t.csv", "--out", "o"],
                                  ["train", "--config", "run.yaml"]])
def test_jax_platforms_tpu_on_a_cpu_machine_is_one_line_in_train_and_fit(workdir, monkeypatch, capsys, argv):
    write_spec_file(workdir / "run.yaml", TINY_SPEC)
    (workdir / "t.csv").write_text("N,D,loss\n" + "".join(f"{n:g},{d:g},{3 + 1e3 / n + 1e4 / d}\n"
                                                          for n in (1e6, 4e6, 1.6e7) for d in (1e8, 1e9, 1e10)))
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    _refused(capsys, argv, "JAX_PLATFORMS=tpu")
    assert sorted(p.name for p in workdir.iterdir()) == ["run.yaml", "t.csv"]  # nothing written


def test_a_backend_jax_cannot_start_is_one_line_naming_the_variable(workdir, monkeypatch, capsys):
    from smelt_jax.cli import fit as fit_cli

    def failing(args):
        try:
            raise RuntimeError("NOT_FOUND: TPU initialization failed: No jellyfish device found.")
        except RuntimeError as err:
            raise RuntimeError("Unable to initialize backend 'tpu': NOT_FOUND: TPU initialization failed "
                               "(set JAX_PLATFORMS='' to automatically choose an available backend)") from err

    monkeypatch.setattr(fit_cli, "_fit", failing)
    monkeypatch.setattr(env, "check_jax_platforms", lambda *a, **k: None)  # as on a machine with the device
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    _refused(capsys, ["fit", "--law", "chinchilla", "--input", "t.csv", "--out", "o"],
             "JAX_PLATFORMS=tpu", "Unable to initialize backend 'tpu'")
    monkeypatch.setattr(fit_cli, "_fit", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other RuntimeError stays a bug
        main(["fit", "--law", "chinchilla", "--input", "t.csv", "--out", "o"])


@pytest.fixture
def closed_port(monkeypatch):
    """Cloud Storage at a local port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    for name in ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST"):
        monkeypatch.setenv(name, url)
    storage._bucket.cache_clear()
    yield url
    storage._bucket.cache_clear()


ROOT = "gs://unreachable-bucket/runs"


@pytest.mark.parametrize("argv", [["sweep", "status", "--suite", "smoke", "--runs-dir", ROOT],
                                  ["results", "collect", "--runs-dir", ROOT],
                                  ["train", "--config", "run.yaml"],
                                  ["train", "smoke-xs"]])
def test_an_unreachable_gs_root_fails_fast_in_one_line(workdir, monkeypatch, capsys, closed_port, argv):
    write_spec_file(workdir / "run.yaml", TINY_SPEC)
    monkeypatch.setenv("SMELT_RUNS_DIR", ROOT)
    start = time.monotonic()
    _refused(capsys, argv, "cannot reach the runs root", ROOT, "connect")
    assert time.monotonic() - start < 60
    assert sorted(p.name for p in workdir.iterdir()) == ["run.yaml"]


def test_a_reachable_root_passes_the_probe(tmp_path, gcs_emulator):  # noqa: F811 - the fixture
    storage.check_reachable(tmp_path)  # a local root: nothing to probe
    storage.check_reachable("gs://test-bucket/runs")  # the emulator answers: the probe passes
    storage.check_reachable("gs://test-bucket")


def test_every_outside_value_is_read_through_the_door():
    """No module but platform/env.py reads SMELT_*, XDG_CACHE_HOME or JAX_PLATFORMS from the environment."""
    read = re.compile(r"""(environ\.get\(|getenv\(|environ\[)\s*["'](SMELT_\w+|XDG_CACHE_HOME|JAX_PLATFORMS)["']\s*[\],)]""")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "env.py" and path.parent.name == "platform":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if read.search(line) and "=" not in line.split(read.search(line).group(0))[1][:3]:
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert found == []
    for name in ("SMELT_RUNS_DIR", "SMELT_LOCK_STALE_SECONDS", "SMELT_XLA_CACHE", "XDG_CACHE_HOME",
                 "SMELT_DATA_DIR", "SMELT_CORPUS_MIRROR", "JAX_PLATFORMS"):
        assert name in env.__doc__

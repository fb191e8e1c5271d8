"""Fits give the same bytes whatever the CPU's vector width (smelt_jax/platform/fit_isa.py, scaling/written.py).

The byte-for-byte tests run the fits in two fresh processes, one with XLA's CPU ISA capped at AVX2 (as on
an AVX2-only machine) and one at this machine's default, and compare every written file; the smoke suite
is also compared with the committed fits/smoke. Fast tier: the smoke and Chinchilla fits (the Chinchilla
bootstrap cut to 20 draws); integration tier: all of fits/, which must also equal the committed files
(`make fits` leaves `git status` clean).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smelt_jax.platform import fit_isa
from smelt_jax.scaling import written
from smelt_jax.scaling.laws import ChinchillaLaw, SmeltLaw

ROOT = Path(__file__).resolve().parents[1]


def test_fit_environment_caps_every_kernel_family_and_replaces_a_given_cap():
    env = fit_isa.fit_environment({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX512"})
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", "--xla_cpu_max_isa=AVX2"]
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and "X86_V4" in env["NPY_DISABLE_CPU_FEATURES"].split()
    assert fit_isa.is_pinned(env) and not fit_isa.is_pinned({"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"})
    assert fit_isa.with_isa(env["XLA_FLAGS"], None) == "--xla_force_host_platform_device_count=8"


def test_a_process_that_loaded_numpy_is_not_pinned_in_place(monkeypatch):
    for key in ("NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(key, raising=False)
    assert fit_isa.pin_this_process() is False  # numpy is loaded here: too late, and nothing is changed
    assert "OPENBLAS_CORETYPE" not in os.environ


def test_degenerate_values_are_written_as_their_bounds_with_reasons():
    raw = {"law": "smelt", "E": 7.19e-37, "A": 1.6e7, "K": 16.4, "a": 5.1e-39, "b": 10.5, "c": 0.147,
           "intervals": {"A": {"se": float("inf"), "lo": 0.287, "hi": 4.27e41},
                         "a": {"se": 1.3e-54, "lo": 5.1e-39, "hi": 5.1e-39},
                         "c": {"se": 0.0694595, "lo": 0.1251729, "hi": 0.40008}}}
    out = written.rounded(written.settle_bounds(raw, SmeltLaw))
    assert (out["E"], out["a"]) == (0.0, 0.0) and sorted(out["at_bound"]) == ["E", "a"]
    assert out["intervals"]["A"]["hi"] == float("inf") and "se, hi" in out["intervals"]["A"]["unbounded"]
    assert out["intervals"]["a"] == {"se": 0.0, "lo": 0.0, "hi": 0.0}
    assert out["intervals"]["c"] == {"se": 0.0695, "lo": 0.125, "hi": 0.4}  # 3 significant digits
    assert out["b"] == 10.5 and out["K"] == 16.4
    assert written.rounded({"E": 1.81692714, "grad_norm": 4.3217e-05, "n": 1.234567891}) == \
        {"E": 1.81693, "grad_norm": 4.3e-05, "n": 1.2345679}
    assert written.lower_bounded(ChinchillaLaw) == ["E", "A", "B"]
    SmeltLaw(**{k: out[k] for k in SmeltLaw.param_names})  # a law at its bound still loads


def _fits_all(where: Path, isa: str | None, *args: str) -> subprocess.Popen:
    """`smelt fits-all` started in a fresh process in `where` (holding fits/), XLA's ISA capped at `isa`
    (None: this machine's default), nothing else of the fit environment given."""
    env = {k: v for k, v in os.environ.items() if k not in ("NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE")}
    env["XLA_FLAGS"] = fit_isa.with_isa(env.get("XLA_FLAGS", ""), isa)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "smelt_jax", "fits-all", *args], cwd=where, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_twice(tmp_path: Path, folders: list[str], *args: str) -> tuple[dict, dict]:
    """The two runs side by side (one core each where there are two); their fits/ folders' files."""
    runs = {}
    for name, isa in (("avx2", "AVX2"), ("default", None)):
        for folder in folders:
            if (ROOT / "fits" / folder).exists():
                shutil.copytree(ROOT / "fits" / folder, tmp_path / name / "fits" / folder)
        runs[name] = _fits_all(tmp_path / name, isa, *args)
    for name, run in runs.items():
        _, err = run.communicate(timeout=3600)
        assert run.returncode == 0, f"{name}: {err[-2000:]}"
    return _files(tmp_path / "avx2" / "fits"), _files(tmp_path / "default" / "fits")


def _assert_same(a: dict, b: dict, label: str) -> None:
    assert sorted(a) == sorted(b), label
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"{label}: {len(differ)} file(s) differ: {differ[:10]}"


# Each process takes ~32 s of CPU (measured: 31.7 s user on this AMD EPYC); the two run side by side, so
# ~35 s on two idle cores and several minutes on a loaded one: a timeout of its own, above make test's 120 s.
@pytest.mark.timeout(900)
def test_smoke_and_chinchilla_fits_are_the_same_bytes_at_avx2_and_at_the_default_isa(tmp_path):
    capped, default = _run_twice(tmp_path, ["smoke"], "--only", "chinchilla", "smoke", "--chinchilla-draws", "20")
    assert any(name.startswith("chinchilla/") for name in capped) and "smoke/smelt/coefficients.json" in capped
    _assert_same(capped, default, "AVX2 against default")
    committed = {f"smoke/{name}": data for name, data in _files(ROOT / "fits" / "smoke").items()}
    _assert_same({k: v for k, v in default.items() if k.startswith("smoke/")}, committed,
                 "the smoke fit against the committed fits/smoke")


@pytest.mark.integration
def test_every_fit_is_the_same_bytes_at_avx2_at_the_default_isa_and_as_committed(tmp_path):
    folders = sorted(p.name for p in (ROOT / "fits").iterdir() if p.is_dir())
    capped, default = _run_twice(tmp_path, folders)
    _assert_same(capped, default, "AVX2 against default")
    committed = {name: data for name, data in _files(ROOT / "fits").items() if name.split("/")[0] in folders}
    _assert_same(default, committed, "fits-all against the committed fits/ folders")

"""The installed wheel stands alone: the files read at run time are inside it and run ids are unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DATA = ("experiments/layouts.json", "smelt_jax/data/corpus_expected.json",
                "smelt_jax/reference_data/README.md",
                "smelt_jax/reference_data/chinchilla/svg_extracted_data.csv",
                "smelt_jax/reference_data/jobset/jobset.x-k8s.io_jobsets.yaml")
IDS_SCRIPT = """
import json, smelt_jax
from experiments import SUITE_NAMES, load_suite
print(json.dumps({"file": smelt_jax.__file__,
                  "ids": {suite: [run.id for run in load_suite(suite)] for suite in SUITE_NAMES}}))
"""


pytestmark = pytest.mark.integration  # real processes and packaging: `make test-integration`


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the source tree: remove what this build leaves there (git-ignored anyway).
    leftovers = [p for p in (REPO / "build", REPO / "smelt_jax.egg-info") if not p.exists()]
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(REPO)], check=True, cwd=out)
    finally:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
    (path,) = out.glob("smelt_jax-*.whl")
    return path


def test_wheel_carries_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in PACKAGE_DATA if name not in names]
    assert not missing, f"not in {wheel.name}: {missing}"
    assert not any(name.startswith(("tests/", "fits/", "notebooks/")) for name in names)


def test_installed_wheel_gives_the_same_run_ids(wheel, tmp_path):
    """Run ids from the wheel (installed into its own folder, imported from elsewhere) equal the ones
    from this checkout (today's editable install)."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    runs = {}
    for name, path in (("checkout", str(REPO)), ("wheel", str(target))):
        env = {**os.environ, "PYTHONPATH": path}
        proc = subprocess.run([sys.executable, "-c", IDS_SCRIPT], env=env, cwd=tmp_path,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["wheel"]["file"].startswith(str(target))
    assert not runs["checkout"]["file"].startswith(str(target))
    assert runs["wheel"]["ids"] == runs["checkout"]["ids"]
    # smelt16 32, ablations200m 19, micro 32, ablationsmicro 13, smoke 8, nano 10 (4 pairs + the seed-1
    # pair), nanolr 16, nano2 14 (issue 42), ladder 19 (issue 51)
    assert sum(map(len, runs["wheel"]["ids"].values())) == 163

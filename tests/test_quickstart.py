"""docs/tpu-quickstart.md and the container recipe.

- Every command of the quick start's plain ```bash blocks runs here (dry runs, in an empty folder, with
  SMELT_RUNS_DIR an empty runs root whose smelt16 results store holds synthetic endpoints) and exits 0.
- Every command of its ```bash cloud blocks (the ones that need a Google Cloud account) names no real
  project, bucket, region, zone or account: only the placeholders.
- `make image` without docker/podman, or with a daemon it cannot reach, says so in one line and fails;
  with a (fake) tool it runs the build it should; `make push-image` refuses local tags and placeholders.
- The image name is one name: smelt_jax.sweep.base, the Makefile, the Dockerfile and the quick start agree,
  and `smelt sweep submit --backend xpk --submit` refuses the placeholder image in one line (exit 2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import experiments
from smelt_jax.design import paper
from smelt_jax.run_files.results import TABLE_NAME, EndpointResult
from smelt_jax.sweep import base

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "tpu-quickstart.md"
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
PLACEHOLDERS = ("PROJECT", "PROJECT_NUMBER", "BILLING_ACCOUNT", "REGION", "ZONE", "BUCKET", "CLUSTER",
                "TAG", "JOB")
COMMAND_TIMEOUT = 60


pytestmark = pytest.mark.integration  # real processes and packaging: `make test-integration`


def blocks() -> list[tuple[str, list[str]]]:
    """(info string, commands) per fenced block; a command joins its backslash continuations."""
    found = []
    for info, body in FENCE.findall(DOC.read_text()):
        commands, current = [], ""
        for line in body.splitlines():
            if not current and (not line.strip() or line.lstrip().startswith("#")):
                continue
            current += line.rstrip()
            if current.endswith("\\"):
                current = current[:-1].rstrip() + " "
                continue
            commands.append(current.strip())
            current = ""
        assert not current, f"unterminated continuation in {info!r} block: {current}"
        found.append((info.strip(), commands))
    return found


def commands(kind: str) -> list[str]:
    return [c for info, cmds in blocks() if info == kind for c in cmds]


def test_every_block_is_marked():
    """Only two kinds of command blocks, so no command escapes both checks."""
    kinds = {info for info, _ in blocks()}
    assert kinds <= {"bash", "bash cloud"}, f"unmarked block kinds: {kinds - {'bash', 'bash cloud'}}"
    assert len(commands("bash")) >= 8 and len(commands("bash cloud")) >= 30


def test_quickstart_covers_the_path():
    text = " ".join(commands("bash cloud") + commands("bash"))
    for needed in ("gcloud services enable", "gcloud billing projects link", "--uniform-bucket-level-access",
                   "roles/storage.objectAdmin", "iam.workloadIdentityUser", "--workload-metadata=GKE_METADATA",
                   "xpk cluster create", "gcloud artifacts repositories create", "make image push-image",
                   "smelt data prepare", "--out gs://BUCKET/", "smelt sweep submit --suite smelt16 --backend xpk --submit",
                   "smelt sweep status", "smelt sweep cancel", "smelt results collect", "smelt results export",
                   "smelt fit-suite", "queued-resources"):
        assert needed in text, f"the quick start lacks {needed!r}"
    assert "chip-hours" in DOC.read_text() and "roofline" in DOC.read_text()


# --- cloud commands: placeholders only ---------------------------------------------------------------

WORD = "(?:" + "|".join(sorted(PLACEHOLDERS, key=len, reverse=True)) + ")"
# values that identify a project, bucket, place or account, and what each must look like
IDENTIFYING = [
    (re.compile(r"--(?:project|zone|region|location|billing-account)[= ]([^\s'\"]+)"), rf"^{WORD}$"),
    (re.compile(r"gs://([^/\s'\"*]+)"), rf"^{WORD}$"),
    (re.compile(r"([\w.-]+)-docker\.pkg\.dev/([\w.-]+)"), rf"^{WORD}$"),
    (re.compile(r"@([\w.-]+)\.iam\.gserviceaccount\.com"), rf"^{WORD}$"),
    (re.compile(r"serviceAccount:([\w-]+)-compute@"), rf"^{WORD}$"),
    (re.compile(r"([\w.-]+)\.svc\.id\.goog"), rf"^{WORD}$"),
    (re.compile(r"--cluster[= ]([^\s'\"]+)"), rf"^(?:[\w-]+=)?{WORD}(?:-\w+)?(?:,[\w-]+={WORD}(?:-\w+)?)*$"),
]
REAL_LOOKING = [
    re.compile(r"\b(?:us|europe|asia|northamerica|southamerica|australia|me|africa)-[a-z]+\d+(?:-[a-z])?\b"),
    re.compile(r"\b\d{10,}\b"),                    # project numbers
    re.compile(r"\b[0-9A-F]{6}-[0-9A-F]{6}-[0-9A-F]{6}\b"),  # billing accounts
]


def test_cloud_commands_hold_only_placeholders():
    problems = []
    for command in commands("bash cloud"):
        for pattern, allowed in IDENTIFYING:
            for match in pattern.finditer(command):
                for value in match.groups():
                    if not re.match(allowed, value):
                        problems.append(f"{value!r} in: {command}")
        for pattern in REAL_LOOKING:
            problems += [f"{m.group(0)!r} looks real in: {command}" for m in pattern.finditer(command)]
    assert not problems, "\n".join(problems)


def test_placeholder_checker_catches_a_real_project():
    """The check above is not vacuous: real values fail it."""
    for real in ("gcloud config set project x --project=my-proj",
                 "gcloud storage buckets create gs://my-bucket",
                 "make push-image IMAGE=us-east5-docker.pkg.dev/my-proj/smelt/smelt-jax:abc"):
        hits = [v for pattern, allowed in IDENTIFYING for m in pattern.finditer(real) for v in m.groups()
                if not re.match(allowed, v)]
        hits += [m.group(0) for pattern in REAL_LOOKING for m in pattern.finditer(real)]
        assert hits, real


# --- local commands: run them --------------------------------------------------------------------------

def seed_results(runs_root: Path) -> None:
    """A smelt16 results store with synthetic endpoints from the paper's laws (what `smelt results
    collect` leaves after a sweep of the suite's own runs): 2 scales x 3 sparsities x 3 horizons per architecture."""
    grid = {(r.scale, r.sparsity_label, r.arch): r.id for r in experiments.load_suite("smelt16")}
    rows = []
    for arch, law in (("baseline", paper.BASELINE_LAW), ("smelt", paper.SMELT_LAW)):
        for scale, flops in (("100m", 6.0e8), ("200m", 1.24e9)):
            for label, sparsity in (("s85", 0.85), ("s95", 0.95), ("s97", 0.97)):
                run_id = grid[scale, label, arch]  # the suite's own runs, as a sweep's store holds them
                for branch, tokens in enumerate((20.5e9, 62.4e9, 215.6e9)):
                    rows.append(EndpointResult(
                        run_id=run_id, branch=branch, pair_id=f"{scale}-{label}", suite="smelt16", arch=arch,
                        scale=scale, sparsity_label=label, sparsity=sparsity, flops_per_token=flops,
                        params=int(flops / 6), tokens=int(tokens), cumulative_flops=flops * tokens,
                        val_loss=float(law.predict(flops, sparsity, tokens)), time="2026-01-01T00:00:00Z",
                    ).to_row())
    folder = runs_root / "smelt16"
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(folder / TABLE_NAME, index=False)


def test_local_commands_run(tmp_path):
    work, runs = tmp_path / "work", tmp_path / "runs"
    work.mkdir()
    seed_results(runs)
    env = {**os.environ, "SMELT_RUNS_DIR": str(runs), "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg"}
    for command in commands("bash"):
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=work, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert len(list((work / "sweeps" / "smelt16" / "xpk" / "manifests").glob("*.yaml"))) == 224
    assert (work / "fits" / "smelt16" / "smelt" / "coefficients.json").exists()


# --- the image name is one name --------------------------------------------------------------------------

def test_one_image_name():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^IMAGE_NAME := {re.escape(base.IMAGE_NAME)}$", makefile, re.M)
    assert f"REGION-docker.pkg.dev/PROJECT/{base.IMAGE_REPOSITORY}/" in makefile
    assert base.CloudSettings().image == base.DEFAULT_IMAGE
    assert base.DEFAULT_IMAGE in DOC.read_text() and base.DEFAULT_IMAGE in (REPO / "Dockerfile").read_text()
    assert f"gcloud artifacts repositories create {base.IMAGE_REPOSITORY} " in " ".join(commands("bash cloud"))


def test_dockerfile_recipe():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11", text, re.M)
    assert "pip wheel --no-cache-dir --no-deps" in text and "requirements/tpu.txt" in text
    assert "-c /tmp/requirements/cpu.txt" in text
    assert re.search(r'^ENTRYPOINT \["smelt"\]$', text, re.M)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and ignore.index("*") < ignore.index("!smelt_jax/")  # an allow-list
    for needed in ("!pyproject.toml", "!setup.cfg", "!README.md", "!smelt_jax/", "!experiments/",
                   "!requirements/tpu.txt", "!requirements/cpu.txt"):
        assert needed in ignore
    for kept_out in (".venv", ".git", "data_cache", "runs", "build", "**/*.egg-info", "fits", "tests"):
        assert kept_out in ignore


def test_submit_refuses_the_placeholder_image(tmp_path, monkeypatch, capsys):
    from smelt_jax.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(base.subprocess, "run", lambda *a, **k: pytest.fail("must not submit"))
    real = ["--bucket", "gs://b/smelt", "--project", "p", "--zone", "us-east5-a", "--cluster", "c"]
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "xpk", "--submit", *real]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--image" in err and "make image push-image" in err
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "xpk", "--submit", "--image", "smelt-jax:abc",
                 *real]) == 2
    assert "local tag" in capsys.readouterr().err
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "tpu-vm", "--submit", "--image",
                 "REGION-docker.pkg.dev/p/smelt/smelt-jax:TAG", *real[:6]]) == 2
    assert "set --image before --submit" in capsys.readouterr().err


# --- make image / push-image ---------------------------------------------------------------------------

def path_without(tmp_path: Path, *tools: str) -> str:
    """A PATH of one folder linking every program on this PATH except `tools`. Dropping whole PATH folders
    instead would drop make, git and the shell's tools with them where docker shares their folder (e.g.
    docker.io from Debian in /usr/bin)."""
    shim = tmp_path / "path"
    shim.mkdir()
    for folder in reversed([d for d in os.environ["PATH"].split(os.pathsep) if d and Path(d).is_dir()]):
        for program in Path(folder).iterdir():  # reversed: the first folder on PATH wins, as in a lookup
            if program.name not in tools and os.access(program, os.X_OK) and not program.is_dir():
                (shim / program.name).unlink(missing_ok=True)
                (shim / program.name).symlink_to(program)
    assert not any(shutil.which(t, path=str(shim)) for t in tools)
    return str(shim)


def make(target: list[str], path: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("IMAGE", "CONTAINER_TOOL", "MAKEFLAGS")}
    return subprocess.run([shutil.which("make"), "-s", *target], cwd=REPO, env={**clean, "PATH": path, **env},
                          capture_output=True, text=True, timeout=60)


def fake_tool(tmp_path: Path, info_rc: int) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "docker"
    tool.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls"\n[ "$1" = info ] && exit {info_rc}\n'
                    '[ "$1" = image ] && exit 1\nexit 0\n')
    tool.chmod(0o755)
    return bin_dir


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_image_without_a_container_tool(tmp_path):
    proc = make(["image"], path_without(tmp_path, "docker", "podman"))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no container tool found" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not proc.stdout.strip()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_image_with_an_unreachable_daemon(tmp_path):
    bin_dir = fake_tool(tmp_path, info_rc=1)
    proc = make(["image"], f"{bin_dir}{os.pathsep}{path_without(tmp_path, 'docker', 'podman')}")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach its daemon" in lines[0], proc.stderr
    assert "build" not in (tmp_path / "calls").read_text()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_image_and_push_with_a_tool(tmp_path):
    bin_dir = fake_tool(tmp_path, info_rc=0)
    path = f"{bin_dir}{os.pathsep}{path_without(tmp_path, 'docker', 'podman')}"
    proc = make(["image"], path)
    assert proc.returncode == 0, proc.stderr
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip() or "dev"
    assert f"build --build-arg GIT_COMMIT={sha} -t {base.IMAGE_NAME}:{sha} ." in (tmp_path / "calls").read_text()
    for image, message in (("smelt-jax:abc", "is a local tag"), (base.DEFAULT_IMAGE, "still has placeholders")):
        proc = make(["push-image", f"IMAGE={image}"], path)
        assert proc.returncode != 0 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    image = "us-east5-docker.pkg.dev/my-proj/smelt/smelt-jax:abc"
    proc = make(["push-image", f"IMAGE={image}"], path)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text()
    assert f"tag {base.IMAGE_NAME}:{sha} {image}" in calls and f"push {image}" in calls


def test_cluster_per_slice_type():
    """`--cluster v5p-128=A,v5p-512=B` (the quick start's two xpk clusters) or one name for every job."""
    from smelt_jax.sweep.xpk import cluster_for
    settings = base.CloudSettings(cluster="v5p-128=a, v5p-512=b")
    assert (cluster_for(settings, "v5p-128"), cluster_for(settings, "v5p-512")) == ("a", "b")
    assert cluster_for(base.CloudSettings(cluster="one"), "v5p-512") == "one"
    with pytest.raises(ValueError, match="names no cluster for v5p-8"):
        cluster_for(settings, "v5p-8")
    with pytest.raises(ValueError, match="TPU_TYPE=NAME"):
        cluster_for(base.CloudSettings(cluster="v5p-128=a,b"), "v5p-128")

"""Issue 53, item 5: submission. `--submit` treats `--runs-dir gs://BUCKET/...` and the docs' metavars
(`--queue NAME`, `--reservation NAME`) as placeholders, refused in one line before anything is written;
every value pasted into a generated script is one shell word. The scripts are run (tpu-vm job script,
its launch line, submit.sh, the cancel commands) against recording stand-ins of `gcloud` and `xpk` with
hostile values (a space, `;`, `$(...)`, quotes, backticks, a newline, a backslash) in every field: each
value must reach the tool as exactly one argument, unchanged, and no injected command may run."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import load_suite
from smelt_jax.cli import main
from smelt_jax.sweep import base
from smelt_jax.sweep.base import CloudSettings, is_placeholder
from smelt_jax.sweep.graph import build_graph
from smelt_jax.sweep.tpu_vm import TpuVmBackend, job_script
from smelt_jax.sweep.xpk import XpkBackend, xpk_command

H = "a b;c $(touch PWNED1) `touch PWNED2` 'q' \"d\" \\ x\ny & touch PWNED3 #"
REAL = {"image": "us-docker.pkg.dev/p/smelt/smelt-jax:abc", "bucket": "gs://b/smelt", "project": "p",
        "zone": "us-east5-a", "cluster": "c"}

# A stand-in for gcloud / xpk: records its argv (JSON lines in $TOOL_LOG) and plays a queued resource
# whose state lives in $SLICE_STATE (absent: describe answers NOT_FOUND).
STUB = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["TOOL_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *args]) + "\\n")
state = os.environ.get("SLICE_STATE", "/nonexistent")
if "describe" in args:
    if os.path.exists(state):
        print(open(state).read().strip()); sys.exit(0)
    print("ERROR: NOT_FOUND", file=sys.stderr); sys.exit(1)
if "create" in args and "queued-resources" in args:
    open(state, "w").write("ACTIVE")
if "delete" in args and "queued-resources" in args:
    if os.environ.get("DELETE_RC", "0") != "0":
        sys.exit(int(os.environ["DELETE_RC"]))
    if os.path.exists(state):
        os.remove(state)
if "ssh" in args:
    sys.exit(int(os.environ.get("SSH_RC", "0")))
"""


def hostile_settings(out_dir: Path, **extra) -> CloudSettings:
    values = {"image": f"reg.example/{H}", "bucket": f"gs://{H}", "project": H, "zone": H, "cluster": H,
              "queue": H, "data_dir": f"gs://{H}/data", "capacity": "reserved", "reservation": H,
              "out_dir": out_dir, **extra}
    return CloudSettings(**values)


def one_job():
    run = next(r for r in load_suite("smelt16") if (r.scale, r.sparsity_label, r.arch) == ("100m", "s0", "baseline"))
    graph = build_graph([run])
    return graph, graph.jobs[0]


@pytest.fixture
def tools(tmp_path) -> dict:
    """PATH with recording `gcloud` and `xpk`; the log of their calls; cwd-free environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("gcloud", "xpk"):
        (bin_dir / tool).write_text(STUB)
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TOOL_LOG": str(log),
           "SLICE_STATE": str(tmp_path / "slice.state"), "SMELT_POLL_SECONDS": "0",
           "SMELT_DESCRIBE_RETRY_SECONDS": "0"}
    return {"env": env, "log": log, "state": tmp_path / "slice.state", "cwd": tmp_path}


def calls(tools) -> list[list[str]]:
    if not tools["log"].exists():
        return []
    return [json.loads(line) for line in tools["log"].read_text().splitlines()]


def no_injection(tools) -> None:
    assert not list(Path(tools["cwd"]).rglob("PWNED*")), "a pasted value ran as a command"


def bash_n(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def check_worker_command(command: str, settings: CloudSettings) -> None:
    """The command every host runs (`--command=`), as the remote shell splits it."""
    words = shlex.split(command)
    assert words[:6] == ["sudo", "gcloud", "auth", "configure-docker", "reg.example", "--quiet"]
    docker = words[words.index("&&") + 1:]
    assert f"SMELT_RUNS_DIR={settings.runs_dir}" in docker and settings.image in docker
    assert docker[docker.index("--data-dir") + 1] == settings.data_dir


@pytest.mark.parametrize("ssh_rc, delete_rc", [(0, 0), (1, 0), (1, 1)])
def test_tpu_vm_job_script_passes_every_hostile_value_as_one_argument(tools, ssh_rc, delete_rc):
    settings = hostile_settings(tools["cwd"] / "out")
    graph, job = one_job()
    script = tools["cwd"] / "job.sh"
    script.write_text(job_script(graph, job, settings))
    bash_n(script)
    env = {**tools["env"], "SSH_RC": str(ssh_rc), "DELETE_RC": str(delete_rc)}
    result = subprocess.run(["bash", str(script)], cwd=tools["cwd"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == ssh_rc, result.stderr
    made = calls(tools)
    verbs = [next(v for v in ("describe", "create", "ssh", "delete") if v in c) for c in made]
    assert "create" in verbs and "ssh" in verbs and "delete" in verbs  # delete: done, or the EXIT trap's
    for call in made:
        assert f"--project={H}" in call and f"--zone={H}" in call, call
        assert job.name in call
    create = made[verbs.index("create")]
    assert f"--reservation={H}" in create
    ssh = made[verbs.index("ssh")]
    check_worker_command(next(a for a in ssh if a.startswith("--command="))[len("--command="):], settings)
    if delete_rc:  # the line telling how to delete by hand is a command that can be pasted as it is
        hint = result.stderr.split("delete it by hand: ", 1)[1].rsplit("\n", 1)[0]
        assert shlex.split(hint) == ["gcloud", "compute", "tpus", "queued-resources", "delete", job.name,
                                     f"--project={H}", f"--zone={H}", "--force"]
    no_injection(tools)


def test_tpu_vm_launch_line_submit_script_and_cancel_keep_hostile_paths_whole(tools):
    out = tools["cwd"] / f"out {H}".replace("/", "_")
    settings = hostile_settings(out)
    graph, job = one_job()
    backend = TpuVmBackend(settings)
    planned = backend.plan(graph)
    script = base.write_plan(planned, out, f"suite {H}")
    bash_n(script)
    (launch,) = planned[0].commands
    subprocess.run(["bash", "-c", launch], cwd=tools["cwd"], env=tools["env"], check=True, timeout=30)
    log = out / "logs" / f"{job.name}.log"
    for _ in range(300):
        if log.exists() and "done" in log.read_text():
            break
        time.sleep(0.1)
    assert "done" in log.read_text() and (out / "logs" / f"{job.name}.pid").exists()
    tools["state"].write_text("ACTIVE")  # a slice left up: cancel deletes it, with the exact values
    before = len(calls(tools))
    for command in backend.cancel(graph):
        subprocess.run(command, shell=True, cwd=tools["cwd"], env=tools["env"], check=True, timeout=30)
    deletes = [c for c in calls(tools)[before:] if "delete" in c]
    assert deletes == [["gcloud", "compute", "tpus", "queued-resources", "delete", job.name,
                        f"--project={H}", f"--zone={H}", "--force", "--quiet"]]
    no_injection(tools)


def test_xpk_commands_and_submit_script_pass_every_hostile_value_as_one_argument(tools):
    out = tools["cwd"] / "out"
    settings = hostile_settings(out)
    graph, job = one_job()
    backend = XpkBackend(settings)
    script = base.write_plan(backend.plan(graph), out, f"suite {H}")
    bash_n(script)
    subprocess.run(["bash", str(script)], cwd=tools["cwd"], env=tools["env"], check=True, timeout=30)
    made = calls(tools)
    assert made == [shlex.split(xpk_command(graph, j, settings)) for j in graph.jobs]
    create = made[0]
    for value in (f"--cluster={H}", f"--project={H}", f"--zone={H}", f"--docker-image={settings.image}",
                  f"--env=SMELT_RUNS_DIR={settings.runs_dir}", f"--env=SMELT_XLA_CACHE=gs://{H}/xla"):
        assert value in create
    trainer = shlex.split(next(a for a in create if a.startswith("--command="))[len("--command="):])
    assert trainer[:3] == ["python", "-m", "smelt_jax"] and trainer[trainer.index("--data-dir") + 1] == settings.data_dir
    for command in backend.cancel(graph):
        subprocess.run(command, shell=True, cwd=tools["cwd"], env=tools["env"], check=True, timeout=30)
    assert calls(tools)[len(made):] == [["xpk", "workload", "delete", f"--cluster={H}", f"--project={H}",
                                         f"--zone={H}", f"--workload={j.name}"] for j in graph.jobs]
    no_injection(tools)


def test_a_hostile_value_cannot_end_a_comment_line():
    graph, job = one_job()
    text = job_script(graph, job, hostile_settings(Path("out"), bucket="gs://b\ntouch PWNED #"))
    assert "\n# Checkpoints and results: gs://b\\ntouch PWNED #/runs\n" in text  # the break escaped


@pytest.mark.parametrize("value", ["NAME", "PATH", "gs://BUCKET/smelt/runs"])
def test_the_docs_metavars_and_the_quick_starts_runs_dir_are_placeholders(value):
    assert is_placeholder(value)


@pytest.mark.parametrize("backend, flags, named", [
    ("xpk", ["--runs-dir", "gs://BUCKET/smelt/runs"], "--runs-dir"),
    ("tpu-vm", ["--runs-dir", "gs://BUCKET/smelt/runs"], "--runs-dir"),
    ("xpk", ["--queue", "NAME"], "--queue"),
    ("xpk", ["--capacity", "reserved", "--reservation", "NAME"], "--reservation"),
    ("tpu-vm", ["--capacity", "reserved", "--reservation", "NAME"], "--reservation"),
])
def test_submit_refuses_the_placeholders_before_writing(tmp_path, monkeypatch, capsys, backend, flags, named):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(base.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(base.subprocess, "run", lambda *a, **k: pytest.fail("must not submit"))
    real = [x for k, v in REAL.items() for x in (f"--{k}", v)]
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", backend, "--submit", *real, *flags,
                 "--out", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "placeholder" in err, err
    assert not (tmp_path / "plan").exists()  # refused before any job file is written
    settings = CloudSettings(**REAL)
    assert dataclasses.replace(settings, queue="multislice-queue").submit_problem(tuple(REAL)) is None

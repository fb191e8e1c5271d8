"""Cloud rendering: golden xpk / JobSet / tpu-vm output, schema validation of every smelt16 manifest,
dry run by default, and the tpu-vm retry loop run against a fake `gcloud`.

Regenerate the golden files after an intended change with `SMELT_UPDATE_GOLDEN=1 pytest tests/test_sweep_render.py`.
"""

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from experiments import load_suite
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.sweep import base
from smelt_jax.sweep.base import CloudSettings
from smelt_jax.sweep.graph import JobStatus, build_graph, suite_graph
from smelt_jax.sweep.schema import jobset_schema, validation_errors
from smelt_jax.sweep.tpu_vm import TpuVmBackend, job_script
from smelt_jax.sweep.xpk import (
    XpkBackend,
    jobset_manifest,
    render_manifest,
    xpk_command,
)

GOLDEN = Path(__file__).parent / "golden" / "sweep"
SETTINGS = CloudSettings(image="us-docker.pkg.dev/smelt-proj/smelt/smelt-jax:golden",
                         bucket="gs://smelt-bucket/smelt", project="smelt-proj", zone="us-east5-a",
                         cluster="smelt-v5p", max_restarts=20, out_dir=Path("out"),
                         data_dir="gs://smelt-bucket/smelt/data/smelt16")


def golden_jobs():
    """A stable job at 100m, the last branch at 1.6b, and a branch whose run names its TPU type."""
    runs = load_suite("smelt16")
    small = next(r for r in runs if (r.scale, r.sparsity_label, r.arch) == ("100m", "s0", "baseline"))
    large = next(r for r in runs if (r.scale, r.sparsity_label, r.arch) == ("1.6b", "s97", "smelt"))
    pinned = dataclasses.replace(next(r for r in runs if r.scale == "600m" and r.arch == "smelt"),
                                 parallelism=Parallelism(fsdp=4, tpu_type="v6e-16"))
    graph = build_graph([small, large, pinned])
    by_run = {}
    for job in graph.jobs:
        by_run.setdefault(job.run.id, []).append(job)
    return graph, [by_run[small.id][0], by_run[large.id][-1], by_run[pinned.id][1]]


def check_golden(relative: str, text: str) -> None:
    path = GOLDEN / relative
    if os.environ.get("SMELT_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with SMELT_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{relative} differs from its golden file"


def test_golden_xpk_and_jobset():
    graph, jobs = golden_jobs()
    for job in jobs:
        check_golden(f"xpk/{job.name}.cmd", xpk_command(graph, job, SETTINGS) + "\n")
        check_golden(f"xpk/{job.name}.yaml", render_manifest(jobset_manifest(graph, job, SETTINGS)))


def test_golden_tpu_vm():
    graph, jobs = golden_jobs()
    planned = {p.name: p for p in TpuVmBackend(SETTINGS).plan(graph)}
    for job in jobs:
        check_golden(f"tpu_vm/{job.name}.sh", job_script(graph, job, SETTINGS))
        check_golden(f"tpu_vm/{job.name}.cmd", "\n".join(planned[job.name].commands) + "\n")


def test_rendering_is_deterministic():
    graph, jobs = golden_jobs()
    again, _ = golden_jobs()
    assert [render_manifest(jobset_manifest(graph, j, SETTINGS)) for j in jobs] == \
        [render_manifest(jobset_manifest(again, j, SETTINGS)) for j in jobs]


def test_manifest_semantics():
    """What the golden files should say, checked field by field."""
    graph, (stable, branch, pinned) = golden_jobs()
    m = jobset_manifest(graph, branch, SETTINGS)
    job_spec = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job_spec["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "smelt_jax", "train", branch.run.id, "--branch", "5",
                                    "--data-dir", SETTINGS.data_dir,
                                    "--layout", "data=4,fsdp=8,expert=8,tensor=1", "--remat", "none",
                                    "--checkpoint-every", "5694"]
    # ...the layout and remat its compile report chose (issue 50's program: the ring exchange, layers
    # unrolled and the 'async' collectives, which the trainer takes from the run's layout, at remat none),
    # and the save interval of experiments/checkpoint_cadence.json (30 min at its >= 0.316 s step)
    assert branch.run.parallelism.remat == "none" and branch.run.parallelism.exchange == "ring"
    assert {"name": "SMELT_RUNS_DIR", "value": "gs://smelt-bucket/smelt/runs"} in container["env"]
    # 1.6b S97 SMELT runs on the slice its compile report chose (experiments/layouts.json): v5p-512
    assert branch.run.parallelism.tpu_type == "v5p-512"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x8x8"
    assert job_spec["parallelism"] == job_spec["completions"] == 64  # 256 chips / 4 per host
    assert job_spec["backoffLimit"] == 0
    exit_rule = job_spec["podFailurePolicy"]["rules"][0]
    assert exit_rule["action"] == "FailJob" and exit_rule["onExitCodes"]["values"] == [42]
    restart, fail = m["spec"]["failurePolicy"]["rules"]
    assert restart["action"] == "RestartJobSet" and restart["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert fail["action"] == "FailJobSet"
    assert m["spec"]["failurePolicy"]["maxRestarts"] == 20
    assert m["metadata"]["annotations"]["smelt-jax/checkpoints"].endswith(f"{branch.run.id}/branch5/checkpoints")
    pinned_pod = jobset_manifest(graph, pinned, SETTINGS)["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert pinned_pod["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert "--tpu-type=v6e-16" in xpk_command(graph, pinned, SETTINGS)
    assert f"--tpu-type={stable.run.parallelism.tpu_type}" in xpk_command(graph, stable, SETTINGS)


def test_every_smelt16_manifest_validates():
    graph = suite_graph("smelt16")
    assert len(graph.jobs) == 224
    errors = {job.name: validation_errors(jobset_manifest(graph, job, SETTINGS)) for job in graph.jobs}
    assert {name: e for name, e in errors.items() if e} == {}
    names = [yaml.safe_load(render_manifest(jobset_manifest(graph, j, SETTINGS)))["metadata"]["name"]
             for j in graph.jobs]
    assert len(set(names)) == 224


@pytest.mark.parametrize("corrupt, expected", [
    (lambda m: m["spec"]["failurePolicy"].update(maxRestart=3), "maxRestart"),  # misspelt field
    (lambda m: m["spec"]["failurePolicy"]["rules"][0].update(action="Restart"), "Restart"),  # bad enum
    (lambda m: m["spec"]["failurePolicy"]["rules"][0].pop("name"), "name"),  # required field
    (lambda m: m["spec"]["replicatedJobs"][0].update(replicas="1"), "replicas"),  # wrong type
])
def test_schema_rejects_bad_manifests(corrupt, expected):
    graph, jobs = golden_jobs()
    manifest = jobset_manifest(graph, jobs[0], SETTINGS)
    assert validation_errors(manifest) == []
    corrupt(manifest)
    errors = validation_errors(manifest)
    assert errors and expected in "\n".join(errors)


def test_missing_crd_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="reference_data/jobset"):
        jobset_schema(tmp_path / "nope.yaml")


def test_dry_run_writes_and_prints_but_runs_nothing(tmp_path, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("a dry run must not run commands")
    monkeypatch.setattr(base.subprocess, "run", forbidden)
    graph = suite_graph("smoke")
    for backend, pattern in ((XpkBackend, "manifests/*.yaml"), (TpuVmBackend, "jobs/*.sh")):
        out = tmp_path / backend.name
        assert backend(dataclasses.replace(SETTINGS, out_dir=out)).submit(graph) == 0
        assert len(list(out.glob(pattern))) == len(graph.jobs)
        script = (out / "submit.sh").read_text()
        assert all(job.name in script for job in graph.jobs)
    printed = capsys.readouterr().out
    assert "xpk workload create" in printed and "nohup bash" in printed and "dry run" in printed


def test_submit_needs_the_tool_and_real_settings(tmp_path, monkeypatch):
    graph = build_graph(load_suite("smoke")[:1])
    monkeypatch.setattr(base.shutil, "which", lambda tool: None)
    with pytest.raises(RuntimeError, match="`xpk` is not installed"):
        XpkBackend(dataclasses.replace(SETTINGS, out_dir=tmp_path)).submit(graph, execute=True)
    with pytest.raises(RuntimeError, match="`gcloud` is not installed"):
        TpuVmBackend(dataclasses.replace(SETTINGS, out_dir=tmp_path)).submit(graph, execute=True)
    monkeypatch.setattr(base.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    with pytest.raises(ValueError, match="--image, --bucket"):
        XpkBackend(CloudSettings(out_dir=tmp_path)).submit(graph, execute=True)


def test_submit_sends_only_ready_jobs(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(base.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(base.subprocess, "run",
                        lambda cmd, **kw: sent.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    graph = build_graph(load_suite("smoke")[:2])
    settings = dataclasses.replace(SETTINGS, out_dir=tmp_path / "out", root=tmp_path / "runs")
    assert XpkBackend(settings).submit(graph, execute=True) == 0
    stable = [job.name for job in graph.jobs if job.is_stable]
    assert [c.split("--workload=")[1].split()[0] for c in sent] == stable  # branches wait: pending
    statuses = XpkBackend(settings).status(graph)
    assert {statuses[n] for n in stable} == {JobStatus.READY}


FAKE_GCLOUD = """#!/usr/bin/env bash
# Fake gcloud: one queued resource; `ssh` follows the outcomes listed in $D/outcomes, one per call.
D="$FAKE_GCLOUD_DIR"
echo "$*" >> "$D/calls"
case "$*" in
  *"queued-resources describe"*)
    failures=$(cat "$D/describe_failures" 2>/dev/null || echo 0)  # transient errors still to give
    if [ "$failures" -gt 0 ]; then
      echo $((failures - 1)) > "$D/describe_failures"
      echo "ERROR: (gcloud.compute.tpus.queued-resources.describe) UNAVAILABLE: try again" >&2; exit 1
    fi
    [ -f "$D/slice" ] && echo ACTIVE && exit 0
    echo "ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND: Resource was not found" >&2; exit 1 ;;
  *"queued-resources create"*) touch "$D/slice" ;;
  *"queued-resources delete"*) rm -f "$D/slice" ;;
  *"tpu-vm ssh"*)
    outcome=$(head -n1 "$D/outcomes"); sed -i 1d "$D/outcomes"
    case "$outcome" in
      preempt) rm -f "$D/slice"; exit 255 ;;
      hang) echo $$ > "$D/ssh.pid"; exec sleep 60 ;;
      *) exit "$outcome" ;;
    esac ;;
esac
"""


def fake_gcloud_env(tmp_path, outcomes):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    (state / "outcomes").write_text("\n".join(outcomes) + "\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GCLOUD_DIR": str(state),
           "SMELT_POLL_SECONDS": "0", "SMELT_DESCRIBE_RETRY_SECONDS": "0"}
    return env, state


def run_script_with_fake_gcloud(tmp_path, outcomes, settings=SETTINGS):
    graph, jobs = golden_jobs()
    env, state = fake_gcloud_env(tmp_path, outcomes)
    script = tmp_path / "job.sh"
    script.write_text(job_script(graph, jobs[1], settings))
    proc = subprocess.run(["bash", str(script)], check=False, env=env, capture_output=True, text=True, timeout=60)
    calls = (state / "calls").read_text().splitlines()
    return proc, calls, (state / "slice").exists()


def test_tpu_vm_loop_retries_preemption_and_exit_42(tmp_path):
    proc, calls, slice_left = run_script_with_fake_gcloud(tmp_path, ["preempt", "42", "0"])
    assert proc.returncode == 0, proc.stderr
    assert sum("queued-resources create" in c for c in calls) == 2  # recreated after preemption
    assert sum("tpu-vm ssh" in c for c in calls) == 3
    assert not slice_left  # deleted once done


def test_tpu_vm_loop_stops_on_a_real_failure(tmp_path):
    proc, calls, _ = run_script_with_fake_gcloud(tmp_path, ["3", "0"])
    assert proc.returncode == 3
    assert sum("tpu-vm ssh" in c for c in calls) == 1
    assert "not retrying" in proc.stderr


@pytest.mark.integration
def test_tpu_vm_script_deletes_the_slice_when_the_trainer_fails(tmp_path):
    """Issue 26 D: a trainer failure on a healthy slice used to exit with the slice still up."""
    proc, calls, slice_left = run_script_with_fake_gcloud(tmp_path, ["3"])
    assert proc.returncode == 3
    assert not slice_left, "the slice stays up (and billed) after a trainer failure"
    assert sum("queued-resources delete" in c for c in calls) == 1
    assert "deleting the slice (exit 3)" in proc.stderr


@pytest.mark.integration
def test_tpu_vm_script_deletes_the_slice_when_it_gives_up(tmp_path):
    settings = dataclasses.replace(SETTINGS, max_restarts=1)
    proc, calls, slice_left = run_script_with_fake_gcloud(tmp_path, ["42", "42"], settings)
    assert proc.returncode == 1 and "giving up after 1 restarts" in proc.stderr
    assert sum("tpu-vm ssh" in c for c in calls) == 2
    assert not slice_left


def _default_signals() -> None:
    import signal
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.integration
@pytest.mark.parametrize("sig, code", [("TERM", 143), ("INT", 130), ("HUP", 129)])
def test_tpu_vm_script_deletes_the_slice_when_killed(tmp_path, sig, code):
    """`smelt sweep cancel` (SIGTERM), Ctrl-C, or the hang-up of the terminal a script was started from
    by hand: the trap stops the ssh and deletes the slice at once."""
    import signal
    import time
    graph, jobs = golden_jobs()
    env, state = fake_gcloud_env(tmp_path, ["hang"])
    script = tmp_path / "job.sh"
    script.write_text(job_script(graph, jobs[1], SETTINGS))
    # Default dispositions in the script, whatever this test runner inherited: bash cannot trap a signal
    # ignored on entry, and runners started under nohup (CI's, for one) ignore SIGHUP.
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    deadline = time.monotonic() + 30
    while not (state / "ssh.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (state / "slice").exists()
    started = time.monotonic()
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 20  # not after the 60 s ssh
    assert proc.returncode == code, err
    assert not (state / "slice").exists()
    ssh_pid = int((state / "ssh.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(ssh_pid, 0)


@pytest.mark.integration
@pytest.mark.parametrize("capacity, reservation, expected", [
    ("spot", "", "gcloud compute tpus queued-resources create"),
    ("on-demand", "", "gcloud compute tpus queued-resources create"),
    ("reserved", "", "gcloud compute tpus queued-resources create"),
    ("reserved", "my-res", "gcloud alpha compute tpus queued-resources create"),
])
def test_tpu_vm_capacity_flags(tmp_path, capacity, reservation, expected):
    settings = dataclasses.replace(SETTINGS, capacity=capacity, reservation=reservation)
    proc, calls, slice_left = run_script_with_fake_gcloud(tmp_path, ["0"], settings)
    assert proc.returncode == 0, proc.stderr
    (create,) = [c for c in calls if "queued-resources create" in c]
    flags = set(create.split())
    assert ("--spot" in flags) == (capacity == "spot")
    assert ("--reserved" in flags) == (capacity == "reserved" and not reservation)
    assert ("--reservation=my-res" in flags) == bool(reservation)
    assert f"gcloud {create}".startswith(expected)
    assert not slice_left


def test_capacity_and_queue_settings_are_checked():
    with pytest.raises(ValueError, match="--capacity must be one of spot, on-demand, reserved"):
        dataclasses.replace(SETTINGS, capacity="preemptible")
    with pytest.raises(ValueError, match="needs --capacity reserved"):
        dataclasses.replace(SETTINGS, reservation="my-res")
    with pytest.raises(ValueError, match="--queue"):
        dataclasses.replace(SETTINGS, queue=" ")


@pytest.mark.parametrize("capacity, reservation, selector", [
    ("spot", "", {"cloud.google.com/gke-spot": "true"}),
    ("on-demand", "", {}),
    ("reserved", "", {}),
    ("reserved", "my-res", {"cloud.google.com/reservation-name": "my-res"}),
])
def test_xpk_manifest_queue_and_capacity(capacity, reservation, selector):
    graph, jobs = golden_jobs()
    settings = dataclasses.replace(SETTINGS, capacity=capacity, reservation=reservation, queue="team-a")
    m = jobset_manifest(graph, jobs[0], settings)
    assert validation_errors(m) == []
    assert m["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    node_selector = m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelector"]
    assert {k: v for k, v in node_selector.items() if "tpu" not in k} == selector


def test_sweep_cli_passes_capacity_and_queue(tmp_path, capsys):
    from smelt_jax.cli import main
    out = tmp_path / "out"
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "tpu-vm", "--out", str(out),
                 "--capacity", "on-demand"]) == 0
    script = next((out / "jobs").glob("*.sh")).read_text()
    assert "queued-resources create" in script and "--spot" not in script
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "xpk", "--out", str(out),
                 "--queue", "team-a", "--capacity", "reserved", "--reservation", "r1"]) == 0
    manifest = yaml.safe_load(next((out / "manifests").glob("*.yaml")).read_text())
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "cloud.google.com/reservation-name: r1" in next((out / "manifests").glob("*.yaml")).read_text()
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "xpk", "--out", str(out),
                 "--reservation", "r1"]) == 2
    assert "needs --capacity reserved" in capsys.readouterr().err


def test_tpu_vm_refuses_queue_in_one_line(tmp_path, capsys):
    """Before: --queue was accepted and ignored by tpu-vm (it has queued resources, not a named queue)."""
    from smelt_jax.cli import main
    out = tmp_path / "out"
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", "tpu-vm", "--out", str(out),
                 "--queue", "team-a"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--queue names the Kueue LocalQueue of the xpk backend" in err
    assert not out.exists()


@pytest.mark.integration
def test_tpu_vm_cancel_waits_for_the_trap_then_deletes_what_is_left(tmp_path):
    """cancel kills the running loop and waits for it (its trap deletes the slice), so the cancel's
    own delete does not race it; with no loop running it deletes the slice itself."""
    import time
    graph, jobs = golden_jobs()
    out = tmp_path / "out"
    settings = dataclasses.replace(SETTINGS, out_dir=out)
    backend = TpuVmBackend(settings)
    env, state = fake_gcloud_env(tmp_path, ["hang"])
    (out / "logs").mkdir(parents=True)
    script = tmp_path / "job.sh"
    script.write_text(job_script(graph, jobs[1], settings))
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    (out / "logs" / f"{jobs[1].name}.pid").write_text(f"{proc.pid}\n")
    import threading
    reaper = threading.Thread(target=proc.wait)  # reaps it at once, as init reaps a nohup job
    reaper.start()
    deadline = time.monotonic() + 30
    while not (state / "ssh.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (command,) = backend.cancel(graph, [jobs[1].name])
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reaper.join(timeout=10)
    assert proc.returncode == 143
    calls = (state / "calls").read_text().splitlines()
    assert sum("queued-resources delete" in c for c in calls) == 1  # the trap's; cancel saw it gone
    assert not (state / "slice").exists()
    (state / "slice").touch()  # a slice without a loop: cancel deletes it
    assert subprocess.run(["bash", "-c", command], env=env, timeout=60).returncode == 0
    assert not (state / "slice").exists()


def test_tpu_vm_transient_describe_errors_are_retried_not_read_as_gone(tmp_path):
    """Before: any describe error read as "slice gone": a second slice created, or the delete skipped."""
    graph, jobs = golden_jobs()
    env, state = fake_gcloud_env(tmp_path, ["0"])
    (state / "describe_failures").write_text("3\n")  # under DESCRIBE_TRIES
    script = tmp_path / "job.sh"
    script.write_text(job_script(graph, jobs[1], SETTINGS))
    (state / "slice").touch()  # an ACTIVE slice of an earlier attempt
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    calls = (state / "calls").read_text().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert not any("queued-resources create" in c for c in calls)  # the retried describe found it
    assert not (state / "slice").exists()


def test_tpu_vm_cleanup_never_reads_a_failing_describe_as_gone(tmp_path):
    """describe failing every time (not NOT_FOUND): cancel still deletes, and says the slice may be billed
    when the delete fails too."""
    graph, jobs = golden_jobs()
    out = tmp_path / "out"
    backend = TpuVmBackend(dataclasses.replace(SETTINGS, out_dir=out))
    env, state = fake_gcloud_env(tmp_path, [])
    (state / "describe_failures").write_text("100\n")
    (state / "slice").touch()
    (command,) = backend.cancel(graph, [jobs[1].name])
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "gcloud describe failed 5 times" in done.stderr and "may still be up and billed" in done.stderr
    assert not (state / "slice").exists()  # deleted although its state could not be read
    (bin_dir := tmp_path / "bin" / "gcloud").write_text(bin_dir.read_text().replace(
        '*"queued-resources delete"*) rm -f "$D/slice" ;;', '*"queued-resources delete"*) exit 1 ;;'))
    (state / "describe_failures").write_text("100\n")
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"{jobs[1].name}: could not delete the slice; it may still be up and billed" in done.stderr

"""The `tpu-vm` backend: TPU VMs without GKE, through `gcloud compute tpus`.

Per job one script, `jobs/<name>.sh`, that owns a queued resource (a slice: spot by default,
`--capacity on-demand|reserved` otherwise) named after the job and loops until the trainer exits 0:

    slice missing            -> `gcloud compute tpus queued-resources create`
    slice FAILED / SUSPENDED -> (preempted) delete it and create it again
    slice ACTIVE             -> `gcloud compute tpus tpu-vm ssh --worker=all --command '<docker run trainer>'`
    trainer exit 0           -> done: delete the slice
    exit 42, or the slice went away under it -> retry (at most max_restarts times)
    any other exit on a healthy slice        -> stop with that exit code

A slice counts as gone only when `gcloud ... describe` answers NOT_FOUND. Any other failure of describe
(network, quota, auth) is retried DESCRIBE_TRIES times, then the state is UNKNOWN: the script neither
creates a second slice nor skips the delete, and says the slice may still be billed.

Whatever way the script ends (done, a trainer failure, giving up, an error of its own, SIGTERM as
`smelt sweep cancel` sends, SIGINT, SIGHUP of a terminal it was started from by hand), a bash EXIT trap
stops the ssh and deletes the slice, so that no exit path leaves a slice up and billed.

`submit.sh` starts every READY job's script in the background (`nohup`), logging to `logs/<name>.log`:
such a script ignores SIGHUP (bash cannot trap a signal ignored on entry), so logging out does not stop
the sweep; `smelt sweep cancel` sends SIGTERM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from smelt_jax.sweep.base import (
    CloudSettings,
    PlannedJob,
    check_submittable,
    cloud_status,
    comment,
    execute_ready,
    print_commands,
    quote,
    trainer_command,
    word,
    write_plan,
)
from smelt_jax.sweep.graph import Job, JobGraph, JobStatus
from smelt_jax.sweep.tpu import tpu_slice, tpu_type_for

GCLOUD_HINT = "install the Google Cloud CLI (cloud.google.com/sdk)"

from smelt_jax.platform.exit_codes import PREEMPTED as RESTART_EXIT_CODE
POLL_SECONDS = 60
DESCRIBE_TRIES = 5  # describe failures other than NOT_FOUND before a slice's state is UNKNOWN
DESCRIBE_RETRY_SECONDS = 10


def where_flags(settings: CloudSettings) -> str:
    """`--project=P --zone=Z`, each one shell word whatever the values hold."""
    return quote([f"--project={settings.project}", f"--zone={settings.zone}"])


def slice_state_function(where: str) -> str:
    """Bash `slice_state NAME` (`where`: shell words, `where_flags`): prints the queued resource's state, MISSING only when gcloud says
    NOT_FOUND, UNKNOWN (with a line on stderr) when describe fails otherwise DESCRIBE_TRIES times."""
    return f"""slice_state() {{  # MISSING only on NOT_FOUND; UNKNOWN when describe keeps failing otherwise
  local out err tries=0
  err=$(mktemp)
  while true; do
    if out=$(gcloud compute tpus queued-resources describe "$1" {where} --format='value(state.state)' 2>"$err"); then
      rm -f "$err"; echo "${{out:-UNKNOWN}}"; return 0
    fi
    if grep -q NOT_FOUND "$err"; then
      rm -f "$err"; echo MISSING; return 0
    fi
    tries=$((tries + 1))
    if [ "$tries" -ge {DESCRIBE_TRIES} ]; then
      echo "$1: gcloud describe failed $tries times ($(tail -n1 "$err")); the slice may still be up and billed" >&2
      rm -f "$err"; echo UNKNOWN; return 0
    fi
    sleep "${{SMELT_DESCRIBE_RETRY_SECONDS:-{DESCRIBE_RETRY_SECONDS}}}"
  done
}}"""


def worker_command(job: Job, settings: CloudSettings) -> str:
    """What every host of the slice runs: the trainer in the image, with the bucket as runs root.
    The image's entrypoint is `smelt` (Dockerfile); the trainer command replaces it."""
    registry = settings.image.split("/", 1)[0]
    program, *args = trainer_command(job, settings)
    env = [flag for k, v in settings.job_env().items() for flag in ("-e", f"{k}={v}")]
    docker = ["sudo", "docker", "run", "--rm", "--privileged", "--net=host", *env,
              f"--entrypoint={program}", settings.image, *args]
    return (f"{quote(['sudo', 'gcloud', 'auth', 'configure-docker', registry, '--quiet'])} "
            f"&& {quote(docker)}")


def capacity_flags(settings: CloudSettings) -> tuple[list[str], list[str]]:
    """(gcloud release track, flags) of `queued-resources create` for the settings' capacity: spot
    `--spot`; on-demand none; reserved `--reserved` (the zone's reservation), or for a named
    reservation the alpha track's `--reservation=NAME`."""
    if settings.capacity == "spot":
        return [], ["--spot"]
    if settings.capacity == "reserved":
        if settings.reservation:
            return ["alpha"], [f"--reservation={settings.reservation}"]
        return [], ["--reserved"]
    return [], []


def job_script(graph: JobGraph, job: Job, settings: CloudSettings) -> str:
    tpu = tpu_slice(tpu_type_for(job.run))
    where = where_flags(settings)
    track, capacity = capacity_flags(settings)
    by_hand = quote(["gcloud", "compute", "tpus", "queued-resources", "delete", job.name,
                     f"--project={settings.project}", f"--zone={settings.zone}", "--force"])
    create = quote(["gcloud", *track, "compute", "tpus", "queued-resources", "create", job.name,
                    f"--node-id={job.name}", f"--project={settings.project}",
                    f"--zone={settings.zone}", f"--accelerator-type={tpu.name}",
                    f"--runtime-version={tpu.runtime_version}", *capacity])
    ssh = quote(["gcloud", "compute", "tpus", "tpu-vm", "ssh", job.name,
                 f"--project={settings.project}", f"--zone={settings.zone}", "--worker=all",
                 f"--command={worker_command(job, settings)}"])
    return f"""#!/usr/bin/env bash
# {job.name}: {job.run.id} {job.phase} on {tpu.name} ({tpu.hosts} hosts, {settings.capacity}); retries on preemption.
# Checkpoints and results: {comment(settings.runs_dir)}
# The slice is deleted on every exit (the EXIT trap below), also on a failure or a kill.
set -uo pipefail
QR={word(job.name)}
MAX_RESTARTS={word(settings.max_restarts)}
POLL_SECONDS=${{SMELT_POLL_SECONDS:-{POLL_SECONDS}}}
child=

{slice_state_function(where)}
state() {{
  slice_state "$QR"
}}

delete_slice() {{
  gcloud compute tpus queued-resources delete "$QR" {where} --force --quiet
}}

cleanup() {{  # EXIT trap: stop the ssh, delete the slice if it is still there, keep the exit code
  rc=$?
  trap - EXIT INT TERM HUP
  # the ssh by its pid, and every background job: a signal can land between `ssh &` and `child=$!`
  for pid in $child $(jobs -p); do
    kill "$pid" 2>/dev/null
  done
  wait 2>/dev/null
  if [ "$(state)" != MISSING ]; then  # UNKNOWN too: never assume a slice is gone
    echo "$QR: deleting the slice (exit $rc)" >&2
    delete_slice || echo "$QR: could not delete the slice; it may still be up and billed; delete it by" \\
      "hand:" {word(by_hand)} >&2
  fi
  exit "$rc"
}}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

ensure_active() {{  # 0 once the slice is ACTIVE, 1 if it failed or was preempted while waiting
  case "$(state)" in
    FAILED|SUSPENDED) delete_slice ;;
  esac
  if [ "$(state)" = MISSING ]; then
    {create} || return 1
  fi
  while true; do
    case "$(state)" in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDED|MISSING) return 1 ;;
    esac  # UNKNOWN (describe kept failing): not gone, ask again
    sleep "$POLL_SECONDS"
  done
}}

attempt=0
while true; do
  if ensure_active; then
    {ssh} &
    child=$!
    wait "$child"  # in the background, so that a signal reaches the trap at once
    rc=$?
    child=
    if [ "$rc" -eq 0 ]; then
      echo "$QR: done"
      delete_slice
      exit 0
    fi
    if [ "$rc" -ne {RESTART_EXIT_CODE} ] && [ "$(state)" = ACTIVE ]; then
      echo "$QR: trainer failed with exit code $rc on a healthy slice; not retrying" >&2
      exit "$rc"
    fi
    echo "$QR: interrupted or preempted (exit $rc)"
  else
    echo "$QR: slice failed or was preempted before it became ACTIVE"
  fi
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$MAX_RESTARTS" ]; then
    echo "$QR: giving up after $MAX_RESTARTS restarts" >&2
    exit 1
  fi
  sleep "$POLL_SECONDS"
done
"""


@dataclasses.dataclass(frozen=True)
class TpuVmBackend:
    settings: CloudSettings = dataclasses.field(default_factory=CloudSettings)
    name: str = "tpu-vm"

    def _out(self, *parts: str) -> str:
        return Path(self.settings.out_dir, *parts).as_posix()

    def plan(self, graph: JobGraph) -> list[PlannedJob]:
        planned = []
        for job in graph.jobs:
            script = f"jobs/{job.name}.sh"
            # the braces: `&` backgrounds the script alone (not the whole `mkdir && ...` list), so
            # the pid file is written after the folder exists and holds the script's own pid
            launch = (f"mkdir -p {word(self._out('logs'))} && {{ nohup bash {word(self._out(script))} "
                      f"> {word(self._out('logs', job.name + '.log'))} 2>&1 & "
                      f"echo $! > {word(self._out('logs', job.name + '.pid'))}; }}")
            planned.append(PlannedJob(job.name, (launch,),
                                      ((script, job_script(graph, job, self.settings)),)))
        return planned

    def submit(self, graph: JobGraph, *, execute: bool = False) -> int:
        if execute:
            check_submittable(self.settings, "gcloud", GCLOUD_HINT, graph=graph)
        planned = self.plan(graph)
        script = write_plan(planned, Path(self.settings.out_dir),
                            f"TPU VM jobs for suite {graph.suite}: each runs in the background")
        if not execute:
            print_commands(planned, script)
            return 0
        return execute_ready(planned, self.status(graph), self.settings, "gcloud", GCLOUD_HINT, graph=graph)

    def status(self, graph: JobGraph) -> dict[str, JobStatus]:
        return cloud_status(graph, self.settings)

    def cancel(self, graph: JobGraph, names: list[str] | None = None, *,
               execute: bool = False) -> list[str]:
        """Stops the retry loop first (else it would recreate the slice) and waits for it: its EXIT
        trap deletes the slice. Then deletes the slice if it is still there (no loop was running, or
        its delete failed). A slice whose state cannot be read (describe failing but not NOT_FOUND)
        is deleted too: only NOT_FOUND means gone."""
        s = self.settings
        where = [f"--project={s.project}", f"--zone={s.zone}"]
        commands = [
            f"pid=\"$(cat {word(self._out('logs', job.name + '.pid'))} 2>/dev/null)\"; "
            "if [ -n \"$pid\" ] && kill \"$pid\" 2>/dev/null; then "
            "while kill -0 \"$pid\" 2>/dev/null; do sleep 1; done; fi; "
            + slice_state_function(quote(where)) + "\n"
            + f"case \"$(slice_state {word(job.name)})\" in MISSING) ;; "
            + "*) " + quote(["gcloud", "compute", "tpus", "queued-resources", "delete", job.name, *where,
                             "--force", "--quiet"])
            + f" || {{ echo {word(job.name + ': could not delete the slice; it may still be up and billed')} >&2; exit 1; }} ;; "
            + "esac"
            for job in graph.select(names)]
        if execute:
            execute_ready([PlannedJob(f"cancel-{i}", (c,)) for i, c in enumerate(commands)],
                          {f"cancel-{i}": JobStatus.READY for i in range(len(commands))},
                          s, "gcloud", "install the Google Cloud CLI", ("project", "zone"))
        return commands

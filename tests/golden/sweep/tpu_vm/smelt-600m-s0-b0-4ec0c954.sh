#!/usr/bin/env bash
# smelt-600m-s0-b0-4ec0c954: smelt16-600m-s0-smelt-5f691c7c b0 on v6e-16 (4 hosts, spot); retries on preemption.
# Checkpoints and results: gs://smelt-bucket/smelt/runs
# The slice is deleted on every exit (the EXIT trap below), also on a failure or a kill.
set -uo pipefail
QR=smelt-600m-s0-b0-4ec0c954
MAX_RESTARTS=20
POLL_SECONDS=${SMELT_POLL_SECONDS:-60}
child=

slice_state() {  # MISSING only on NOT_FOUND; UNKNOWN when describe keeps failing otherwise
  local out err tries=0
  err=$(mktemp)
  while true; do
    if out=$(gcloud compute tpus queued-resources describe "$1" --project=smelt-proj --zone=us-east5-a --format='value(state.state)' 2>"$err"); then
      rm -f "$err"; echo "${out:-UNKNOWN}"; return 0
    fi
    if grep -q NOT_FOUND "$err"; then
      rm -f "$err"; echo MISSING; return 0
    fi
    tries=$((tries + 1))
    if [ "$tries" -ge 5 ]; then
      echo "$1: gcloud describe failed $tries times ($(tail -n1 "$err")); the slice may still be up and billed" >&2
      rm -f "$err"; echo UNKNOWN; return 0
    fi
    sleep "${SMELT_DESCRIBE_RETRY_SECONDS:-10}"
  done
}
state() {
  slice_state "$QR"
}

delete_slice() {
  gcloud compute tpus queued-resources delete "$QR" --project=smelt-proj --zone=us-east5-a --force --quiet
}

cleanup() {  # EXIT trap: stop the ssh, delete the slice if it is still there, keep the exit code
  rc=$?
  trap - EXIT INT TERM HUP
  # the ssh by its pid, and every background job: a signal can land between `ssh &` and `child=$!`
  for pid in $child $(jobs -p); do
    kill "$pid" 2>/dev/null
  done
  wait 2>/dev/null
  if [ "$(state)" != MISSING ]; then  # UNKNOWN too: never assume a slice is gone
    echo "$QR: deleting the slice (exit $rc)" >&2
    delete_slice || echo "$QR: could not delete the slice; it may still be up and billed; delete it by" \
      "hand:" 'gcloud compute tpus queued-resources delete smelt-600m-s0-b0-4ec0c954 --project=smelt-proj --zone=us-east5-a --force' >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

ensure_active() {  # 0 once the slice is ACTIVE, 1 if it failed or was preempted while waiting
  case "$(state)" in
    FAILED|SUSPENDED) delete_slice ;;
  esac
  if [ "$(state)" = MISSING ]; then
    gcloud compute tpus queued-resources create smelt-600m-s0-b0-4ec0c954 --node-id=smelt-600m-s0-b0-4ec0c954 --project=smelt-proj --zone=us-east5-a --accelerator-type=v6e-16 --runtime-version=v2-alpha-tpuv6e --spot || return 1
  fi
  while true; do
    case "$(state)" in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDED|MISSING) return 1 ;;
    esac  # UNKNOWN (describe kept failing): not gone, ask again
    sleep "$POLL_SECONDS"
  done
}

attempt=0
while true; do
  if ensure_active; then
    gcloud compute tpus tpu-vm ssh smelt-600m-s0-b0-4ec0c954 --project=smelt-proj --zone=us-east5-a --worker=all '--command=sudo gcloud auth configure-docker us-docker.pkg.dev --quiet && sudo docker run --rm --privileged --net=host -e SMELT_RUNS_DIR=gs://smelt-bucket/smelt/runs -e SMELT_XLA_CACHE=gs://smelt-bucket/smelt/xla --entrypoint=python us-docker.pkg.dev/smelt-proj/smelt/smelt-jax:golden -m smelt_jax train smelt16-600m-s0-smelt-5f691c7c --branch 0 --data-dir gs://smelt-bucket/smelt/data/smelt16 --layout data=-1,fsdp=4,expert=1,tensor=1 --remat none --checkpoint-every 4613' &
    child=$!
    wait "$child"  # in the background, so that a signal reaches the trap at once
    rc=$?
    child=
    if [ "$rc" -eq 0 ]; then
      echo "$QR: done"
      delete_slice
      exit 0
    fi
    if [ "$rc" -ne 42 ] && [ "$(state)" = ACTIVE ]; then
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

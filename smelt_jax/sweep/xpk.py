"""The `xpk` backend: TPU pods on GKE. Per job an `xpk workload create` command and the equivalent
JobSet manifest (for `kubectl apply -f`), validated against the JobSet schema.

Restart policy (both renderings): exit code 42 (the trainer saved and was interrupted) and pod
disruption (preemption, maintenance) restart the whole JobSet, up to `max_restarts` times; any other
non-zero exit fails the JobSet at once. In the manifest: the Job's podFailurePolicy turns exit 42 and
DisruptionTarget into a `PodFailurePolicy` Job failure, which the JobSet failurePolicy restarts; other
failures exhaust `backoffLimit: 0` and fail the JobSet.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from smelt_jax.sweep.base import (
    CloudSettings,
    PlannedJob,
    check_submittable,
    cloud_status,
    execute_ready,
    job_paths,
    print_commands,
    quote,
    trainer_command,
    write_plan,
)
from smelt_jax.sweep.graph import Job, JobGraph, JobStatus
from smelt_jax.sweep.schema import validate_jobset
from smelt_jax.sweep.tpu import tpu_slice, tpu_type_for
from smelt_jax.platform.errors import UsageError

XPK_HINT = "install it with `pip install xpk` (github.com/AI-Hypercomputer/xpk)"

from smelt_jax.platform.exit_codes import PREEMPTED as RESTART_EXIT_CODE
CONTAINER = "trainer"
# Settings that --submit refuses while they are placeholders (the image is base.DEFAULT_IMAGE until
# `--image` names the one `make image push-image` pushed); deleting a workload needs no image or bucket.
SUBMIT_FIELDS = ("image", "bucket", "project", "zone", "cluster")
CANCEL_FIELDS = ("project", "zone", "cluster")


def capacity_selector(settings: CloudSettings) -> dict[str, str]:
    """Node labels that pin the pods to the settings' capacity: GKE's `gke-spot` label on spot nodes,
    a named reservation's `reservation-name`; none for on-demand or the zone's reservation. (The xpk
    command cannot choose: its cluster's node pools are spot, on-demand or reserved as `xpk cluster
    create --spot|--on-demand|--reservation` made them.)"""
    if settings.capacity == "spot":
        return {"cloud.google.com/gke-spot": "true"}
    if settings.reservation:
        return {"cloud.google.com/reservation-name": settings.reservation}
    return {}


def jobset_manifest(graph: JobGraph, job: Job, settings: CloudSettings) -> dict:
    """The JobSet for one job: one replicated Job spanning the slice's hosts, one pod per host, in
    the Kueue LocalQueue `settings.queue`, on nodes of `settings.capacity`."""
    tpu = tpu_slice(tpu_type_for(job.run))
    paths = job_paths(graph, job, settings)
    pod_spec = {
        "restartPolicy": "Never",  # podFailurePolicy requires it
        "terminationGracePeriodSeconds": 300,  # SIGTERM -> the trainer saves, then exits 42
        "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
                         "cloud.google.com/gke-tpu-topology": tpu.shape,
                         **capacity_selector(settings)},
        "containers": [{
            "name": CONTAINER,
            "image": settings.image,
            "command": trainer_command(job, settings),
            "env": [*({"name": k, "value": v} for k, v in settings.job_env().items()),
                    {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "resources": {"limits": {"google.com/tpu": tpu.chips_per_host},
                          "requests": {"google.com/tpu": tpu.chips_per_host}},
        }],
    }
    job_spec = {
        "parallelism": tpu.hosts, "completions": tpu.hosts, "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": [RESTART_EXIT_CODE]}},
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {"metadata": {"labels": {"smelt-jax/job": job.name}}, "spec": pod_spec},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": job.name,
            "labels": {"kueue.x-k8s.io/queue-name": settings.queue, "smelt-jax/suite": graph.suite,
                       "smelt-jax/phase": job.phase},
            "annotations": {
                "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool",
                "smelt-jax/run-id": job.run.id, "smelt-jax/tpu-type": tpu.name,
                "smelt-jax/checkpoints": paths["checkpoints"], "smelt-jax/results": paths["results"]},
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": settings.max_restarts,
                "rules": [
                    {"name": "RestartOnExit42OrDisruption", "action": "RestartJobSet",
                     "onJobFailureReasons": ["PodFailurePolicy"]},
                    {"name": "FailOnAnyOtherError", "action": "FailJobSet", "onJobFailureReasons": []},
                ],
            },
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": job_spec}}],
        },
    }


def cluster_for(settings: CloudSettings, tpu_type: str) -> str:
    """The GKE cluster for a slice type: `--cluster NAME` for every job, or, for a suite that needs
    several slice types (smelt16: v5p-128 and v5p-512), one xpk cluster per type:
    `--cluster v5p-128=NAME_A,v5p-512=NAME_B`."""
    if "=" not in settings.cluster:
        return settings.cluster
    clusters = {}
    for part in settings.cluster.split(","):
        key, sep, name = part.partition("=")
        if not sep or not key.strip() or not name.strip():
            raise UsageError(f"--cluster {settings.cluster!r}: give NAME, or TPU_TYPE=NAME,TPU_TYPE=NAME")
        clusters[key.strip()] = name.strip()
    if tpu_type not in clusters:
        raise UsageError(f"--cluster {settings.cluster!r} names no cluster for {tpu_type}, which this "
                         f"suite's jobs need (add {tpu_type}=NAME)")
    return clusters[tpu_type]


def xpk_command(graph: JobGraph, job: Job, settings: CloudSettings) -> str:
    cluster = cluster_for(settings, tpu_type_for(job.run))
    return quote([
        "xpk", "workload", "create", f"--cluster={cluster}", f"--project={settings.project}",
        f"--zone={settings.zone}", f"--workload={job.name}", f"--docker-image={settings.image}",
        f"--tpu-type={tpu_type_for(job.run)}", "--num-slices=1",
        f"--max-restarts={settings.max_restarts}", f"--restart-on-exit-codes={RESTART_EXIT_CODE}",
        *(f"--env={k}={v}" for k, v in settings.job_env().items()),
        f"--command={quote(trainer_command(job, settings))}",
    ])


def render_manifest(manifest: dict) -> str:
    return yaml.safe_dump(manifest, sort_keys=True, default_flow_style=False, width=1000)


@dataclasses.dataclass(frozen=True)
class XpkBackend:
    settings: CloudSettings = dataclasses.field(default_factory=CloudSettings)
    name: str = "xpk"

    def plan(self, graph: JobGraph) -> list[PlannedJob]:
        planned = []
        for job in graph.jobs:
            manifest = jobset_manifest(graph, job, self.settings)
            validate_jobset(manifest)
            planned.append(PlannedJob(job.name, (xpk_command(graph, job, self.settings),),
                                      ((f"manifests/{job.name}.yaml", render_manifest(manifest)),)))
        return planned

    def submit(self, graph: JobGraph, *, execute: bool = False) -> int:
        if execute:
            check_submittable(self.settings, "xpk", XPK_HINT, SUBMIT_FIELDS, graph)
        planned = self.plan(graph)
        out = Path(self.settings.out_dir)
        script = write_plan(planned, out, f"xpk workloads for suite {graph.suite} "
                            "(or: kubectl apply -f manifests/<job>.yaml)")
        if not execute:
            print_commands(planned, script)
            return 0
        return execute_ready(planned, self.status(graph), self.settings, "xpk", XPK_HINT, SUBMIT_FIELDS, graph=graph)

    def status(self, graph: JobGraph) -> dict[str, JobStatus]:
        return cloud_status(graph, self.settings)

    def cancel(self, graph: JobGraph, names: list[str] | None = None, *,
               execute: bool = False) -> list[str]:
        commands = [quote(["xpk", "workload", "delete",
                           f"--cluster={cluster_for(self.settings, tpu_type_for(job.run))}",
                           f"--project={self.settings.project}", f"--zone={self.settings.zone}",
                           f"--workload={job.name}"]) for job in graph.select(names)]
        if execute:
            execute_ready([PlannedJob(f"cancel-{i}", (c,)) for i, c in enumerate(commands)],
                          {f"cancel-{i}": JobStatus.READY for i in range(len(commands))},
                          self.settings, "xpk", "install it with `pip install xpk`", CANCEL_FIELDS)
        return commands

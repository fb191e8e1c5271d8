"""`smelt sweep plan|submit|status|cancel --suite SUITE`, `smelt results collect|export` (docs/sweeps.md)."""

from __future__ import annotations

import shlex
from pathlib import Path

from smelt_jax.design import suites
from smelt_jax.cli import CliError, filesystem_errors
from smelt_jax.platform.exit_codes import SKIPPED
from smelt_jax.sweep.base import CAPACITIES
from smelt_jax.sweep.graph import JobGraph, JobStatus, suite_graph

BACKENDS = ("local", "xpk", "tpu-vm")


def _runs_root(value: str | None):
    """--runs-dir as a path (a gs:// URL stays whole: storage.as_path), or None for the default."""
    from smelt_jax.platform.storage import as_path
    return as_path(value) if value else None


def _backend(args, suite: str):
    from smelt_jax.sweep.base import CloudSettings
    if getattr(args, "queue", None) is not None and args.backend != "xpk":
        raise CliError(f"--queue names the Kueue LocalQueue of the xpk backend; the {args.backend} backend "
                       "has no such queue (tpu-vm: each job is its own queued resource), so it refuses --queue")
    root = _runs_root(args.runs_dir)
    if args.backend == "local":
        from smelt_jax.sweep.local import DEFAULT_COMMAND, LocalBackend, LocalSettings
        command = tuple(shlex.split(args.command)) if args.command else DEFAULT_COMMAND
        return LocalBackend(LocalSettings(root=root, command=command, parallel=args.parallel,
                                          progress=not args.quiet, data_dir=args.data_dir))
    out = Path(args.out) if args.out else Path("sweeps") / suite / args.backend
    overrides = {k: getattr(args, k) for k in ("image", "bucket", "project", "zone", "cluster",
                                               "max_restarts", "data_dir", "capacity", "reservation",
                                               "queue") if getattr(args, k) is not None}
    settings = CloudSettings(out_dir=out, root=root, **overrides)
    if args.backend == "xpk":
        from smelt_jax.sweep.xpk import XpkBackend
        return XpkBackend(settings)
    from smelt_jax.sweep.tpu_vm import TpuVmBackend
    return TpuVmBackend(settings)


def _graph(args) -> JobGraph:
    return suite_graph(args.suite)


@filesystem_errors
def cmd_plan(args) -> int:
    from smelt_jax.sweep.tpu import tpu_type_for
    graph = _graph(args)
    print(f"{'job':<42} {'run id':<46} {'phase':<7} {'needs':<14} {'tpu':<8}")
    for job in graph.jobs:
        needs = "-" if job.is_stable else f"ckpt@{job.fork_step}"
        print(f"{job.name:<42} {job.run.id:<46} {job.phase:<7} {needs:<14} {tpu_type_for(job.run):<8}")
    n_stable = sum(job.is_stable for job in graph.jobs)
    print(f"{len(graph.jobs)} jobs: {n_stable} stable + {len(graph.jobs) - n_stable} branches")
    if args.backend:
        for planned in _backend(args, graph.suite).plan(graph):
            for command in planned.commands:
                print(command)
    return 0


@filesystem_errors
def cmd_submit(args) -> int:
    graph = _graph(args)
    backend = _backend(args, graph.suite)
    if args.backend == "local":
        return backend.submit(graph)
    return 1 if backend.submit(graph, execute=args.submit) else 0


@filesystem_errors
def cmd_status(args) -> int:
    graph = _graph(args)
    statuses = _backend(args, graph.suite).status(graph)
    from smelt_jax.sweep.summary import summarize
    summary = summarize(graph, statuses, _runs_root(args.runs_dir))
    if args.all:
        print(f"{'job':<42} {'phase':<7} {'data':<12} status")
        for job in graph.jobs:
            print(f"{job.name:<42} {job.phase:<7} {summary.data_label(job.run.id):<12} "
                  f"{statuses[job.name].value}")
    print(" ".join(f"{status.value}={summary.counts[status.value]}" for status in JobStatus)
          + f"  (of {summary.jobs} jobs)")
    print(f"endpoints: {summary.endpoints_written} written, {summary.endpoints_in_store} in the results "
          f"store, {summary.endpoints_expected} expected")
    for line in summary.data_lines():
        print(line)
    for job in summary.damaged:
        print(f"damaged: {job.name} ({job.run.id}): a checkpoint it must provide is damaged; "
              f"`smelt train {job.run.id}` (or submitting the sweep) moves it aside and retrains it")
    for item in summary.skipped:
        print(item.line())
    return SKIPPED if summary.skipped else 0


@filesystem_errors
def cmd_cancel(args) -> int:
    graph = _graph(args)
    backend = _backend(args, graph.suite)
    execute = args.submit or args.backend == "local"
    commands = backend.cancel(graph, args.job or None, execute=execute)
    for command in commands:
        print(command)
    if not commands:
        print("nothing to cancel")
    elif not execute:
        print("# dry run: pass --submit to run these")
    return 0


@filesystem_errors
def cmd_collect(args) -> int:
    from smelt_jax.sweep.collect import collect
    from smelt_jax.run_files.readers import counted
    skipped: list = []
    reports = collect(args.runs_dir, [args.suite] if args.suite else None, run_id=args.run, skipped=skipped)
    for item in skipped:
        print(item.line())
    for report in reports:
        if report.set_aside:
            print(f"{report.suite}: the damaged results table was set aside as {report.set_aside} and rebuilt")
        print(f"{report.suite}: {report.endpoints} endpoints, {report.appended} rows appended")
        for problem in report.problems:
            print(f"  not collected: {problem}")
    if not reports:
        print("no suites found")
    return SKIPPED if counted(skipped) or any(report.problems for report in reports) else 0


@filesystem_errors
def cmd_export(args) -> int:
    from smelt_jax.sweep.collect import export
    out = Path(args.out) if args.out else Path("fits") / args.suite / "results.csv"
    rows, left_out = export(args.suite, out, _runs_root(args.runs_dir), include_custom=args.include_custom)
    note = f" ({left_out} off-grid rows left out: --include-custom takes them)" if left_out else ""
    print(f"{args.suite}: {rows} endpoint rows -> {out}{note}")
    return 0


_CLOUD_HELP = {
    "image": "container image (make image push-image IMAGE=...); default "
             "REGION-docker.pkg.dev/PROJECT/smelt/smelt-jax:TAG, refused by --submit",
    "bucket": "gs://BUCKET/PATH (runs go to PATH/runs)", "project": "Google Cloud project id",
    "zone": "zone of the TPU slices",
    "cluster": "xpk: GKE cluster NAME, or TPU_TYPE=NAME,... (one cluster per slice type)",
    "data-dir": "token store every job trains on (smelt data prepare); local backend: any store, passed "
                "to each trainer; xpk/tpu-vm: a gs:// store, required by --submit for suites whose runs "
                "expect a tokenizer.json (smelt16, ablations200m)"}


def _common(parser, *, backend_required: bool, runs_jobs: bool, submits: bool) -> None:
    """The flags a sweep verb takes: every verb its own, so that e.g. `plan --submit` is an error.
    runs_jobs: the local backend's --parallel/--command/--quiet; submits: --submit."""
    parser.add_argument("--suite", required=True,
                        help=suites.described())
    parser.add_argument("--backend", choices=BACKENDS, required=backend_required,
                        help="local, xpk or tpu-vm" + ("" if backend_required else " (default local)"))
    parser.add_argument("--runs-dir", help="runs root: a local path or gs://... (default $SMELT_RUNS_DIR "
                                            "or ./runs)")
    parser.set_defaults(parallel=1, command=None, quiet=True, submit=False)
    if runs_jobs:
        local = parser.add_argument_group("local backend")
        local.add_argument("--parallel", type=int, default=1, help="jobs at a time (default 1)")
        local.add_argument("--command", help="trainer command instead of `python -m smelt_jax` "
                                             "(each job appends: train RUN_ID [--branch K])")
        local.add_argument("--quiet", action="store_true", help="no progress bar")
    cloud = parser.add_argument_group("xpk / tpu-vm backends")
    if submits:
        cloud.add_argument("--submit", action="store_true",
                           help="run the commands (default: dry run, write and print them)")
    cloud.add_argument("--out", help="folder for commands and manifests (default sweeps/SUITE/BACKEND)")
    for name, text in _CLOUD_HELP.items():
        cloud.add_argument(f"--{name}", help=text)
    cloud.add_argument("--capacity", choices=CAPACITIES,
                       help="how slices are paid for: spot (default; preemptible, jobs retry), on-demand, "
                            "or reserved (tpu-vm: the queued resource; xpk: the pods' node selector, the "
                            "cluster's node pools decide for the xpk command)")
    cloud.add_argument("--reservation", help="with --capacity reserved: the reservation's name (default: "
                                             "the zone's reservation for the project)")
    cloud.add_argument("--queue", help="xpk: Kueue LocalQueue of the JobSets (default multislice-queue, "
                                       "the one xpk clusters create)")
    cloud.add_argument("--max-restarts", type=int, dest="max_restarts",
                       help="restarts of a job before it counts as failed")


def register(subparsers) -> None:
    sweep = subparsers.add_parser("sweep", help="plan, submit and monitor a suite's jobs",
                                  description="A suite's job graph (a stable job and one job per decay "
                                              "branch per run) on the local, xpk or tpu-vm backend.")
    verbs = sweep.add_subparsers(dest="verb", metavar="VERB", required=True)
    plan = verbs.add_parser("plan", help="list the job graph (and a backend's commands)",
                            description="Lists the jobs and, with --backend, writes the commands.")
    _common(plan, backend_required=False, runs_jobs=False, submits=False)
    plan.set_defaults(handler=cmd_plan)
    submit = verbs.add_parser("submit", help="run (local) or render/submit (xpk, tpu-vm) the jobs",
                              description="local: trains every ready job here, resuming. xpk/tpu-vm: "
                                          "writes the commands; --submit runs them for the ready jobs.")
    _common(submit, backend_required=True, runs_jobs=True, submits=True)
    submit.set_defaults(handler=cmd_submit)
    status = verbs.add_parser("status", help="pending/ready/running/done/failed/damaged counts",
                              description="Job statuses read from the runs root, and endpoint counts.")
    _common(status, backend_required=False, runs_jobs=False, submits=False)
    status.add_argument("--all", action="store_true", help="one line per job")
    status.set_defaults(handler=cmd_status, backend="local")
    cancel = verbs.add_parser("cancel", help="stop a local sweep, or delete cloud jobs",
                              description="local: stops the running sweep (its trainers save first). "
                                          "xpk/tpu-vm: prints (or with --submit runs) the deletions.")
    _common(cancel, backend_required=True, runs_jobs=False, submits=True)
    cancel.add_argument("--job", nargs="+", metavar="NAME", help="only these jobs (cloud backends)")
    cancel.set_defaults(handler=cmd_cancel)

    results = subparsers.add_parser("results", help="the results store",
                                    description="One row per finished endpoint, per suite.")
    results_verbs = results.add_subparsers(dest="verb", metavar="VERB", required=True)
    collect = results_verbs.add_parser("collect", help="append endpoint rows missing from the store")
    collect.add_argument("--suite", help="only this suite (default: every suite under the runs root, "
                                              "local or gs://)")
    collect.add_argument("--run", metavar="ID", help="only this run: an id or unique prefix, a suite's "
                                                     "or one saved under the runs root (local roots)")
    collect.add_argument("--runs-dir", help="runs root: a local path or gs://... (default $SMELT_RUNS_DIR or ./runs)")
    collect.set_defaults(handler=cmd_collect)
    export = results_verbs.add_parser("export", help="write a suite's endpoint rows as fits/SUITE/results.csv",
                                      description="The suite's local results store as a fit folder keeps it "
                                                  "(every endpoint, per-source losses); `make fits` then "
                                                  "fits it (docs/scaling.md).")
    export.add_argument("--suite", required=True, help="suite name")
    export.add_argument("--out", help="output CSV (default fits/SUITE/results.csv)")
    export.add_argument("--include-custom", action="store_true",
                        help="also export the config-file and --override runs saved under the suite (with an "
                             "origin column); by default only the suite's own grid runs")
    export.add_argument("--runs-dir", help="runs root holding the store (default $SMELT_RUNS_DIR or ./runs)")
    export.set_defaults(handler=cmd_export)

"""The job graph: names (content-derived, unique, valid Kubernetes names) and artifact-driven status."""

import dataclasses
import os

import pytest

from smelt_jax.platform.errors import UsageError

from experiments import SUITE_NAMES, load_suite
from smelt_jax.run_files.results import EndpointResult, append_result
from smelt_jax.run_files.rundir import results_dir, run_dir
from smelt_jax.sweep.graph import (
    MAX_NAME_LEN,
    JobStatus,
    artifact_statuses,
    build_graph,
    is_valid_job_name,
    job_name,
    suite_graph,
)


@pytest.mark.parametrize("suite", SUITE_NAMES)
def test_names_unique_and_valid(suite):
    if not load_suite(suite):  # nano before its learning rates are fixed: one line, not a traceback
        with pytest.raises(UsageError, match="has no runs yet"):
            suite_graph(suite)
        return
    graph = suite_graph(suite)
    names = [job.name for job in graph.jobs]
    assert len(set(names)) == len(names)
    bad = [n for n in names if not is_valid_job_name(n) or len(n) > MAX_NAME_LEN]
    assert not bad
    runs = load_suite(suite)
    assert len(graph.jobs) == sum(1 + len(r.schedule.fork_steps) for r in runs)


def test_smelt16_has_224_jobs():
    graph = suite_graph("smelt16")
    assert sum(job.is_stable for job in graph.jobs) == 32
    assert sum(not job.is_stable for job in graph.jobs) == 192


def test_name_shape_and_determinism():
    run = next(r for r in load_suite("smelt16") if r.scale == "1.6b" and r.arch == "smelt")
    name = job_name(run, 3)
    assert name.startswith(f"smelt-1p6b-{run.sparsity_label}-b3-")
    assert name == job_name(run, 3)  # same content, same name (idempotent resubmission)
    assert job_name(run, None).split("-")[-2] == "stable"


def test_name_changes_with_content_and_long_names_are_cut_not_hash():
    run = load_suite("smoke")[0]
    other = dataclasses.replace(run, schedule=run.schedule.replace(peak_lr=run.schedule.peak_lr * 2))
    assert job_name(run, 0) != job_name(other, 0)  # a different grid point never shares a name
    long = dataclasses.replace(run, variant="averyveryverylongablationvariantname")
    name = job_name(long, 1)
    assert len(name) <= MAX_NAME_LEN and is_valid_job_name(name)
    assert name.split("-")[-2:][0] == "b1" and len(name.split("-")[-1]) == 8
    other_long = dataclasses.replace(run, variant="averyveryverylongablationvariantname2")
    assert job_name(other_long, 1) != name  # cut labels still differ by their hash


def test_invalid_names_rejected():
    for bad in ["Upper-case", "1starts-with-digit", "ends-with-dash-", "has.dot", "a" * 41, ""]:
        assert not is_valid_job_name(bad), bad


def test_graph_rejects_mixed_suites_and_duplicates():
    smoke, micro = load_suite("smoke"), load_suite("micro")
    with pytest.raises(ValueError, match="one suite"):
        build_graph([smoke[0], micro[0]])
    with pytest.raises(ValueError, match="collide"):
        build_graph([smoke[0], smoke[0]])


def _commit(folder, step, committed=True):
    name = str(step) if committed else f"{step}.orbax-checkpoint-tmp-1234"
    os.makedirs(folder / name)


def _endpoint_row(run, branch):
    b = run.budget()
    return EndpointResult(run_id=run.id, branch=branch, pair_id=run.pair_id, suite=run.suite,
                          arch=run.arch, scale=run.scale, sparsity_label=run.sparsity_label,
                          sparsity=b.sparsity, flops_per_token=b.train_flops_per_token,
                          params=b.params_total, tokens=run.schedule.branch_tokens(branch),
                          cumulative_flops=1.0, val_loss=4.0)


def test_readiness_follows_committed_checkpoints(tmp_path):
    graph = build_graph(load_suite("smoke")[:1])
    run = graph.jobs[0].run
    stable, b0, b1 = graph.jobs
    first_fork, last_fork = run.schedule.fork_steps
    assert (b0.fork_step, b1.fork_step) == (first_fork, last_fork) and first_fork < last_fork
    assert last_fork == run.schedule.stable_steps
    ckpts = run_dir(graph.suite, run.id, tmp_path).checkpoints(None)

    def statuses():
        s = artifact_statuses(graph, tmp_path)
        return s[stable.name], s[b0.name], s[b1.name]

    assert statuses() == (JobStatus.READY, JobStatus.PENDING, JobStatus.PENDING)
    _commit(ckpts, first_fork, committed=False)  # an orbax temporary folder is not a checkpoint yet
    assert statuses() == (JobStatus.READY, JobStatus.PENDING, JobStatus.PENDING)
    _commit(ckpts, first_fork)
    assert statuses() == (JobStatus.READY, JobStatus.READY, JobStatus.PENDING)
    _commit(ckpts, last_fork)  # the last fork = stable_steps: the stable job is done
    assert statuses() == (JobStatus.DONE, JobStatus.READY, JobStatus.READY)


def test_branch_done_needs_endpoint_and_row(tmp_path):
    graph = build_graph(load_suite("smoke")[:1])
    run = graph.jobs[0].run
    _, b0, b1 = graph.jobs
    rdir = run_dir(graph.suite, run.id, tmp_path)
    for step in run.schedule.fork_steps:
        _commit(rdir.checkpoints(None), step)
    endpoint = rdir.endpoint(0)
    endpoint.parent.mkdir(parents=True)
    endpoint.write_text("{}")
    assert artifact_statuses(graph, tmp_path)[b0.name] == JobStatus.READY  # no row: not done
    append_result(_endpoint_row(run, 1), results_dir(graph.suite, tmp_path))
    s = artifact_statuses(graph, tmp_path)
    assert s[b0.name] == JobStatus.READY and s[b1.name] == JobStatus.READY  # row alone: not done
    append_result(_endpoint_row(run, 0), results_dir(graph.suite, tmp_path))
    s = artifact_statuses(graph, tmp_path)
    assert s[b0.name] == JobStatus.DONE and s[b1.name] == JobStatus.READY

"""Every job a sweep renders runs on the slice and with the layout its suite's placement (the layout
table the compile report wrote, experiments/placement.py) gives it."""

import dataclasses
import shlex
from pathlib import Path

import pytest

import experiments
from experiments import placement
from smelt_jax.compile.candidates import candidates
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.platform.hardware import parse_slice
from smelt_jax.parallel.layout import format_layout, parse_layout, run_key
from smelt_jax.sweep.base import CloudSettings
from smelt_jax.sweep.graph import suite_graph
from smelt_jax.sweep.tpu_vm import job_script
from smelt_jax.sweep.xpk import jobset_manifest, xpk_command

SETTINGS = CloudSettings(image="us-docker.pkg.dev/p/smelt/smelt-jax:t", bucket="gs://b/smelt",
                         project="p", zone="z", cluster="c", out_dir=Path("out"))


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("suite", ["smelt16", "ablations200m"])
def test_every_rendered_job_uses_the_layout_tables_slice_and_layout(suite):
    table = placement.layouts(suite)
    graph = suite_graph(suite)
    assert {run_key(job.run) for job in graph.jobs} == set(table)  # every run has a layout
    for job in graph.jobs:
        want = table[run_key(job.run)]
        manifest = jobset_manifest(graph, job, SETTINGS)
        spec = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
        pod = spec["template"]["spec"]
        command = pod["containers"][0]["command"]
        tpu = parse_slice(want.tpu_type)
        assert manifest["metadata"]["annotations"]["smelt-jax/tpu-type"] == want.tpu_type
        selector = {k: v for k, v in pod["nodeSelector"].items() if k != "cloud.google.com/gke-spot"}
        assert selector == {"cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
                            "cloud.google.com/gke-tpu-topology": tpu.shape}  # plus the capacity's
        assert spec["parallelism"] == tpu.hosts
        got = parse_layout(_flag(command, "--layout"))
        assert (got.data, got.fsdp, got.expert, got.tensor) == (want.data, want.fsdp, want.expert,
                                                                want.tensor)
        assert _flag(command, "--remat") == want.remat
        xpk = shlex.split(xpk_command(graph, job, SETTINGS))
        assert f"--tpu-type={want.tpu_type}" in xpk
        assert f"--layout {format_layout(want)} --remat {want.remat}" in xpk[-1]
        script = job_script(graph, job, SETTINGS)
        assert f"--accelerator-type={want.tpu_type}" in script and format_layout(want) in script


def test_smelt16_runs_carry_their_compiled_layouts():
    compiled = placement.smelt16_layouts()
    for run in experiments.load_suite("smelt16"):
        assert run.parallelism == compiled[run_key(run)]
        assert placement.placement_for(run) == run.parallelism


def test_ablations200m_take_the_200m_placement():
    smelt16 = placement.smelt16_layouts()
    table = placement.layouts("ablations200m")
    runs = experiments.load_suite("ablations200m")
    # the ids do not change: the layouts are resolved at render time, not written into the descriptors
    assert all(run.parallelism == Parallelism() for run in runs)
    same = [r for r in runs if r.model == next(s for s in experiments.load_suite("smelt16")
                                               if run_key(s) == "200m/s85/baseline").model]
    assert same, "the L=12 / r=1 Baselines are the smelt16 200M S85 Baseline"
    for run in runs:
        layout = table[run_key(run)]
        assert layout.tpu_type == placement.SMELT16_SCALE_SLICES["200m"]
        if run in same:
            assert layout == smelt16["200m/s85/baseline"]
        else:  # derived by smelt16's candidate rule, remat full
            first = candidates(run, layout.tpu_type, placement.SMELT16_EXPERT_AXIS_SIZES)[0].layout
            assert (layout.data, layout.fsdp, layout.expert) == (first.data, first.fsdp, first.expert)
            assert layout.remat == placement.DERIVED_REMAT and layout.expert > 1


def test_a_run_without_placement_fails_clearly_at_render_time():
    run = next(r for r in experiments.load_suite("smelt16") if r.scale == "100m")
    bare = dataclasses.replace(run, parallelism=Parallelism())
    placement.layouts.cache_clear()
    try:
        table = placement.layouts("smelt16")
        table.pop(run_key(run))  # as if its configuration had not been compiled yet
        with pytest.raises(ValueError, match="smelt compile-report --suite smelt16"):
            placement.placement_for(bare)
    finally:
        placement.layouts.cache_clear()


def test_cpu_suites_get_the_smallest_slice_and_their_own_layout():
    for suite in placement.CPU_SUITES:
        for run in experiments.load_suite(suite):
            got = placement.placement_for(run)
            assert got.tpu_type == placement.CPU_SUITE_SLICE and got.remat == run.parallelism.remat

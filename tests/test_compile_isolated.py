"""Each compile of the compile report in a child process (compile/isolated.py): a compile killed for host
memory, crashed or raising fails alone. The search's handling of a crashed candidate is checked in
process (a stand-in compiler raising `CompileCrashed`); the child processes themselves (a real SIGKILL,
a raising compile, the report and peak memory that come back) in the integration tier."""

import dataclasses
import os
import signal
from pathlib import Path

import pytest

import experiments
from experiments.placement import SMELT16_POLICY
from smelt_jax.compile import layout_search as ls
from smelt_jax.compile import report as cr
from smelt_jax.compile.isolated import CompileCrashed, Isolated
from smelt_jax.compile.program_flops import ProgramFlops
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.parallel.layout import run_key

# stages 1-3 (exchange, remat, loop form) with XLA's default collectives
LOOPS = dataclasses.replace(SMELT16_POLICY, collectives=("auto",))
STEPS = {("none", "ring"): 0.10, ("none", "auto"): 0.20, ("dots", "ring"): 0.11}


def _run(key):
    return next(r for r in experiments.load_suite("smelt16") if run_key(r) == key)


def _report(run, slice_name, layout, remat, step, note="pallas"):
    return cr.CompileReport(
        run_id=run.id, slice=slice_name, layout={"data": layout.data, "fsdp": layout.fsdp,
                                                 "expert": layout.expert, "tensor": layout.tensor},
        remat=remat, expert_impl=note, peak_fits_hbm=True, error=None, compile_seconds=100.0,
        argument_bytes=2**30, output_bytes=2**30, temp_bytes=3 * 2**30, peak_bytes=4 * 2**30,
        hbm_bytes=95 * 2**30, budget_flops=2e13, step_seconds=step, hbm_seconds=step, compute_seconds=0.05,
        comm_seconds=0.01, exchange_exposed_seconds=0.0, dominant_term="HBM", hbm_traffic_bytes=1e11,
        analysis_version=cr.ANALYSIS_VERSION, layer_loop="unrolled" if layout.layer_loop == "unrolled" else "scan")


def _compile_or_die(run, slice_name, layout, remat, hlo_path=None):
    """A compile_run stand-in for a child process: the unrolled program kills its process as the kernel's
    out-of-memory killer would (SIGKILL), the padded exchange raises as a libtpu error would; the others
    answer a report noting the process's oom_score_adj."""
    if layout.layer_loop == "unrolled":
        os.kill(os.getpid(), signal.SIGKILL)
    if layout.exchange == "auto":
        raise RuntimeError("INTERNAL: Mosaic failed to compile\nsecond line of the error")
    adj = Path("/proc/self/oom_score_adj").read_text().strip()
    return _report(run, slice_name, layout, remat, STEPS.get((remat, layout.exchange)), f"pallas adj={adj}")


def _crashing_in_process(calls):
    """The same outcomes without a child: what `Isolated` raises, raised directly."""
    def compile_fn(run, slice_name, layout, remat, hlo_path=None):
        calls.append((remat, layout.exchange, layout.layer_loop))
        if layout.layer_loop == "unrolled":
            raise CompileCrashed("compile killed by SIGKILL (most likely the kernel's out-of-memory killer: "
                                 "the host ran out of memory) after 300 s")
        if layout.exchange == "auto":
            raise CompileCrashed("compile failed after 5 s: RuntimeError: INTERNAL: Mosaic failed to compile")
        return _report(run, slice_name, layout, remat, STEPS.get((remat, layout.exchange)))
    return compile_fn


def _trace_fn(run_, slice_name, layout, remat):
    return ProgramFlops(64 * 40e12, {"dot_general": 64 * 40e12}, 0, 0), 1.0


def test_a_crashed_candidate_fails_alone_and_is_not_cached(tmp_path):
    run = _run("100m/s95/smelt")
    calls, lines = [], []
    result = ls.search_layout(run, _crashing_in_process(calls), LOOPS, cache_dir=tmp_path, log=lines.append)
    # the padded exchange crashed (left out of stage 1); dots slower than none (stage 2 stops); the
    # unrolled program was killed: the configuration keeps its scan program
    assert calls == [("none", "ring", "auto"), ("none", "auto", "auto"), ("dots", "ring", "auto"),
                     ("none", "ring", "unrolled")]
    assert result.status == "fits"
    assert (result.chosen.exchange, result.chosen.remat, result.chosen.layer_loop) == ("ring", "none", "auto")
    outcomes = dict(result.tried)
    padded = next(label for label in outcomes if label.endswith("remat=none"))
    unrolled = next(label for label in outcomes if label.endswith("layers=unrolled"))
    assert outcomes[padded].startswith("not compiled (compile failed after 5 s: RuntimeError")
    assert outcomes[unrolled].startswith("not compiled (compile killed by SIGKILL")
    assert any("out-of-memory killer" in line for line in lines)
    # not cached: the next run (here, or on a machine with more memory) tries them again
    crashed = [c for c in ls.candidates(run, "v5p-128", (8,), ("ring", "auto"), ("auto", "unrolled"))
               if c.label in (padded, unrolled)]
    assert len(crashed) == 2 and not any(ls.is_cached(run, c, tmp_path) for c in crashed)
    again = []
    ls.search_layout(run, _crashing_in_process(again), LOOPS, cache_dir=tmp_path)
    assert again == [("none", "auto", "auto"), ("none", "ring", "unrolled")]


def test_a_crash_of_the_first_exchange_is_the_configurations_status_and_the_suite_goes_on(tmp_path):
    baseline, smelt = _run("100m/s95/baseline"), _run("100m/s95/smelt")

    def compile_fn(run, slice_name, layout, remat, hlo_path=None):
        if run.id == smelt.id:
            raise CompileCrashed("compile died of SIGSEGV after 40 s")
        return _report(run, slice_name, layout, remat, STEPS.get((remat, layout.exchange)))

    report = ls.compile_suite([smelt, baseline], LOOPS, suite="smelt16", cache_dir=tmp_path / "cache",
                              compile_fn=compile_fn, trace_fn=_trace_fn, libtpu=(True, ""),
                              markdown_out=tmp_path / "p.md")
    by_key = {r.key: r for r in report.results}
    assert by_key["100m/s95/smelt"].status == "not compiled (compile died of SIGSEGV after 40 s)"
    assert by_key["100m/s95/smelt"].chosen is None
    assert by_key["100m/s95/baseline"].status == "fits"
    assert "compile died of SIGSEGV" in (tmp_path / "p.md").read_text()


@pytest.mark.integration
def test_a_compile_in_a_child_answers_its_report_and_its_peak_host_memory():
    run = _run("100m/s95/smelt")
    layout = Parallelism(data=1, fsdp=8, expert=8, tpu_type="v5p-128", exchange="ring")
    child = Isolated(_compile_or_die)(run, "v5p-128", layout, "none")
    here = _compile_or_die(run, "v5p-128", layout, "none")
    assert child.expert_impl == "pallas adj=1000"  # the child offers itself to the OOM killer first
    assert child.host_peak_bytes > 50 * 2**20  # a process that imported JAX
    assert dataclasses.replace(child, host_peak_bytes=None, expert_impl=here.expert_impl) == here


@pytest.mark.integration
def test_a_killed_or_raising_child_raises_compile_crashed_in_one_line():
    run = _run("100m/s95/smelt")
    compile_fn = Isolated(_compile_or_die)
    unrolled = Parallelism(data=1, fsdp=8, expert=8, tpu_type="v5p-128", exchange="ring", layer_loop="unrolled")
    with pytest.raises(CompileCrashed, match=r"^compile killed by SIGKILL \(most likely the kernel's out-of-memory"):
        compile_fn(run, "v5p-128", unrolled, "none")
    padded = Parallelism(data=1, fsdp=8, expert=8, tpu_type="v5p-128")
    with pytest.raises(CompileCrashed) as err:
        compile_fn(run, "v5p-128", padded, "none")
    assert str(err.value).startswith("compile failed after ")
    assert str(err.value).endswith("s: RuntimeError: INTERNAL: Mosaic failed to compile")


def _sleeps(seconds, pid_file):
    Path(pid_file).write_text(str(os.getpid()))
    import time
    time.sleep(seconds)


@pytest.mark.integration
def test_a_compile_does_not_outlive_the_report_that_started_it(tmp_path):
    """The report's process killed (as `kill` or the OOM killer would): its compile child goes with it."""
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    script = ("import sys; sys.path[:0] = %r\n"
              "from smelt_jax.compile.isolated import Isolated\n"
              "from test_compile_isolated import _sleeps\n"
              "Isolated(_sleeps)(120, %r)\n") % (sys.path, str(pid_file))
    report = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # alive while its report is
    report.kill()
    report.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)

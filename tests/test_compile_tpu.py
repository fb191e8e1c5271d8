"""TPU slice names, collective counting, and one real ahead-of-time compile of a micro run's train
step for a TPU topology (skips, saying why, only when libtpu cannot be loaded)."""

import pytest

from smelt_jax.compile import aot
from smelt_jax.compile import report as cr
from smelt_jax.compile.hlo_stats import hlo_stats
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.platform.hardware import parse_slice


def test_slice_names_map_to_chips_and_topologies():
    v5p = parse_slice("v5p-128")
    assert (v5p.chips, v5p.topology_desc, v5p.hbm_bytes) == (64, "v5p:4x4x4", 95 * 2**30)
    assert parse_slice("v5e-256").topology_desc == "v5e:16x16"
    assert parse_slice("v5litepod-4").topology_desc == "v5e:2x2"
    with pytest.raises(ValueError, match="want e.g."):
        parse_slice("v5p128")
    with pytest.raises(ValueError, match="not a known"):
        parse_slice("v5p-6")


def test_collectives_are_counted_by_kind():
    hlo = """HloModule m

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={}
  %ags = (f32[4], f32[8]) all-gather-start(f32[4] %y), dimensions={0}
  %agd = f32[8] all-gather-done((f32[4], f32[8]) %ags)
  %a2a = f32[2,4] all-to-all(f32[2,4] %z), dimensions={0}
  ROOT %add = f32[8] add(f32[8] %ar, f32[8] %agd)
}
"""
    assert hlo_stats(hlo).static_counts == {"all-reduce": 1, "all-gather": 1, "all-to-all": 1}


@pytest.mark.tpu
@pytest.mark.integration
def test_micro_train_step_compiles_for_a_tpu_slice():
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments
    run = next(r for r in experiments.load_suite("smoke") if r.arch == "smelt")
    report = cr.compile_run(run, "v5e-4", Parallelism(data=2, fsdp=2))
    print(cr.format_report(report))
    assert report.peak_fits_hbm and report.error is None
    assert 0 < report.peak_bytes < report.hbm_bytes
    assert report.argument_bytes > 0 and report.compiled_flops > 0 and report.budget_flops > 0
    # data x fsdp: gradients are reduced and FSDP parameters gathered across devices
    assert report.collectives.get("all-reduce", 0) + report.collectives.get("reduce-scatter", 0) > 0
    assert report.collectives.get("all-gather", 0) > 0
    assert report.layout == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 1}


@pytest.mark.tpu
@pytest.mark.integration
def test_xla_step_estimate_carries_minus_one_per_sparsecore_offload():
    """Why the report does not use `optimal_seconds`: on v5p (4 SparseCores per chip) the train step's
    scatters are offloaded, and each offload adds -1 s to the estimate; what is left is a small positive
    number (and it counts each loop body once: see test_program_costs)."""
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments
    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    report = cr.compile_run(run, "v5p-8", Parallelism(data=2, fsdp=2))
    print(f"{report.sparsecore_offloads} SparseCore offloads, optimal_seconds {report.optimal_seconds:.6g}")
    assert report.sparsecore_offloads > 0 and report.optimal_seconds < 0
    assert 0 < report.optimal_seconds + report.sparsecore_offloads < 0.01


@pytest.mark.tpu
@pytest.mark.integration
def test_smelt_compile_writes_the_hlo_and_prints_the_three_roofline_terms(tmp_path, capsys):
    """`smelt compile ID --hlo-out FILE` on a micro run: the file is the gzipped compiled HLO, attention
    in it is Mosaic (no Pallas interpret-mode loop), and the report prints compute, HBM and ICI with both
    roofline MFUs."""
    import re

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments
    from smelt_jax.cli import main

    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    hlo = tmp_path / "step.hlo.gz"
    code = main(["compile", run.id, "--topology", "v5p-8", "--layout", "data=2,fsdp=2", "--hlo-out", str(hlo)])
    out = capsys.readouterr().out
    assert code == 0
    text = cr.read_hlo(hlo)
    assert text.startswith("HloModule")
    mosaic = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert any("%splash_mha_fwd" in line.split(" = ", 1)[0] for line in mosaic)
    assert not re.search(r' while\(.*op_name="[^"]*/splash_mha', text)
    number = r"([\d.e+-]+)"
    step = re.search(rf"roofline step >= {number} s = max\(compute {number} s, HBM {number} s, ICI {number} s\) "
                     rf"\+ exposed expert exchange {number} s", out)
    assert step, out
    total, *terms = (float(v) for v in step.groups())
    assert total == pytest.approx(max(terms[:3]) + terms[3], rel=1e-3) and terms[1] > 0
    assert out.count("roofline MFU <=") == 2


@pytest.mark.tpu
@pytest.mark.integration
def test_no_scan_of_a_looped_model_zero_fills_its_saved_activations(tmp_path):
    """XLA:TPU allocates a scan's stacked outputs uninitialised only when no other scan's stacks share
    their shape (model/layer.py, `distinct_scan_lengths`). Read in the compiled v5p program of the smoke
    SMELT step (ring exchange, remat none): no while loop starts from a zero-filled (broadcast) stack
    with a token dimension (a multiple of seq_len: the saved activations). The weight-gradient
    accumulators (no token dimension) are zero-filled in the Baseline's program too. Measured: 110
    zero-filled loop operands without the peel, 10 with it (those accumulators); this test fails with
    `distinct_scan_lengths` returning no peels."""
    import gzip
    import re

    import experiments
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    run = next(r for r in experiments.load_suite("smoke") if r.arch == "smelt" and r.model.loop_repeats > 1)
    hlo_file = tmp_path / "step.hlo.gz"
    layout = Parallelism(data=1, fsdp=1, expert=4, tensor=1, tpu_type="v5p-8", exchange="ring")
    report = cr.compile_run(run, "v5p-8", layout, remat="none", hlo_path=hlo_file)
    assert report.peak_fits_hbm
    lines = gzip.open(hlo_file, "rt").read().splitlines()
    defs = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)", line)
        if m:
            defs.setdefault(m.group(1), m.group(2))
    seq = run.model.seq_len
    zero_filled, allocated = [], 0
    for line in lines:
        init = re.search(r" while\(%([^)]+)\)", line)
        operands = re.search(r" tuple\((.*)\)", defs.get(init.group(1), "")) if init else None
        for operand in operands.group(1).split(",") if operands else ():
            definition = defs.get(operand.strip().split("*/")[-1].lstrip("%"), "")
            allocated += "AllocateBuffer" in definition
            dims = re.match(r"\w+\[([\d,]*)\]", definition)
            if " broadcast(" in definition and dims:
                shape = [int(v) for v in dims.group(1).split(",") if v]
                if any(v % seq == 0 for v in shape[1:]):
                    zero_filled.append(definition.split(" ")[0])
    assert allocated > 0  # the stacks are there, allocated without a fill
    assert not zero_filled, zero_filled[:5]

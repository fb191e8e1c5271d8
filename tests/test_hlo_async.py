"""The compile report reads the async-collective forms XLA:TPU emits (compile/hlo_stats.py, issue 50 item 5):
each collective counted once whatever its wrapper (`*-start` / `*-done` pairs, `async-start` /
`async-update` / `async-done` around a computation, an async collective fusion waited for by a `*-done`,
collective-permute pairs), overlapped when compute runs inside its window, Mosaic kernels fused into an
async block filed as kernels (walk_categories), and the ring exchange's bytes sent at (n-1)/n of a group.

Every module is hand-written and small; bytes are counted by hand in the comments (bf16: 2 bytes)."""

import pytest

from smelt_jax.compile import report as cr
from smelt_jax.compile.hbm_traffic import walk
from smelt_jax.compile.hlo_module import execution_counts, parse_module
from smelt_jax.compile.hlo_stats import hlo_stats

GROUPS = "replica_groups=[8,8]<=[64]"  # 8 groups of 8 devices
RING = 'metadata={op_name="jit(step)/moe/ring_exchange/all_gather"}'
RING_RS = 'metadata={op_name="jit(step)/transpose(jvp(moe))/ring_exchange/reduce_scatter"}'
KERNEL = 'metadata={op_name="jit(step)/moe/experts/pallas_call"}'

_HEAD = """HloModule m, is_scheduled=true, num_partitions=64

%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %c = bf16[] add(%a, %b)
}

%work (w.0: bf16[32,8]) -> bf16[32,8] {
  %w.0 = bf16[32,8]{1,0} parameter(0)
  ROOT %w.1 = bf16[32,8]{1,0} multiply(%w.0, %w.0)
}
"""

# A 4-trip loop whose body gathers bf16[4,8] -> bf16[32,8] as an all-gather-start / -done pair with a
# fusion in flight, and scatters bf16[32,8] -> bf16[4,8] as a reduce-scatter pair with nothing between.
START_DONE = _HEAD + """
%body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[4,8]{1,0} get-tuple-element(%p), index=1
  %ags = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%x), dimensions={0}, GROUPS, RING
  %busy = bf16[4,8]{1,0} fusion(%x), kind=kLoop, calls=%work
  %agd = bf16[32,8]{1,0} all-gather-done(%ags)
  %rss = (bf16[32,8]{1,0}, bf16[4,8]{1,0}) reduce-scatter-start(%agd), dimensions={0}, GROUPS, to_apply=%sum, RING_RS
  %rsd = bf16[4,8]{1,0} reduce-scatter-done(%rss)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%next, %rsd)
}

%cond (q: (s32[], bf16[4,8])) -> pred[] {
  %q = (s32[], bf16[4,8]{1,0}) parameter(0)
  %limit = s32[] constant(4)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %limit), direction=LT
}

ENTRY %main (x.0: bf16[4,8]) -> bf16[4,8] {
  %x.0 = bf16[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%zero, %x.0)
  %loop = (s32[], bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[4,8]{1,0} get-tuple-element(%loop), index=1
}
""".replace("GROUPS", GROUPS).replace("RING_RS", RING_RS).replace("RING", RING)


def test_start_done_pairs_count_once_per_trip_and_the_ring_sends_seven_eighths():
    stats = hlo_stats(START_DONE)
    assert stats.collective_counts == {"all-gather": 4, "reduce-scatter": 4}  # 4 trips, one each
    assert stats.static_counts == {"all-gather": 1, "reduce-scatter": 1}
    # per trip: the gather's result 32 x 8 x 2 = 512 B, of which a ring over 8 sends 7/8 = 448 B;
    # the scatter's input is 8 x its 64 B result = 512 B, 7/8 sent = 448 B
    assert dict(((k, g), b) for k, g, b in stats.exchange_send_bytes_by_group) == {
        ("all-gather", 8): 4 * 448.0, ("reduce-scatter", 8): 4 * 448.0}
    assert stats.send_bytes == 8 * 448.0
    # the gather has a fusion in its window (overlapped); the scatter has none (exposed)
    assert stats.exchange_exposed_bytes == 4 * 448.0


# async-start / async-update / async-done around a computation holding a plain ring all-gather and a
# Mosaic kernel (XLA's generic async wrapper): the computation runs once per start, not once more per
# update; a fusion runs between start and done.
ASYNC_WRAPPER = _HEAD + """
%async_collective_fusion.1 (g.0: bf16[4,8]) -> bf16[32,8] {
  %g.0 = bf16[4,8]{1,0} parameter(0)
  %g.1 = bf16[32,8]{1,0} all-gather(%g.0), dimensions={0}, GROUPS, RING
  ROOT %k.1 = bf16[32,8]{1,0} custom-call(%g.1), custom_call_target="tpu_custom_call", KERNEL
}

ENTRY %main (x.0: bf16[4,8]) -> bf16[32,8] {
  %x.0 = bf16[4,8]{1,0} parameter(0)
  %as = ((bf16[4,8]{1,0}), bf16[32,8]{1,0}, u32[]) async-start(%x.0), calls=%async_collective_fusion.1
  %au = ((bf16[4,8]{1,0}), bf16[32,8]{1,0}, u32[]) async-update(%as), calls=%async_collective_fusion.1
  %busy = bf16[4,8]{1,0} fusion(%x.0), kind=kLoop, calls=%work
  ROOT %ad = bf16[32,8]{1,0} async-done(%au), calls=%async_collective_fusion.1
}
""".replace("GROUPS", GROUPS).replace("RING", RING).replace("KERNEL", KERNEL)


def test_an_async_wrapper_runs_its_computation_once_and_is_overlapped_by_compute_in_its_window():
    entry, computations = parse_module(ASYNC_WRAPPER)
    runs, _ = execution_counts(entry, computations)
    assert runs["async_collective_fusion.1"] == 1.0  # the start runs it; the update and done do not
    stats = hlo_stats(ASYNC_WRAPPER)
    assert stats.collective_counts == {"all-gather": 1}
    assert stats.send_bytes == 448.0  # 7/8 of 512 B
    assert stats.exchange_exposed_bytes == 0.0  # %busy runs inside the window
    back_to_back = ASYNC_WRAPPER.replace("  %busy = bf16[4,8]{1,0} fusion(%x.0), kind=kLoop, calls=%work\n", "")
    assert hlo_stats(back_to_back).exchange_exposed_bytes == 448.0
    # the HBM walk charges the kernel inside once: operand 512 B + result 512 B, filed as an expert kernel
    kernels = [c for c in walk(ASYNC_WRAPPER) if c.op == "custom-call"]
    assert [(c.category, c.times, c.bytes) for c in kernels] == [("expert kernels", 1.0, 1024.0)]


# XLA:TPU's async collective fusion: a fusion holding the all-gather-start (and a Mosaic kernel fused
# into the block), waited for by an all-gather-done outside; and a collective-permute pair.
ASYNC_FUSION = _HEAD + """
%async_collective_fusion.2 (f.0: bf16[4,8], f.1: bf16[4,8]) -> ((bf16[4,8], bf16[32,8]), bf16[4,8]) {
  %f.0 = bf16[4,8]{1,0} parameter(0)
  %f.1 = bf16[4,8]{1,0} parameter(1)
  %f.2 = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%f.0), dimensions={0}, GROUPS, RING
  %f.3 = bf16[4,8]{1,0} custom-call(%f.1), custom_call_target="tpu_custom_call", KERNEL
  ROOT %f.4 = ((bf16[4,8]{1,0}, bf16[32,8]{1,0}), bf16[4,8]{1,0}) tuple(%f.2, %f.3)
}

ENTRY %main (x.0: bf16[4,8], y.0: bf16[4,8]) -> (bf16[32,8], bf16[4,8]) {
  %x.0 = bf16[4,8]{1,0} parameter(0)
  %y.0 = bf16[4,8]{1,0} parameter(1)
  %acf = ((bf16[4,8]{1,0}, bf16[32,8]{1,0}), bf16[4,8]{1,0}) fusion(%x.0, %y.0), kind=kCustom, calls=%async_collective_fusion.2
  %acf.0 = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) get-tuple-element(%acf), index=0
  %cps = (bf16[4,8]{1,0}, bf16[4,8]{1,0}, u32[], u32[]) collective-permute-start(%y.0), source_target_pairs={{0,1},{1,0}}
  %busy = bf16[4,8]{1,0} fusion(%y.0), kind=kLoop, calls=%work
  %cpd = bf16[4,8]{1,0} collective-permute-done(%cps)
  %agd = bf16[32,8]{1,0} all-gather-done(%acf.0)
  ROOT %t = (bf16[32,8]{1,0}, bf16[4,8]{1,0}) tuple(%agd, %cpd)
}
""".replace("GROUPS", GROUPS).replace("RING", RING).replace("KERNEL", KERNEL)


def test_an_async_collective_fusion_counts_its_collective_once_and_files_as_a_kernel():
    stats = hlo_stats(ASYNC_FUSION)
    assert stats.collective_counts == {"all-gather": 1, "collective-permute": 1}
    assert stats.static_counts == {"all-gather": 1, "collective-permute": 1}
    by_group = {(k, g): b for k, g, b in stats.send_bytes_by_group}
    # the gather at its start's groups (8), 7/8 of 512 B; the permute (2 peers) its 64 B result
    assert by_group == {("all-gather", 8): 448.0, ("collective-permute", 2): 64.0}
    assert stats.exchange_exposed_bytes == 0.0  # %busy runs in its window (from %acf to %agd)
    busy = "  %busy = bf16[4,8]{1,0} fusion(%y.0), kind=kLoop, calls=%work\n"
    after = ASYNC_FUSION.replace(busy, "").replace("  ROOT %t =", busy + "  ROOT %t =")
    assert hlo_stats(after).exchange_exposed_bytes == 448.0  # nothing in its window: exposed
    charges = {c.name: c for c in walk(ASYNC_FUSION)}
    assert charges["acf"].category == "expert kernels"  # the kernel fused into the async block
    assert charges["cps"].category == "other collectives"


def test_a_done_waiting_for_a_fusion_that_holds_the_plain_collective_counts_it_once():
    plain = ASYNC_FUSION.replace("%f.2 = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(",
                                 "%f.2 = bf16[32,8]{1,0} all-gather(")
    stats = hlo_stats(plain)
    assert stats.collective_counts == {"all-gather": 1, "collective-permute": 1}
    assert stats.send_bytes == 448.0 + 64.0


def test_the_report_charges_the_exposed_ring_seven_eighths_of_the_group():
    base = dict(run_id="r", slice="v5p-128", layout={"data": 1, "fsdp": 8, "expert": 8, "tensor": 1},
                remat="none", expert_impl="pallas", peak_fits_hbm=True, error=None, compile_seconds=1.0,
                budget_flops=1e6)
    report = cr.analyse(cr.CompileReport(**base), {"dot_general": 64 * 1e6}, START_DONE)
    bandwidth = 2 * 4800e9 / 8 / 3  # a group of 8 chips spans 2 of v5p-128's torus axes, 200 GB/s each
    # the scatter whole; the gather less its window's work (%busy reads and writes 64 B) at HBM speed
    from smelt_jax.platform.hardware import parse_slice
    busy = 128 / parse_slice("v5p-128").hbm_bytes_per_second
    assert report.exchange_exposed_seconds == pytest.approx(4 * 448.0 / bandwidth + 4 * (448.0 / bandwidth - busy))
    assert report.comm_seconds == pytest.approx(8 * 448.0 / bandwidth)


def _ledger_report(**fields):
    base = dict(run_id="r", slice="v5p-128", layout={"data": 1, "fsdp": 8, "expert": 8, "tensor": 1},
                remat="none", expert_impl="pallas", peak_fits_hbm=True, error=None, compile_seconds=1.0,
                budget_flops=4.59e12, expert_exchange="ring", compute_seconds=0.05, hbm_seconds=0.12,
                comm_seconds=0.1, exchange_exposed_seconds=0.08, send_bytes=100e9, step_seconds=0.2)
    return cr.CompileReport(**{**base, **fields})


def test_a_ledger_record_is_recomputed_with_the_ring_at_seven_eighths_once():
    old = _ledger_report()  # analysed before ICI_ACCOUNTING 1: the ring charged 8/8
    new = cr.upgrade_ici(old)
    assert new.exchange_exposed_seconds == pytest.approx(0.07)  # 7/8 of 0.08
    assert new.comm_seconds == pytest.approx(0.09)  # the exposed ring's 1/8 (0.01 s) off the ICI term
    # 0.01 s at the 400 GB/s of a group of 8 chips (2 torus axes) is 4 GB fewer bytes sent
    assert new.send_bytes == pytest.approx(100e9 - 0.01 * 400e9)
    assert new.step_seconds == pytest.approx(0.12 + 0.07)  # max(0.05, 0.12, 0.09 - 0.07) + 0.07
    assert new.mfu == pytest.approx(4.59e12 / (0.19 * 459e12))
    assert cr.upgrade_ici(new) == new  # once
    padded = _ledger_report(expert_exchange="padded")
    assert cr.upgrade_ici(padded) == padded  # an all-to-all exchange is charged as before


def test_a_fresh_clone_reads_out_of_memory_records_and_upgraded_reports_from_the_ledger(tmp_path):
    import json

    from smelt_jax.compile.results_ledger import Ledger

    oom = _ledger_report(peak_fits_hbm=False, error="RESOURCE_EXHAUSTED", step_seconds=None, analysis_version=0)
    fits = _ledger_report(analysis_version=cr.ANALYSIS_VERSION)
    stale = _ledger_report(analysis_version=cr.ANALYSIS_VERSION - 1)
    lines = [json.dumps({"name": name, "key": "k", "candidate": {}, "report": report.as_dict()})
             for name, report in (("oom.json", oom), ("fits.json", fits), ("stale.json", stale))]
    (tmp_path / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    assert ledger.get("oom.json") is not None and not ledger.get("oom.json").peak_fits_hbm  # nothing to analyse
    assert ledger.get("stale.json") is None  # analysed by an older walk: compiled again
    assert ledger.get("fits.json").exchange_exposed_seconds == pytest.approx(0.07)  # read with the ring at 7/8


def test_only_a_mosaic_kernel_makes_a_fusion_a_kernel():
    """XLA:TPU fuses its own custom-calls too (AssumeGatherIndicesInBound into gathers, AllocateBuffer):
    those fusions keep their category (the 100M S95 SMELT program's scatter fusions stay scatters)."""
    from smelt_jax.compile.walk_categories import kind_of

    own = ASYNC_FUSION.replace('custom_call_target="tpu_custom_call"', 'custom_call_target="AssumeGatherIndicesInBound"')
    _, computations = parse_module(own)
    fusion = next(i for i in computations["main"] if i.name == "acf")
    assert kind_of(fusion, computations) == "compute"
    _, computations = parse_module(ASYNC_FUSION)
    assert kind_of(next(i for i in computations["main"] if i.name == "acf"), computations) == "kernel"

"""The two async forms the 'async' collectives options give (platform/xla_options.py, issue 50 item 5),
read from hand-written HLO (compile/hlo_async.py, hlo_stats, hbm_traffic): a multi-step all-gather chain
(start fusion, a continuation fusion with other work fused in, done fusion, each holding a copy of the
collective) and a reduce-scatter offloaded to a SparseCore (a `call-start` / `call-done` around a
computation that closes with `}, execution_thread="sparsecore"`). Each collective counted once, overlapped
only when work runs in its window, the chain's state not charged as HBM traffic, the SparseCore's
computation walked. Bytes are counted by hand in the comments (bf16: 2 bytes; no tiled layouts)."""

from smelt_jax.compile import hlo_async
from smelt_jax.compile.hbm_traffic import walk
from smelt_jax.compile.hlo_module import execution_counts, parse_module
from smelt_jax.compile.hlo_stats import hlo_stats

GROUPS = "replica_groups=[8,8]<=[64]"  # 8 groups of 8 devices
RING = 'metadata={op_name="jit(step)/moe/ring_exchange/all_gather"}'

_HEAD = """HloModule m, is_scheduled=true, num_partitions=64

%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %c = bf16[] add(%a, %b)
}

%work (w.0: bf16[4,8]) -> bf16[4,8] {
  %w.0 = bf16[4,8]{1,0} parameter(0)
  ROOT %w.1 = bf16[4,8]{1,0} multiply(%w.0, %w.0)
}
"""

# A ring all-gather bf16[4,8] -> bf16[32,8] in three steps; the continuation step also computes
# y [16,8] x w [8,8] (a dot fused in, as XLA:TPU fuses a weight gradient).
CHAIN = _HEAD + """
%ag_start (s.0: bf16[4,8]) -> (bf16[4,8], bf16[32,8], u32[]) {
  %s.0 = bf16[4,8]{1,0} parameter(0)
  %s.1 = bf16[32,8]{1,0} all-gather(%s.0), dimensions={0}, GROUPS, RING
  ROOT %s.2 = (bf16[4,8]{1,0}, bf16[32,8]{1,0}, u32[]) custom-call(%s.0, %s.1), custom_call_target="AsyncCollectiveStart"
}

%ag_step (c.0: bf16[4,8], c.1: bf16[32,8], c.2: u32[], c.3: bf16[16,8], c.4: bf16[8,8]) -> (bf16[16,8], bf16[4,8], bf16[32,8], u32[]) {
  %c.3 = bf16[16,8]{1,0} parameter(3)
  %c.4 = bf16[8,8]{1,0} parameter(4)
  %c.5 = bf16[16,8]{1,0} WORK
  %c.0 = bf16[4,8]{1,0} parameter(0)
  %c.1 = bf16[32,8]{1,0} parameter(1)
  %c.6 = bf16[32,8]{1,0} all-gather(%c.0), dimensions={0}, GROUPS, RING
  %c.2 = u32[] parameter(2)
  ROOT %c.7 = (bf16[16,8]{1,0}, bf16[4,8]{1,0}, bf16[32,8]{1,0}, u32[]) tuple(%c.5, %c.0, %c.6, %c.2)
}

%ag_done (d.0: bf16[4,8], d.1: bf16[32,8], d.2: u32[]) -> bf16[32,8] {
  %d.0 = bf16[4,8]{1,0} parameter(0)
  %d.1 = bf16[32,8]{1,0} parameter(1)
  %d.2 = u32[] parameter(2)
  %d.3 = bf16[32,8]{1,0} all-gather(%d.0), dimensions={0}, GROUPS, RING
  ROOT %d.4 = bf16[32,8]{1,0} custom-call(%d.0, %d.1, %d.3, %d.2), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (x.0: bf16[4,8], y.0: bf16[16,8], w.0: bf16[8,8]) -> (bf16[32,8], bf16[16,8]) {
  %x.0 = bf16[4,8]{1,0} parameter(0)
  %y.0 = bf16[16,8]{1,0} parameter(1)
  %w.0 = bf16[8,8]{1,0} parameter(2)
  %acs = (bf16[4,8]{1,0}, bf16[32,8]{1,0}, u32[]) fusion(%x.0), kind=kCustom, calls=%ag_start
  %acs.0 = bf16[4,8]{1,0} get-tuple-element(%acs), index=0
  %acs.1 = bf16[32,8]{1,0} get-tuple-element(%acs), index=1
  %acs.2 = u32[] get-tuple-element(%acs), index=2
  %step = (bf16[16,8]{1,0}, bf16[4,8]{1,0}, bf16[32,8]{1,0}, u32[]) fusion(%acs.0, %acs.1, %acs.2, %y.0, %w.0), kind=kCustom, calls=%ag_step
  %step.0 = bf16[16,8]{1,0} get-tuple-element(%step), index=0
  %step.1 = bf16[4,8]{1,0} get-tuple-element(%step), index=1
  %step.2 = bf16[32,8]{1,0} get-tuple-element(%step), index=2
  %step.3 = u32[] get-tuple-element(%step), index=3
  %acd = bf16[32,8]{1,0} fusion(%step.1, %step.2, %step.3), kind=kCustom, calls=%ag_done
  ROOT %t = (bf16[32,8]{1,0}, bf16[16,8]{1,0}) tuple(%acd, %step.0)
}
""".replace("GROUPS", GROUPS).replace("RING", RING)
DOT = "dot(%c.3, %c.4), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
COPY = "copy(%c.3)"


def test_a_multi_step_chain_counts_its_collective_once_and_is_overlapped_by_its_fused_work():
    module = CHAIN.replace("WORK", DOT)
    _, computations = parse_module(module)
    chains = hlo_async.collective_chains(computations)
    assert set(chains) == {"ag_start", "ag_step", "ag_done"}
    chain = chains["ag_step"]
    assert (chain.holder, chain.first, chain.last) == ("main", "acs", "acd")
    stats = hlo_stats(module)
    assert stats.collective_counts == {"all-gather": 1} and stats.static_counts == {"all-gather": 1}
    assert stats.send_bytes == 448.0  # 7/8 of the 512 B gathered, once (three copies in the text)
    assert stats.exchange_exposed_bytes == 0.0  # the dot fused into the continuation step
    # a continuation step that only moves data (a copy) and nothing between start and done: exposed
    assert hlo_stats(CHAIN.replace("WORK", COPY)).exchange_exposed_bytes == 448.0


def test_a_chain_is_walked_as_one_async_pair_plus_the_work_fused_into_it():
    charges = {c.name: c.bytes for c in walk(CHAIN.replace("WORK", DOT))}
    # start: reads the 64 B shard; step: the dot reads y 256 B and w 128 B, writes 256 B (the shard,
    # the result buffer and the sync word it takes and hands on are the chain's, not read); done:
    # writes the gathered 512 B
    assert charges == {"acs": 64.0, "step": 640.0, "acd": 512.0}


# The ring's reduce-scatter offloaded to a SparseCore, without the exchange's metadata (the forward's
# lost it in the 100M S95 program): a ring reduce-scatter because it scatters a ring all-gather's shape.
# A computation follows the SparseCore's, to check that `}, execution_thread=...` closes it.
SPARSECORE = _HEAD + """
%rs_sc (r.0: bf16[32,8], r.1: token[]) -> bf16[4,8] {
  %r.0 = bf16[32,8]{1,0} parameter(0)
  %r.1 = token[] parameter(1)
  ROOT %r.2 = bf16[4,8]{1,0} reduce-scatter(%r.0), dimensions={0}, GROUPS, to_apply=%sum
}, execution_thread="sparsecore"

%after (a.0: bf16[4,8]) -> bf16[4,8] {
  %a.0 = bf16[4,8]{1,0} parameter(0)
  ROOT %a.1 = bf16[4,8]{1,0} negate(%a.0)
}

ENTRY %main (x.0: bf16[4,8]) -> bf16[4,8] {
  %x.0 = bf16[4,8]{1,0} parameter(0)
  %g = bf16[32,8]{1,0} all-gather(%x.0), dimensions={0}, GROUPS, RING
  %tok = token[] after-all()
  %rss = ((bf16[32,8]{1,0}, token[]), bf16[4,8]{1,0}) call-start(%g, %tok), async_execution_thread="sparsecore", to_apply=%rs_sc
  %busy = bf16[4,8]{1,0} fusion(%x.0), kind=kLoop, calls=%work
  %rsd = bf16[4,8]{1,0} call-done(%rss)
  ROOT %out = bf16[4,8]{1,0} call(%rsd), to_apply=%after
}
""".replace("GROUPS", GROUPS).replace("RING", RING)


def test_a_sparsecore_reduce_scatter_is_read_counted_and_overlapped_by_work_in_its_window():
    entry, computations = parse_module(SPARSECORE)
    assert [i.name for i in computations["rs_sc"]] == ["r.0", "r.1", "r.2"]  # closed at its attributes
    assert [i.name for i in computations["after"]] == ["a.0", "a.1"]
    runs, _ = execution_counts(entry, computations)
    assert runs["rs_sc"] == 1.0
    stats = hlo_stats(SPARSECORE)
    assert stats.collective_counts == {"all-gather": 1, "reduce-scatter": 1}
    assert stats.sparsecore_offloads == 1
    by_kind = {k: b for k, _, b in stats.exchange_send_bytes_by_group}
    assert by_kind == {"all-gather": 448.0, "reduce-scatter": 448.0}  # both the ring's, 7/8 of 512 B
    assert stats.exchange_exposed_bytes == 448.0  # the synchronous gather; %busy overlaps the scatter
    back_to_back = SPARSECORE.replace("  %busy = bf16[4,8]{1,0} fusion(%x.0), kind=kLoop, calls=%work\n", "")
    assert hlo_stats(back_to_back).exchange_exposed_bytes == 896.0


def test_the_sparsecores_computation_is_walked():
    charges = {c.name: c.bytes for c in walk(SPARSECORE)}
    # the offloaded reduce-scatter reads 512 B and writes 64 B (the wrappers move nothing themselves)
    assert charges["r.2"] == 576.0 and "rss" not in charges and "rsd" not in charges


def test_the_report_charges_an_async_collective_what_its_windows_work_does_not_cover():
    """compile/exchange_exposure.py: the chain's gather (448 B sent over a group of 8) less the HBM time
    of the work in its window (the continuation step's 640 B): a window's work is weighed, not merely
    present."""
    import pytest

    from smelt_jax.compile import report as cr
    from smelt_jax.platform.hardware import parse_slice

    tpu = parse_slice("v5p-128")
    base = dict(run_id="r", slice="v5p-128", layout={"data": 1, "fsdp": 8, "expert": 8, "tensor": 1},
                remat="none", expert_impl="pallas", peak_fits_hbm=True, error=None, compile_seconds=1.0,
                budget_flops=1e6)
    report = cr.analyse(cr.CompileReport(**base), {"dot_general": 64 * 1e6}, CHAIN.replace("WORK", DOT))
    gather, work = 448.0 / tpu.ici_bytes_per_second_for_group(8), 640.0 / tpu.hbm_bytes_per_second
    assert 0 < work < gather
    assert report.exchange_exposed_seconds == pytest.approx(gather - work)
    nothing = cr.analyse(cr.CompileReport(**base), {"dot_general": 64 * 1e6}, CHAIN.replace("WORK", COPY))
    assert nothing.exchange_exposed_seconds == pytest.approx(gather)  # no work in the window: exposed whole

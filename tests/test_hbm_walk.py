"""The HBM walk by category and its fairness fixes, on hand-written HLO modules (tests/hlo_walk_samples.py):
categories that sum to the total, the overflow loop at a chosen trip count, on-chip (S(1)) buffers and
prefetches, tile padding, gathers and scatters charged by the rows they touch."""

import dataclasses
import math

import pytest

from smelt_jax.compile.breakdown import breakdown, category_row, format_breakdown
from smelt_jax.compile.hbm_traffic import hbm_bytes, walk
from smelt_jax.compile.hlo_layout import hbm_shape_bytes, is_on_chip
from smelt_jax.compile.hlo_module import parse_module
from smelt_jax.compile.overflow import overflow_passes, step_overflow_passes
from smelt_jax.compile.walk_categories import CATEGORIES, OVERFLOW, classify, kind_of, op_name, scope_of
from tests.hlo_walk_samples import CATEGORY_HLO, CATEGORY_OF, GATHER_SCATTER_HLO, OVERFLOW_HLO, VMEM_HLO

# ------------------------------------------------------------------------------ categories


def test_classify_files_each_hand_written_instruction_in_its_category():
    _, computations = parse_module(CATEGORY_HLO)
    entry = {i.name: i for i in computations["main"]}
    got = {name: classify(kind_of(entry[name], computations), op_name(entry[name], computations))
           for name in CATEGORY_OF}
    assert got == CATEGORY_OF


@pytest.mark.parametrize("kind, name, category", [
    ("exchange", "jit(train_step)/transpose(jvp(moe))/experts/ragged_all_to_all", "expert exchange"),
    ("matmul", "jit(train_step)/transpose(jvp(moe))/experts/dot_general", "expert kernels"),
    ("matmul", "jit(train_step)/jvp(moe)/router/dot_general", "other"),  # the router's matmul
    ("gather", "jit(train_step)/transpose(jvp(moe))/experts/scatter-add", "permutations / gathers / scatters"),
    ("copy", "jit(train_step)/jvp(moe)/experts/pad", "copies"),
    ("kernel", "jit(train_step)/jvp(attention)/splash_mha_fwd/pallas_call", "attention"),
    ("compute", "jit(train_step)/optimizer/adam/mul", "optimizer"),
    ("matmul", "jit(train_step)/jvp(unembedding_loss)/dot_general", "loss"),
    ("stack", "jit(train_step)/jvp(attention)/while/body/dynamic_update_slice", "residual stacks"),
    ("kernel", "splash_mha_dkv_segmented.3", "attention"),  # a Mosaic kernel without metadata: its name
    ("compute", "", "other"),
])
def test_classify_by_kind_and_innermost_scope(kind, name, category):
    assert classify(kind, name) == category


def test_scope_is_the_innermost_named_scope():
    assert scope_of("jit(train_step)/transpose(jvp(moe))/experts/dot_general") == "experts"
    assert scope_of("jit(train_step)/jvp(decoder)/while/body/add") == ""


def test_categories_sum_exactly_to_the_walked_total():
    b = breakdown(CATEGORY_HLO, n_top=5)
    assert set(b.by_category) == set(CATEGORIES)
    assert sum(b.by_category.values()) == b.total == hbm_bytes(CATEGORY_HLO).total
    assert all(b.by_category[c] > 0 for c in set(CATEGORY_OF.values()))
    assert len(b.top) == 5 and b.top[0].bytes == max(c.total for c in walk(CATEGORY_HLO))
    # the update reads its row (x) and index and writes the row; the slice reads one row and the index
    # and writes it: never the [4, 64, 128] stack
    row = 64 * 128 * 4
    assert b.by_category["residual stacks"] == (2 * row + 4) + (2 * row + 4)
    text = format_breakdown(b)
    assert all(c in text for c in CATEGORIES) and "jvp(moe)/experts/pallas_call" in text


def test_category_row_totals_its_cells():
    row = category_row("100m/s95/smelt", dict.fromkeys(CATEGORIES, 2e9), overflow_worst=9e9)
    assert row.startswith(f"| 100m/s95/smelt | {2 * len(CATEGORIES)} | 2 |") and "2 (9) |" in row


# ------------------------------------------------------------------------------ (a) the overflow loop


def test_the_overflow_loop_is_charged_at_the_trips_asked_and_reported_apart():
    per_pass_body = 3 * 64 * 128 * 4 + 3 * 4  # %grow reads acc twice, writes once; the counter add
    layers, compare = 3, 2 * 4 + 1
    walked = {u: hbm_bytes(OVERFLOW_HLO, overflow_trips=u) for u in (0, 1, 2, 18)}
    assert walked[2].overflow_per_trip == layers * (per_pass_body + compare)
    for u, w in walked.items():
        assert w.total == walked[0].total + u * w.overflow_per_trip
        assert w.by_category[OVERFLOW] == layers * (u * per_pass_body + (u + 1) * compare)
        assert sum(w.by_category.values()) == w.total
    # everything else: the layer loop's tanh and counter, its condition (4 runs), 3 trips known
    assert walked[0].total - walked[0].by_category[OVERFLOW] == 3 * (2 * 64 * 128 * 4 + 12) + 4 * compare
    b = breakdown(OVERFLOW_HLO, overflow_passes=(1, 18))
    assert b.total_worst == walked[18].total


def test_expected_overflow_passes_follow_the_load_and_the_worst_case_holds_every_copy():
    args = dict(tokens_local=16384, top_k=8, experts_local=36, expert_shards=8, slack=1.5)
    # C = 24,576 rows (1.5 x 16,384), C_o = 6,144; the worst case 131,072 rows per destination
    assert overflow_passes(**args, load=1.0) == 0 and overflow_passes(**args, load=1.5) == 0
    assert overflow_passes(**args, load=1.6) == 1  # 26,215 rows: one pass
    assert overflow_passes(**args, load=2.2) == 2  # 36,045 rows
    assert overflow_passes(**args, load=math.inf) == -(-(131072 - 24576) // 6144) == 18
    assert overflow_passes(**{**args, "slack": None}, load=math.inf) == 0  # worst-case buffers: no loop


def test_a_step_expects_the_passes_of_its_layout():
    import experiments

    run = experiments.find_run("smelt16-100m-s95-smelt-b122f12b")  # 16,384 tokens per device, k 8, E_l 36
    # at the default slack 1.5, 9 of the 20 measured loads need one pass (0.45 expected), 18 at worst; at
    # slack 2.5 every one fits the first pass (0 expected, 9 at worst); micro's early load needed 2
    assert step_overflow_passes(run, {"data": 1, "fsdp": 8, "expert": 8, "tensor": 1}) == (0.45, 18)
    assert step_overflow_passes(run, {"data": 1, "fsdp": 8, "expert": 8, "tensor": 1}, loads=(2.2,)) == (2, 18)
    assert step_overflow_passes(dataclasses.replace(run, model=run.model.replace(expert_buffer_slack=2.5)),
                                {"data": 1, "fsdp": 8, "expert": 8, "tensor": 1}) == (0, 9)
    assert step_overflow_passes(run, {"data": 64, "fsdp": 1, "expert": 1, "tensor": 1}) == (1, 1)  # no loop


# ------------------------------------------------------------------------------ (b) on-chip memory


def test_vmem_buffers_are_free_and_a_prefetch_is_charged_its_hbm_read_once():
    array = 128 * 256 * 4
    charges = {c.name: c.bytes for c in walk(VMEM_HLO)}
    # copy-start reads x from HBM; copy-done lands in VMEM; the fusion reads VMEM, writes HBM; the negate
    # reads x and writes VMEM
    assert charges == {"cs": array, "tmp": array, "y": array}
    assert hbm_bytes(VMEM_HLO).total == 3 * array
    assert is_on_chip("f32[128,256]{1,0:T(8,128)S(1)}") and not is_on_chip("f32[8]{0}")


# ------------------------------------------------------------------------------ (c) tile padding


@pytest.mark.parametrize("shape, expected", [
    ("f32[5,100]{1,0:T(8,128)}", 8 * 128 * 4),
    ("f32[100,5]{0,1:T(8,128)}", 8 * 128 * 4),  # dim 0 is minor: it gets the 128 lanes
    ("bf16[20,100]{1,0:T(16,128)}", 32 * 128 * 2),
    ("bf16[20,100]{1,0:T(8,128)(2,1)}", 24 * 128 * 2),
    ("f32[3,5,100]{2,1,0:T(8,128)}", 3 * 8 * 128 * 4),  # leading dims are not padded
    ("s32[196608,1]{0,1:T(1,128)}", 196608 * 4),  # the exchange's per-row ints: dense
    ("f32[1000]{0:T(1024)}", 1024 * 4),
    ("(f32[5,100]{1,0:T(8,128)}, s32[])", 8 * 128 * 4 + 4),
    ("f32[5,100]{1,0}", 5 * 100 * 4),  # no tile: dense
])
def test_tpu_tiles_pad_the_minor_dims(shape, expected):
    assert hbm_shape_bytes(shape) == expected


def test_an_instruction_is_charged_its_padded_operands_and_result():
    text = VMEM_HLO.replace("128,256", "5,100")
    padded = 8 * 128 * 4
    assert hbm_bytes(text).total == 3 * padded


# ------------------------------------------------------------------------------ (d) gathers and scatters


def test_gathers_and_scatters_are_charged_the_rows_they_touch():
    rows, indices, table = 10 * 64 * 4, 10 * 4, 1000 * 64 * 4
    charges = {c.name: c.bytes for c in walk(GATHER_SCATTER_HLO)}
    assert charges["rows"] == 2 * rows + indices  # rows read, indices read, result written
    assert charges["added"] == indices + 2 * rows  # indices and updates read, the rows written
    # the fused scatter into its parameter: indices and updates read, the updated rows written
    assert charges["fs"] == indices + rows + rows
    # the same scatter one fusion deeper (the root a fusion that scatters into the outer parameter)
    assert charges["nfs"] == indices + rows + rows
    assert hbm_bytes(GATHER_SCATTER_HLO).total < table  # never the whole table


# ------------------------------------------------------------------------------ the compile report


def test_the_compile_report_keeps_the_breakdown_and_prints_it_on_request():
    from smelt_jax.compile import report as cr

    base = cr.CompileReport(run_id="r", slice="v5p-128", layout={"data": 1, "fsdp": 8, "expert": 8, "tensor": 1},
                            remat="none", expert_impl="pallas", peak_fits_hbm=True, error=None,
                            compile_seconds=1.0, budget_flops=1e12)
    report = cr.analyse(base, {"dot_general": 64e12}, OVERFLOW_HLO, overflow_passes=(2, 18))
    assert report.hbm_traffic_bytes == hbm_bytes(OVERFLOW_HLO, overflow_trips=2).total
    assert sum(report.hbm_by_category.values()) == report.hbm_traffic_bytes
    assert (report.overflow_passes, report.overflow_passes_worst) == (2, 18)
    assert report.breakdown().total_worst == hbm_bytes(OVERFLOW_HLO, overflow_trips=18).total
    assert report.hbm_top[0]["bytes"] == max(c.total for c in walk(OVERFLOW_HLO, overflow_trips=2))
    assert "HBM walked by category" not in cr.format_report(report)
    text = cr.format_report(report, with_breakdown=True)
    assert "HBM walked by category (MB per device per step" in text
    assert "2 passes per layer expected" in text and "worst case 18 passes" in text
    restored = cr.CompileReport(**{k: v for k, v in report.as_dict().items()
                                   if k not in ("flops_ratio", "program_ratio")})
    assert restored.breakdown() == report.breakdown()  # what the compile report's cache keeps


def test_an_uninitialised_buffer_moves_nothing_and_a_zero_fill_writes_its_size():
    """A scan's output stack allocated without a fill (XLA:TPU's `AllocateBuffer`, model/layer.py
    `distinct_scan_lengths`) is free; the zero fill it replaces writes the whole stack."""
    stack = 6 * 1024 * 256 * 2
    text = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[1024,256]) -> (bf16[6,1024,256], bf16[6,1024,256]) {
  %x = bf16[1024,256]{1,0} parameter(0)
  %zero = bf16[]{:T(256)} constant(0)
  %alloc = bf16[6,1024,256]{2,1,0:T(8,128)(2,1)} custom-call(), custom_call_target="AllocateBuffer", metadata={op_name="broadcast.917"}
  %fill = bf16[6,1024,256]{2,1,0:T(8,128)(2,1)} broadcast(%zero), dimensions={}
  ROOT %t = (bf16[6,1024,256]{2,1,0}, bf16[6,1024,256]{2,1,0}) tuple(%alloc, %fill)
}
"""
    charges = {c.name: c.bytes for c in walk(text)}
    assert charges.get("alloc", 0) == 0 and charges["fill"] == stack + 2  # + the bf16 zero read
    # any other custom-call (a Mosaic kernel) is still charged its operands and result
    kernel = text.replace('custom-call(), custom_call_target="AllocateBuffer"',
                          'custom-call(), custom_call_target="tpu_custom_call"')
    assert {c.name: c.bytes for c in walk(kernel)}["alloc"] == stack

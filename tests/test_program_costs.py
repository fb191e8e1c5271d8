"""Program FLOPs from the jaxpr (loops x trip count) and executed collectives from compiled HLO text,
each against a count made by hand; and the roofline that combines them in the compile report."""

import dataclasses
import math

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from smelt_jax.compile import aot
from smelt_jax.compile import report as cr
from smelt_jax.compile.hbm_traffic import hbm_bytes
from smelt_jax.compile.hlo_module import shape_bytes
from smelt_jax.compile.hlo_stats import hlo_stats
from smelt_jax.compile.program_flops import program_flops
from smelt_jax.model.expert_exchange import buffer_fill
from tests.hlo_samples import SYNTHETIC_HLO

# ------------------------------------------------------------------------------ jaxpr FLOP counter


def _layers(x, w):  # x [b, d], w [layers, d, d]
    @jax.checkpoint
    def layer(h, wi):
        return jnp.tanh(h @ wi), None

    return jax.lax.scan(layer, x, w)[0].sum()


def test_scan_bodies_count_once_per_iteration_and_remat_recomputes_the_forward():
    x, w = jnp.ones((4, 8)), jnp.ones((3, 8, 8))
    one_matmul = 2 * 4 * 8 * 8
    forward = program_flops(jax.make_jaxpr(_layers)(x, w))
    assert forward.total == 3 * one_matmul and forward.unknown_trip_loops == 0
    # gradient: forward, recomputed forward (checkpoint), and two matmuls back per layer
    grads = program_flops(jax.make_jaxpr(jax.grad(_layers, argnums=(0, 1)))(x, w))
    assert grads.total == 4 * 3 * one_matmul


def test_batched_dot_cond_and_while_are_counted():
    a, b = jnp.ones((5, 6, 7)), jnp.ones((5, 7, 3))
    batched = program_flops(jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(a, b))
    assert batched.total == 2 * 5 * 6 * 7 * 3
    m = jnp.ones((8, 8))
    cond = program_flops(jax.make_jaxpr(
        lambda m: jax.lax.cond(m.sum() > 0, lambda v: v @ v @ v, lambda v: v @ v, m))(m))
    assert cond.total == 2 * (2 * 8**3)  # the costlier branch
    loop = program_flops(jax.make_jaxpr(
        lambda m, n: jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ m, c[1] + 1), (m, 0))[0])(m, 5))
    assert loop.total == 2 * 8**3 and loop.unknown_trip_loops == 1  # trip count unknown: once, flagged


def test_ragged_dot_and_its_gradient_count_every_row_once():
    lhs, rhs = jnp.ones((64, 16)), jnp.ones((4, 16, 32))
    sizes = jnp.array([10, 20, 0, 34], jnp.int32)
    f = lambda a, b: jax.lax.ragged_dot(a, b, sizes).sum()
    forward = program_flops(jax.make_jaxpr(f)(lhs, rhs))
    assert forward.by_kind == {"ragged_dot": 2 * 64 * 16 * 32}
    grads = program_flops(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(lhs, rhs))
    assert grads.total == 3 * 2 * 64 * 16 * 32  # forward, d lhs, d rhs (ragged contracting)


def test_pallas_kernels_count_their_cost_estimate_and_shard_map_multiplies_by_shards():
    from smelt_jax.kernels.gmm import gmm

    lhs, rhs = jnp.ones((64, 16)), jnp.ones((4, 16, 32))
    sizes = jnp.array([10, 20, 0, 34], jnp.int32)
    pallas = program_flops(jax.make_jaxpr(lambda a, b: gmm(a, b, sizes, interpret=True))(lhs, rhs))
    assert pallas.by_kind == {"pallas": 2 * 64 * 16 * 32} and pallas.pallas_without_estimate == 0

    assert len(jax.devices()) >= 4, "the suite runs with 8 fake CPU devices (conftest)"
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    sharded = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    counted = program_flops(jax.make_jaxpr(sharded)(jnp.ones((16, 8)), jnp.ones((8, 8))))
    assert counted.total == 2 * 16 * 8 * 8  # 4 shards x [4, 8] @ [8, 8]


def test_buffer_fill_of_the_dropless_exchange():
    assert buffer_fill(top_k=8, n_experts=8, expert_shards=8) == 1.0  # one expert per device
    assert buffer_fill(top_k=8, n_experts=64, expert_shards=8) == 1 / 8  # E/n >= k
    assert buffer_fill(top_k=4, n_experts=16, expert_shards=8) == 4 / (8 * 2)


# ------------------------------------------------------------------------------ HLO text statistics



def test_shape_bytes_sums_tuples_and_ignores_layouts():
    assert shape_bytes("f32[8,4]{1,0:T(8,128)}") == 128
    assert shape_bytes("(bf16[2,3]{1,0}, s32[], /*index=2*/pred[5])") == 12 + 4 + 5


def test_hlo_stats_multiplies_loop_bodies_by_their_trip_count():
    stats = hlo_stats(SYNTHETIC_HLO)
    assert stats.loop_trip_counts == (12,)
    assert stats.collective_counts == {"all-gather": 12, "all-reduce": 12, "all-to-all": 1}
    assert stats.collective_bytes == {"all-gather": 12 * 64, "all-reduce": 12 * 32, "all-to-all": 16}
    assert stats.send_bytes == 12 * 64 + 2 * 12 * 32 + 16  # all-reduce sends twice its size
    assert stats.sparsecore_offloads == 1


# ------------------------------------------------------------------------------ HBM traffic walk


def _cpu_compiled(fn, *shapes):
    return jax.jit(fn).lower(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).compile()


def _xla_bytes(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_walked_hbm_bytes_match_xla_cost_analysis_on_a_loop_free_program(seed):
    # Random sizes: matmuls, a bias + gelu (fused), two reductions and a slice of a result.
    rng = np.random.default_rng(seed)
    b, d, f = (int(v) for v in rng.integers(8, 300, size=3))

    def program(x, w1, w2, bias):
        h = jax.nn.gelu(x @ w1 + bias)
        y = h @ w2
        return jnp.sum(y * y, axis=-1), jnp.max(h, axis=0), y[: b // 2, 1:]

    compiled = _cpu_compiled(program, (b, d), (d, f), (f, d), (f,))
    walked = hbm_bytes(compiled.as_text())
    assert walked.loops == ()
    assert walked.total == pytest.approx(_xla_bytes(compiled), rel=0.02)


def _looped(trips):
    def program(x, w):  # x [128, 96], w [96, 96]: a fori_loop of `trips` matmul + tanh steps
        return jax.lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ w), x)

    return _cpu_compiled(program, (128, 96), (96, 96))


def test_walked_hbm_bytes_multiply_a_fori_loop_body_by_its_trip_count():
    walked = {n: hbm_bytes(_looped(n).as_text()) for n in (2, 3, 9)}
    assert [w.loops for w in walked.values()] == [(2,), (3,), (9,)]
    body = walked[3].total - walked[2].total  # one more iteration
    # the body moves at least what its matmul reads and writes: h, w and the product (f32)
    assert body >= 4 * (128 * 96 + 96 * 96 + 128 * 96)
    assert walked[9].total == pytest.approx(walked[2].total + 7 * body)
    # XLA's own count holds the body once: the walk of a 2-trip loop is one body more than it
    assert walked[2].total - body == pytest.approx(_xla_bytes(_looped(2)), rel=0.02)


MULTILINE_HLO = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  %kernel = f32[256]{0} custom-call(%x), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
  "name": "k"
}}, metadata={op_name="k/pallas_call"}
  %ar = f32[256]{0} all-reduce(%kernel), replica_groups={}, to_apply=%sum
  ROOT %y = f32[256]{0} add(%ar, %x)
}
"""


def test_an_instruction_spanning_lines_does_not_end_its_computation():
    # A Mosaic kernel's metadata spans lines starting with "}": the instructions after it still count.
    sum_computation = ("%sum (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
                       "  %b = f32[] parameter(1)\n  ROOT %c = f32[] add(%a, %b)\n}\n\n")
    text = MULTILINE_HLO.replace("ENTRY", sum_computation + "ENTRY")
    assert hlo_stats(text).collective_counts == {"all-reduce": 1}
    assert hbm_bytes(text).by_op == {"custom-call": 2048.0, "all-reduce": 2048.0, "add": 3072.0}


def test_walk_charges_a_fusion_the_slices_it_reads_and_an_in_place_update_its_update():
    def program(stack, x):  # stack [8, 64, 64]: one layer's slice read, another's updated in place
        layer = jax.lax.dynamic_index_in_dim(stack, 3, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(stack, jnp.tanh(x @ layer), 5, 0)

    compiled = jax.jit(program, donate_argnums=0).lower(
        jax.ShapeDtypeStruct((8, 64, 64), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile()
    walked = hbm_bytes(compiled.as_text()).total
    stack_bytes = 8 * 64 * 64 * 4
    assert walked < stack_bytes  # neither the slice nor the update is charged the whole stack
    assert walked == pytest.approx(_xla_bytes(compiled), rel=0.05)


MULTI_OUTPUT_UPDATE_HLO = """HloModule m, is_scheduled=true

%fused (p0: f32[5,64,128], p1: s32[], p2: f32[64,128], p3: f32[64,128]) -> (f32[5,64,128], f32[64,128]) {
  %p0 = f32[5,64,128]{2,1,0} parameter(0)
  %p2 = f32[64,128]{1,0} parameter(2)
  %p3 = f32[64,128]{1,0} parameter(3)
  %sum = f32[64,128]{1,0} add(%p2, %p3)
  %row = f32[1,64,128]{2,1,0} bitcast(%sum)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %update = f32[5,64,128]{2,1,0} dynamic-update-slice(%p0, %row, %p1, %zero, %zero)
  ROOT %out = (f32[5,64,128]{2,1,0}, f32[64,128]{1,0}) tuple(%update, %sum)
}

ENTRY %main (stack: f32[5,64,128], i: s32[], a: f32[64,128], b: f32[64,128]) -> (f32[5,64,128], f32[64,128]) {
  %stack = f32[5,64,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %a = f32[64,128]{1,0} parameter(2)
  %b = f32[64,128]{1,0} parameter(3)
  ROOT %f = (f32[5,64,128]{2,1,0}, f32[64,128]{1,0}) fusion(%stack, %i, %a, %b), kind=kLoop, calls=%fused
}
"""


def test_walk_charges_a_multi_output_fusion_its_in_place_update_not_the_stack():
    # A scan's stacked residual on TPU: a fusion whose tuple root holds an in-place update of the
    # stack and a second output. It reads a and b, writes the stack's one row and the sum.
    layer = 64 * 128 * 4
    expected = 2 * layer + 4 + layer + layer  # a, b and the index read; the row and the sum written
    assert hbm_bytes(MULTI_OUTPUT_UPDATE_HLO).total == expected
    # the same fusion without the update in place (the root's element a plain copy of the stack) is
    # charged the whole stack read and written
    whole = MULTI_OUTPUT_UPDATE_HLO.replace("tuple(%update, %sum)", "tuple(%p0, %sum)")
    assert hbm_bytes(whole).total == expected - layer + 2 * 5 * layer


@pytest.mark.tpu
@pytest.mark.integration
def test_hlo_stats_on_a_real_tpu_program_with_collectives_in_a_scan():
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    mesh = aot.topology_mesh("v5e:2x2", (4,), ("x",))
    layers = 6

    def f(x, w):  # x [4 * 128, 256] sharded rows; w [layers, 256, 256] sharded columns: gathered per layer
        def layer(h, wi):
            return jnp.tanh(h @ jax.lax.with_sharding_constraint(wi, NamedSharding(mesh, P()))), None
        return jax.lax.scan(layer, x, w)[0]

    x = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((layers, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "x")))
    compiled, summary = aot.compile_for_tpu(f, (x, w), mesh)
    stats = hlo_stats(compiled.as_text())
    assert stats.loop_trip_counts == (layers,)
    assert stats.collective_counts == {"all-gather": layers}  # one gather per layer, executed 6 times
    per_layer = stats.collective_bytes["all-gather"] / layers
    assert per_layer >= 256 * 256 * 4 / 4  # at least the other shards' part of a weight
    program = layers * 2 * 512 * 256 * 256
    assert summary.program_flops == {"dot_general": program}
    # XLA's own count sees the loop body once: one layer's per-device share
    assert summary.flops == pytest.approx(program / 4 / layers, rel=0.05)


@pytest.mark.tpu
@pytest.mark.integration
def test_xla_step_estimate_counts_a_loop_body_once():
    """Why the report does not use `optimal_seconds`: a scan of 8 [4096, 4096] matmuls gets about the
    estimate of one matmul (docs/parallelism.md quotes these two numbers)."""
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    mesh = aot.topology_mesh("v5p:2x2x1", (4,), ("x",))
    a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    _, one = aot.compile_for_tpu(lambda m: m @ m, (a,), mesh)
    _, eight = aot.compile_for_tpu(
        lambda m: jax.lax.scan(lambda c, _: (jnp.tanh(c @ m), None), m, None, length=8)[0], (a,), mesh)
    print(f"optimal_seconds: one matmul {one.optimal_seconds:.3g}, scan of 8 {eight.optimal_seconds:.3g}")
    assert eight.program_flops == {"dot_general": 8 * 2 * 4096**3}
    assert eight.flops < 1.01 * one.flops  # the body's FLOPs once
    assert one.optimal_seconds < eight.optimal_seconds < 2 * one.optimal_seconds


# ------------------------------------------------------------------------------ roofline in the report


def _report(**fields):
    base = dict(run_id="r", slice="v5p-128", layout={"data": 1, "fsdp": 8, "expert": 8, "tensor": 1},
                remat="full", expert_impl="pallas", peak_fits_hbm=True, error=None, compile_seconds=1.0,
                budget_flops=100e12)
    return cr.CompileReport(**{**base, **fields})


def test_analyse_takes_the_larger_of_compute_and_communication():
    chips = 64
    by_kind = {"dot_general": chips * 150e12, "pallas": chips * 400e12}
    report = cr.analyse(_report(), by_kind, SYNTHETIC_HLO, pallas_fill=0.125)
    assert report.program_flops == pytest.approx(150e12 + 50e12)  # Pallas at its filled rows
    assert report.program_ratio == pytest.approx(2.0)
    assert report.compute_seconds == pytest.approx(200e12 / 459e12)
    assert report.comm_seconds == pytest.approx((12 * 64 + 2 * 12 * 32 + 16) / 600e9)
    assert report.comm_seconds_ragged == pytest.approx((12 * 64 + 2 * 12 * 32 + 16 * 0.125) / 600e9)
    # the all-to-all is synchronous: exposed, after the compute-bound max
    assert report.exchange_exposed_seconds == pytest.approx(16 / 600e9)
    assert report.step_seconds == pytest.approx(report.compute_seconds + 16 / 600e9)
    assert report.dominant_term == "compute"
    assert report.hbm_traffic_bytes > 0 and report.hbm_seconds == pytest.approx(report.hbm_traffic_bytes / 2765e9)
    assert report.mfu == pytest.approx(100e12 / (report.step_seconds * 459e12))
    assert report.sparsecore_offloads == 1
    assert math.isclose(report.as_dict()["program_ratio"], 2.0)
    ragged_hlo = SYNTHETIC_HLO.replace("all-to-all(%x.0)", "ragged-all-to-all(%x.0)")
    ragged = cr.analyse(_report(), by_kind, ragged_hlo, pallas_fill=0.125)
    assert ragged.send_bytes == pytest.approx(12 * 64 + 2 * 12 * 32 + 16 * 0.125)  # filled rows only
    assert ragged.comm_seconds_ragged is None
    bare = cr.analyse(_report(), by_kind, None)
    assert bare.step_seconds is None and bare.mfu is None  # no collectives known: no roofline claimed



def test_the_roofline_is_the_largest_term_plus_the_exposed_exchange():
    base = dict(compute_seconds=1.0, hbm_seconds=3.0, comm_seconds=2.5, budget_flops=459e12)
    hbm_bound = dataclasses.replace(_report(), **base, exchange_exposed_seconds=0.5)
    assert cr.roofline_terms(hbm_bound) == (3.5, "HBM")  # ICI 2.0 overlapped, exchange 0.5 after
    exchange_bound = dataclasses.replace(_report(), **{**base, "comm_seconds": 12.0}, exchange_exposed_seconds=10.0)
    assert cr.roofline_terms(exchange_bound) == (13.0, "exchange")
    assert cr.roofline_terms(dataclasses.replace(_report(), compute_seconds=1.0)) is None


def test_an_async_exchange_with_compute_between_start_and_done_is_overlapped():
    sync = hlo_stats(SYNTHETIC_HLO)
    assert sync.exchange_exposed_bytes == 16  # the synchronous all-to-all
    overlapped = SYNTHETIC_HLO.replace(
        "  %a2a = bf16[2,4]{1,0} all-to-all(%x.0), dimensions={0}\n",
        "  %a2as = (f32[8]{0}, bf16[2,4]{1,0}) all-to-all-start(%x.0), dimensions={0}, replica_groups=[16,4]<=[64]\n"
        "  %f = f32[8]{0} fusion(%x.0), kind=kLoop, calls=%sum\n"
        "  %a2a = bf16[2,4]{1,0} all-to-all-done(%a2as)\n")
    stats = hlo_stats(overlapped)
    assert stats.collective_bytes["all-to-all"] == 16 and stats.exchange_exposed_bytes == 0
    assert ("all-to-all", 4, 16.0) in stats.send_bytes_by_group
    back_to_back = overlapped.replace("  %f = f32[8]{0} fusion(%x.0), kind=kLoop, calls=%sum\n", "")
    assert hlo_stats(back_to_back).exchange_exposed_bytes == 16  # nothing runs while it is in flight


def test_conventional_flops_add_the_lm_head_and_causal_attention():
    import experiments

    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    cfg = run.model
    per_token = cr.conventional_train_flops(cfg, 1.0)
    from smelt_jax.design import budget

    six_n = budget.train_flops_per_token(cfg, attended_keys=0)
    head = 6 * cfg.d_model * cfg.vocab
    attention = 12 * cfg.executed_layers * cfg.n_heads * cfg.head_dim * cfg.seq_len / 2
    assert per_token == pytest.approx(six_n + head + attention)


def test_splash_flops_are_not_scaled_by_the_expert_buffer_fill():
    """The fill is the share of the expert kernels' rows that carry tokens; splash runs what it counts."""
    assert cr.executed_flops({"pallas": 800.0, "splash": 100.0, "dot_general": 10.0}, 0.125) == 210.0


def test_the_window_term_counts_the_keys_the_tpu_attention_executes():
    """On TPU (splash, 4096 keys in blocks of 512) the attention executes as much as a dense one over
    2688 keys (kernels.splash.dense_equivalent_keys); the reference scores all 4096."""
    from smelt_jax.design import budget as budget_lib
    from smelt_jax.design.config import ModelConfig

    cfg = ModelConfig(vocab=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                      n_experts=8, top_k=2, expert_ffn=128, seq_len=4096)
    per_key = 12 * cfg.executed_layers * cfg.q_width  # train FLOPs per token and attended key
    tokens = 1000.0
    budget = budget_lib.train_flops_per_token(cfg) * tokens
    splash_terms = cr.flop_accounting(cfg, tokens, 3 * budget, 2 * budget)
    assert splash_terms["attention_window"] == pytest.approx(per_key * (2688 - 400) * tokens)
    reference = cfg.replace(attention_impl="reference")
    reference_terms = cr.flop_accounting(reference, tokens, 3 * budget, 2 * budget)
    assert reference_terms["attention_window"] == pytest.approx(per_key * (4096 - 400) * tokens)
    for terms in (splash_terms, reference_terms):
        assert sum(terms.values()) == pytest.approx(3 * budget)


def test_the_fused_loss_kernels_count_apart_from_the_expert_kernels():
    """The fused cross-entropy's kernels (every row a token) are not scaled by the expert kernels' fill
    (issue 50: they were booked as "pallas" and multiplied by it)."""
    from smelt_jax.kernels import fused_ce

    h, w = jnp.ones((64, 24)), jnp.ones((24, 256))
    targets = jnp.zeros((64,), jnp.int32)
    tiles = fused_ce.Tiles(32, 128, 16, 128, 1, bwd_sub=128)
    counted = program_flops(jax.make_jaxpr(lambda h, w: fused_ce.token_stats(h, w, targets, tiles=tiles))(h, w))
    assert set(counted.by_kind) == {"fused_ce"} and counted.by_kind["fused_ce"] >= 2 * 64 * 24 * 256
    assert cr.executed_flops({**counted.by_kind, "pallas": 800.0}, 0.125) == counted.by_kind["fused_ce"] + 100.0

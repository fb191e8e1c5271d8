"""The ideal train step (compile/ideal_step.py, issue 50 item 1) on configurations small enough to count by
hand: every dimension 128 (one MXU tile), so padding only touches the router's one column and causal
attention's diagonal block. Bytes: activations and gathered weights bf16 (2 B), gradients f32 (4 B)."""

import pytest

from smelt_jax.compile.ideal_step import OPTIMIZER_BYTES, ideal_step, layer_visits, local_parameters, trained_gemm
from smelt_jax.compile.walk_categories import CATEGORIES
from smelt_jax.design.config import ModelConfig

TINY = ModelConfig(vocab=256, d_model=128, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=128, n_experts=1,
                   top_k=1, expert_ffn=128, seq_len=128, compute_dtype="bfloat16")
ONE_DEVICE = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}

# Per op, by hand (T = 128 tokens, d = q = kv = f = 128, V = 256, one expert, top-1):
#   qkv   [128,128]x[128,384]: fwd (16384 + 49152 + 49152) x 2 = 229,376; dX the same; dW (16384 + 49152) x 2
#         + 49152 x 4 = 327,680                                                        -> 786,432 B
#   o     [128,128]x[128,128]: fwd 3 x 16384 x 2 = 98,304; dX 98,304; dW 65,536 + 65,536 -> 327,680 B
#   flash fwd: Q, K, V, O 4 x 32,768 + lse 128 x 4 = 131,584; bwd Q K V O dO + dQ dK dV 8 x 32,768 + 512
#         = 262,656                                                                      -> 394,240 B
#   router [128,128]x[128,1] (f32 logits): fwd 32,768 + 256 + 512; dX the same; dW 32,768 + 512 + 512
#         -> 100,864 B; its outputs (normed tokens 32,768 + ids and weights 128 x 8)  -> 33,792 B
#   gate/up [128,128]x[128,256]: fwd 32,768 + 65,536 + 65,536; dX the same; dW 32,768 + 65,536 + 131,072
#         -> 557,056 B
#   down  (reads gate, up [128,256] = 65,536) x [128,128]: fwd 65,536 + 32,768 + 32,768 = 131,072;
#         dX dY 32,768 + W 32,768 + gate/up 65,536 + d(gate, up) 65,536 = 196,608; dW 65,536 + 32,768
#         + 65,536 = 163,840                                                             -> 491,520 B
#   combine fwd + bwd 2 x (32,768 + 32,768)                                              -> 131,072 B
#   residual adds 2 x 2 x 32,768; norm backward 2 x 4 x 32,768                           -> 393,216 B
#   embedding gather 2 x 32,768 + 512; scatter 32,768 + 512 + 256 x 128 x 4              -> 230,400 B
#   loss h 32,768 + W 65,536 + labels 512 + dh 32,768 + dW 131,072 + loss 512         -> 263,168 B
#   final norm backward 4 x 32,768                                                       -> 131,072 B
#   AdamW 30 B x 180,736 parameters (attention 65,536, norms 256, router 128, expert 49,152, final norm
#         128, embeddings 65,536)                                                        -> 5,422,080 B
TINY_BYTES = 9_262_592
# FLOPs: qkv 3 x 2 x 128 x 128 x 384 = 37,748,736; o 12,582,912; flash (4 + 10) x 128 x 128 x 64.5 keys
# = 14,794,752; router 98,304; gate/up 25,165,824; down 12,582,912; loss 6 x 128 x 128 x 256 = 25,165,824
TINY_FLOPS = 128_139_264


def test_a_one_layer_model_on_one_device_counts_what_the_hand_counts():
    ideal = ideal_step(TINY, 128, ONE_DEVICE, "v5p-8")
    assert ideal.hbm_bytes == TINY_BYTES
    assert ideal.flops == TINY_FLOPS
    assert local_parameters(TINY, ONE_DEVICE) == 180_736
    assert ideal.by_category["optimizer"] == OPTIMIZER_BYTES * 180_736
    assert ideal.by_category["attention"] == 786_432 + 327_680 + 394_240
    assert ideal.by_category["expert kernels"] == 557_056 + 491_520
    assert ideal.by_category["loss"] == 263_168
    assert set(ideal.by_category) == set(CATEGORIES)
    assert sum(ideal.by_category.values()) == ideal.hbm_bytes
    assert ideal.ici_seconds == 0.0  # one device: no collective


def test_the_floor_overlaps_everything_and_the_per_op_limit_pads_and_adds():
    ideal = ideal_step(TINY, 128, ONE_DEVICE, "v5p-8")
    peak, hbm = 459e12, 2765e9
    assert ideal.floor_seconds == pytest.approx(max(TINY_FLOPS / peak, TINY_BYTES / hbm))
    # padded: the router's 1 column computes as 128 (3 x 4,194,304 FLOPs); causal attention runs its one
    # 128 x 128 block whole: 128 keys, not 64.5 (14 x 128 x 128 x 128)
    padded = TINY_FLOPS - 98_304 + 3 * 4_194_304 - 14_794_752 + 14 * 128 * 128 * 128
    assert sum(op.padded_flops for op in ideal.ops) == padded
    by_hand = sum(max(op.padded_flops / peak, op.hbm_bytes / hbm) for op in ideal.ops)
    assert ideal.per_op_seconds == pytest.approx(by_hand)
    # at this size every op waits on HBM (arithmetic intensity < 166 FLOP/B), so no overlap costs nothing
    assert all(op.padded_flops / peak <= op.hbm_bytes / hbm for op in ideal.ops)
    assert ideal.per_op_seconds == pytest.approx(ideal.floor_seconds)
    wide = ideal_step(TINY.replace(d_model=1024, expert_ffn=1024), 8192, ONE_DEVICE, "v5p-8")
    assert wide.per_op_seconds > 1.05 * wide.floor_seconds  # compute-bound GEMMs beside HBM-bound ops add up


def test_a_looped_weight_reads_its_gradient_back_once_per_extra_visit():
    # [m=128, k=128] x [128, 128], two visits: each visit's three GEMMs, and dW (65,536 B) read back once
    once = sum(op.hbm_bytes for op in trained_gemm("w", "other", 128, 128, 128))
    twice = sum(op.hbm_bytes for op in trained_gemm("w", "other", 128, 128, 128, visits=2, dw_rereads=1))
    assert once == 327_680 and twice == 2 * 327_680 + 128 * 128 * 4
    looped = TINY.replace(n_layers=3, loop_start=1, loop_length=1, loop_repeats=2)
    assert layer_visits(looped) == {0: 1, 1: 2, 2: 1}


def test_the_ring_and_fsdp_send_n_minus_one_over_n():
    # 4 devices: fsdp 2 x expert 2; 512 tokens -> 128 per device; two experts, one per device
    model = TINY.replace(n_experts=2)
    ideal = ideal_step(model, 512, {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}, "v5p-8")
    sent = {op.name: op.ici_bytes for op in ideal.ops if op.ici_bytes}
    # the ring gathers [2 x 128, 128] bf16 = 65,536 B and sends half of it; four collectives per layer
    assert sent["ring all-gather (tokens)"] == 32_768
    assert sum(v for k, v in sent.items() if k.startswith("ring")) == 4 * 32_768
    # the embedding [256, 128]: all-gather in bf16 (65,536 B), gradient reduce-scatter in f32, half sent
    assert sent["embedding all-gather"] == 32_768 and sent["embedding reduce-scatter"] == 65_536
    # a group of 2 chips on v5p-8 (2x2x1) spans one torus axis: 200 GB/s
    ring = [ici for op, ici in zip(ideal.ops, ideal.ici_seconds_by_op) if op.name == "ring all-gather (tokens)"]
    assert ring == [pytest.approx(32_768 / 200e9)]


def test_the_breakdown_prints_walked_beside_ideal_and_the_member_against_its_limit():
    from smelt_jax.compile import report as cr
    from smelt_jax.compile.breakdown import Breakdown, format_breakdown

    ideal = ideal_step(TINY, 128, ONE_DEVICE, "v5p-8")
    walked = {c: 2 * b for c, b in ideal.by_category.items()}  # a program at twice the ideal everywhere
    walked["copies"] = 1e6
    b = Breakdown(total=sum(walked.values()), by_category=walked, overflow_per_trip=0.0, overflow_passes=0,
                  overflow_passes_worst=0, top=())
    text = format_breakdown(b, ideal.by_category)
    assert f"ideal total {ideal.hbm_bytes / 1e6:,.1f}" in text
    optimizer = next(line for line in text.splitlines() if line.strip().startswith("optimizer"))
    assert f"ideal {ideal.by_category['optimizer'] / 1e6:>8,.1f}  x2.0" in optimizer
    report = cr.CompileReport(run_id="r", slice="v5p-8", layout=ONE_DEVICE, remat="none", expert_impl="pallas",
                              peak_fits_hbm=True, error=None, compile_seconds=1.0, step_seconds=2 * ideal.per_op_seconds,
                              compute_seconds=0.0, hbm_seconds=0.0, comm_seconds=0.0)
    lines = cr.format_report(report, ideal=ideal)
    assert f"floor {1e3 * ideal.floor_seconds:.1f} ms" in lines
    assert "efficiency: per-op limit / roofline step = 50%" in lines

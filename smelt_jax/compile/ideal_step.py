"""The physical limit of one train step: the least HBM traffic, ICI traffic and FLOPs a device needs.

    ideal = ideal_step(cfg, tokens_per_step, layout={"data": 1, "fsdp": 8, "expert": 8, "tensor": 1},
                       slice_name="v5p-128")
    ideal.by_category    # {walk category: bytes per device per step}, the walk's names (walk_categories)
    ideal.floor_seconds  # max(FLOPs / peak, HBM bytes / bandwidth, ICI seconds): perfect overlap
    ideal.per_op_seconds # sum over ops of max(op's padded FLOPs / peak, op's bytes / bandwidth, op's ICI)

A list of ops (`Op`), each reading its inputs from HBM and writing its outputs there exactly once, per
device, for a train step with remat none. Assumptions (docs/roofline.md, "The physical limit"):

- activations and the gathered weights in bf16 (2 B); gradients and the optimizer in f32; norms, RoPE,
  residual adds and the SwiGLU product fused into the GEMMs next to them (their bytes are the GEMMs'
  inputs and outputs; a fused residual reads the branch's output and writes the new stream);
- every GEMM Y = X W trains as three: Y (read X, W; write Y), dX (read dY, W; write dX), dW (read X, dY;
  write dW in f32); a weight a looped model visits v times reads its dW back v - 1 times;
- flash attention: Q, K, V read and O (+ the f32 log-sum-exp) written once forward; Q, K, V, O, dO read
  and dQ, dK, dV written once backward; GQA reads each K / V head once for its group; causal, every key
  at or before the query (S/2 on average: document masks are data, a kernel cannot skip them ahead);
  FLOPs 4 (forward) + 10 (backward, the scores recomputed) x q_width x keys per token;
- MoE: the ring exchange (all-gather of the normed tokens over the expert axis, reduce-scatter of the
  partial sums; their transposes backward), each device's experts see top_k x T rows at the balanced
  (expected) load, gathered in the kernels' prologue; the gate/up kernel writes [rows, 2f], the down
  kernel reads it (SwiGLU in its prologue) and writes weighted rows; a combine scatters them into the
  [n T, d] partial sums (and backward scatters the rows' input gradients); the router's gradient inside
  the down kernel's backward;
- the loss: a fused linear cross-entropy (logits, their gradient, dh and dW_unembedding in one pass:
  6 T d V FLOPs, no logits in HBM); the embedding a row gather forward, a scatter into its f32 gradient
  backward;
- AdamW at OPTIMIZER_BYTES per local parameter (f32 parameter, gradient, two moments read; parameter
  and moments written; a bf16 copy written for the gathers);
- collectives: FSDP all-gathers of every weight once per step in bf16 and reduce-scatters of the
  gradients in f32, each sending (g-1)/g of the whole over a group of g (a ring); an all-reduce of the
  gradient shards over `data` when it is > 1; the ring exchange (n-1)/n of the gathered array;
- the per-op limit pads every matmul dimension to MXU (128) multiples (head_dim 72 computes as 128,
  every expert's rows as whole 128-row tiles, causal attention in 128 x 128 blocks) and adds the ops'
  max(compute, HBM) times with no overlap between them, the collectives' ICI behind compute (never
  below the floor); the floor takes the unpadded FLOPs and overlaps everything, ICI included.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from smelt_jax.compile.walk_categories import CATEGORIES
from smelt_jax.design import budget as budget_lib
from smelt_jax.platform.hardware import parse_slice

MXU = 128  # the systolic array's width: matmul dimensions pad to its multiples
OPTIMIZER_BYTES = 30.0  # AdamW per local parameter: read p, g, m, v (16 B f32); write p, m, v (12); bf16 copy (2)
ACT, GRAD = 2.0, 4.0  # bytes of an activation / gathered weight (bf16), of a gradient (f32)
COLLECTIVES, EXPERT_KERNELS, ATTENTION, OTHER = "other collectives", "expert kernels", "attention", "other"
PERMUTATIONS = "permutations / gathers / scatters"


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the ideal step, per device: FLOPs (and padded to the MXU), HBM bytes, ICI bytes sent."""

    name: str
    category: str  # a walk category (walk_categories.CATEGORIES)
    flops: float = 0.0
    padded_flops: float = 0.0
    hbm_bytes: float = 0.0
    ici_bytes: float = 0.0
    group: int = 1  # devices in the collective's group (ICI bandwidth: hardware.Slice)


@dataclasses.dataclass(frozen=True)
class IdealStep:
    ops: tuple[Op, ...]
    peak_flops: float
    hbm_bytes_per_second: float
    ici_seconds_by_op: tuple[float, ...]  # per op: ICI bytes / the bandwidth of its group's torus axes

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def hbm_bytes(self) -> float:
        return sum(op.hbm_bytes for op in self.ops)

    @property
    def by_category(self) -> dict[str, float]:
        """HBM bytes by walk category (every category present, zeros included)."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for op in self.ops:
            out[op.category] += op.hbm_bytes
        return out

    @property
    def compute_seconds(self) -> float:
        return self.flops / self.peak_flops

    @property
    def hbm_seconds(self) -> float:
        return self.hbm_bytes / self.hbm_bytes_per_second

    @property
    def ici_seconds(self) -> float:
        return sum(self.ici_seconds_by_op)

    @property
    def floor_seconds(self) -> float:
        """max(compute, HBM, ICI) over the whole step: every op overlapped with every other."""
        return max(self.compute_seconds, self.hbm_seconds, self.ici_seconds)

    @property
    def per_op_seconds(self) -> float:
        """Sum over ops of max(padded FLOPs / peak, HBM bytes / bandwidth), no overlap between ops; the
        collectives' ICI time runs behind compute (a chunked ring, prefetched FSDP gathers) and enters
        only as a bound: never below the floor."""
        ops = sum(max(op.padded_flops / self.peak_flops, op.hbm_bytes / self.hbm_bytes_per_second)
                  for op in self.ops)
        return max(ops, self.floor_seconds)

    @property
    def exchange_ici_seconds(self) -> float:
        """ICI seconds of the ring exchange alone (what the limit would add if it stayed exposed)."""
        return sum(ici for op, ici in zip(self.ops, self.ici_seconds_by_op, strict=True) if op.name.startswith("ring"))

    def summary(self) -> dict[str, float]:
        return {"flops": self.flops, "hbm_bytes": self.hbm_bytes, "ici_seconds": self.ici_seconds,
                "exchange_ici_seconds": self.exchange_ici_seconds,
                "compute_seconds": self.compute_seconds, "hbm_seconds": self.hbm_seconds,
                "floor_seconds": self.floor_seconds, "per_op_seconds": self.per_op_seconds}


def pad(n: float, to: int = MXU) -> float:
    """`n` rounded up to a multiple of `to` (0 stays 0)."""
    return math.ceil(n / to) * to if n > 0 else 0.0


def trained_gemm(name: str, category: str, m: float, k: int, n: int, *, padded_m: float | None = None,
                 weights: float = 1.0, x_read: float | None = None, out_bytes: float = ACT,
                 dx_write: float | None = None, dw_rereads: int = 0, visits: int = 1) -> list[Op]:
    """The three GEMMs of training Y[m, n] = X[m, k] W[k, n] (`weights` such matrices, e.g. a device's
    experts, the rows `m` split among them), `visits` times:
    forward reads X, W and writes Y; dX reads dY, W and writes dX; dW reads X, dY and writes dW (f32),
    and reads it back `dw_rereads` times (a looped weight's accumulation). `x_read`: bytes of reading
    X when it is not [m, k] bf16 (the down kernel reads [m, 2f] and forms SwiGLU in its prologue);
    `dx_write`: bytes dX writes when not [m, k] bf16 (the down kernel's backward writes d(gate, up)
    [m, 2f], reading gate and up, `x_read`, again for SwiGLU's derivative)."""
    x = m * k * ACT if x_read is None else x_read
    w = weights * k * n * ACT
    y, dy = m * n * out_bytes, m * n * out_bytes
    flops = 2.0 * m * k * n
    padded = 2.0 * pad(m if padded_m is None else padded_m) * pad(k) * pad(n) * (weights if padded_m else 1)
    dw = weights * k * n * GRAD
    dx = m * k * ACT if dx_write is None else dx_write + x
    return [Op(f"{name} forward", category, visits * flops, visits * padded, visits * (x + w + y)),
            Op(f"{name} dX", category, visits * flops, visits * padded, visits * (dy + w + dx)),
            Op(f"{name} dW", category, visits * flops, visits * padded, visits * (x + dy + dw) + dw_rereads * dw)]


def _collective(name: str, whole_bytes: float, group: int, read: float, write: float) -> list[Op]:
    """A ring collective over `group` devices moving an array of `whole_bytes` (the gathered or
    scattered whole): it sends (g-1)/g of it; HBM: `read` + `write` bytes."""
    if group <= 1:
        return []
    return [Op(name, COLLECTIVES, hbm_bytes=read + write, ici_bytes=whole_bytes * (group - 1) / group,
               group=group)]


def _fsdp(name: str, params: float, group: int) -> list[Op]:
    """All-gather of a weight of `params` entries (bf16) and reduce-scatter of its gradient (f32) over
    the FSDP group, once per step whatever the visits (the gathered copy is kept for them)."""
    return (_collective(f"{name} all-gather", params * ACT, group, params / group * ACT, params * ACT)
            + _collective(f"{name} reduce-scatter", params * GRAD, group, params * GRAD, params / group * GRAD))


def _attention(cfg, t: float, visits: int, rereads: int) -> list[Op]:
    """QKV and O projections (trained GEMMs) and flash attention, forward and backward, `visits` times."""
    d, q, kv = cfg.d_model, cfg.q_width, cfg.kv_width
    ops = trained_gemm("qkv projection", ATTENTION, t, d, q + 2 * kv, visits=visits, dw_rereads=rereads)
    ops += trained_gemm("output projection", ATTENTION, t, q, d, visits=visits, dw_rereads=rereads)
    keys = (cfg.seq_len + 1) / 2  # causal: a query meets the keys at or before it
    padded_keys = (cfg.seq_len / MXU + 1) / 2 * MXU  # whole 128 x 128 blocks on and below the diagonal
    padded_width = cfg.n_heads * pad(cfg.head_dim)
    qo, kv_bytes, lse = t * q * ACT, t * kv * ACT, t * cfg.n_heads * GRAD
    ops.append(Op("flash attention forward", ATTENTION, visits * 4 * t * q * keys,
                  visits * 4 * t * padded_width * padded_keys, visits * (qo + 2 * kv_bytes + qo + lse)))
    ops.append(Op("flash attention backward", ATTENTION, visits * 10 * t * q * keys,
                  visits * 10 * t * padded_width * padded_keys,
                  visits * (3 * qo + 2 * kv_bytes + lse + qo + 2 * kv_bytes)))
    return ops


def _moe(cfg, t: float, layout: dict[str, int], visits: int, rereads: int) -> list[Op]:
    """Router, ring exchange, expert kernels at the expected load and the combine, `visits` times.
    t: tokens per device; rows per device = top_k x t, over its n_experts / expert experts."""
    d, f, n = cfg.d_model, cfg.expert_ffn, layout.get("expert", 1)
    local = cfg.n_experts / n
    rows = cfg.top_k * t
    padded_rows = local * pad(rows / local)  # each expert's rows in whole MXU tiles
    ops = trained_gemm("router", OTHER, t, d, cfg.n_experts, out_bytes=GRAD, visits=visits, dw_rereads=rereads)
    ops.append(Op("router outputs (normed tokens, top-k ids and weights)", OTHER,
                  hbm_bytes=visits * (t * d * ACT + t * cfg.top_k * 8)))
    ops += trained_gemm("expert gate/up", EXPERT_KERNELS, rows, d, 2 * f, padded_m=padded_rows / local,
                        weights=local, visits=visits, dw_rereads=rereads)
    ops += trained_gemm("expert down", EXPERT_KERNELS, rows, f, d, padded_m=padded_rows / local, weights=local,
                        x_read=rows * 2 * f * ACT, dx_write=rows * 2 * f * ACT, visits=visits, dw_rereads=rereads)
    gathered = n * t * d * ACT  # the [n t, d] tokens (partial sums) of the ring
    ops.append(Op("combine (weighted rows into the partial sums)", PERMUTATIONS,
                  hbm_bytes=visits * (rows * d * ACT + gathered)))
    ops.append(Op("combine backward (row gradients into the token gradients)", PERMUTATIONS,
                  hbm_bytes=visits * (rows * d * ACT + gathered)))
    own = t * d * ACT
    for name in ("ring all-gather (tokens)", "ring reduce-scatter (partial sums)",
                 "ring all-gather (output gradients)", "ring reduce-scatter (input gradients)"):
        ops += [dataclasses.replace(op, hbm_bytes=visits * op.hbm_bytes, ici_bytes=visits * op.ici_bytes)
                for op in _collective(name, gathered, n, own, gathered)]
    return ops


def _blocks(cfg, t: float, visits: int) -> list[Op]:
    """The fused residual adds forward (read the branch's output, write the stream) and the norm
    backward with the residual gradient (read d(normed), x, the upstream gradient; write dx), per block."""
    stream = t * cfg.d_model * ACT
    return [Op("residual adds", OTHER, hbm_bytes=visits * 2 * 2 * stream),
            Op("norm + residual backward", OTHER, hbm_bytes=visits * 2 * 4 * stream)]


def layer_visits(cfg) -> dict[int, int]:
    """{physical layer: times a token visits it} (a looped block's layers loop_repeats times)."""
    visits: dict[int, int] = defaultdict(int)
    for layer, _ in cfg.execution_order():
        visits[layer] += 1
    return dict(visits)


def local_parameters(cfg, layout: dict[str, int]) -> float:
    """Parameters a device holds: dense weights over `fsdp`, the experts over `fsdp` x `expert`
    (sharding.LOGICAL_AXIS_RULES: embed -> fsdp, experts -> expert; tensor 1)."""
    fsdp, expert = layout.get("fsdp", 1), layout.get("expert", 1)
    experts = cfg.n_layers * cfg.n_experts * budget_lib.expert_params(cfg)
    dense = budget_lib.params_total(cfg) - experts + budget_lib.params_embedding(cfg)
    return dense / fsdp + experts / (fsdp * expert)


def ideal_ops(cfg, tokens_per_step: int, layout: dict[str, int]) -> list[Op]:
    """Every op of one ideal train step of `cfg`, per device (module docstring)."""
    devices = math.prod(layout.get(axis, 1) for axis in ("data", "fsdp", "expert", "tensor"))
    t = tokens_per_step / devices
    d, vocab, fsdp = cfg.d_model, cfg.vocab, layout.get("fsdp", 1)
    ops = [Op("embedding gather", PERMUTATIONS, hbm_bytes=t * d * ACT * 2 + t * 4),
           Op("embedding scatter into its gradient", PERMUTATIONS, hbm_bytes=t * d * ACT + t * 4 + vocab * d * GRAD),
           Op("fused linear cross-entropy", "loss", 6.0 * t * d * vocab, 6.0 * pad(t) * pad(d) * pad(vocab),
              t * d * ACT + d * vocab * ACT + t * 4 + t * d * ACT + d * vocab * GRAD + t * 4),
           Op("final norm backward", OTHER, hbm_bytes=4 * t * d * ACT)]
    ops += _fsdp("embedding", vocab * d, fsdp) + _fsdp("unembedding", vocab * d, fsdp)
    local_experts = cfg.n_experts / layout.get("expert", 1)
    for visits in layer_visits(cfg).values():
        ops += _attention(cfg, t, visits, visits - 1) + _moe(cfg, t, layout, visits, visits - 1)
        ops += _blocks(cfg, t, visits)
        dense = budget_lib.attention_params(cfg) + budget_lib.router_params(cfg)
        ops += _fsdp("layer weights", dense, fsdp)
        ops += _fsdp("layer experts", local_experts * budget_lib.expert_params(cfg), fsdp)
    local = local_parameters(cfg, layout)
    ops.append(Op("AdamW", "optimizer", hbm_bytes=OPTIMIZER_BYTES * local))
    ops += [dataclasses.replace(op, name="gradient all-reduce over data", ici_bytes=2 * op.ici_bytes)
            for op in _collective("gradients", local * GRAD, layout.get("data", 1), 2 * local * GRAD, 2 * local * GRAD)]
    return ops


def ideal_step(cfg, tokens_per_step: int, layout: dict[str, int], slice_name: str) -> IdealStep:
    """The ideal step of `cfg` at `tokens_per_step` on `slice_name` with mesh sizes `layout`."""
    tpu = parse_slice(slice_name)
    ops = tuple(ideal_ops(cfg, tokens_per_step, layout))
    ici = tuple(op.ici_bytes / tpu.ici_bytes_per_second_for_group(op.group) if op.ici_bytes else 0.0
                for op in ops)
    return IdealStep(ops, tpu.peak_flops, tpu.hbm_bytes_per_second, ici)


def for_run(run, slice_name: str, layout: dict[str, int]) -> IdealStep:
    """`ideal_step` of a RunSpec (its model and tokens per step)."""
    return ideal_step(run.model, run.schedule.tokens_per_step, layout, slice_name)

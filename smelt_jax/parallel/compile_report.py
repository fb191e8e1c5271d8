"""Ahead-of-time compilation of a run's real train step for a TPU slice, from this CPU machine.

`compile_run(run, "v5p-128", layout)` builds the slice's compile-only devices (`smelt_jax.aot`), a
mesh over them from the layout, and compiles `train_step(params, opt_state, batch, lr)` with the
shardings the trainer uses. The report: per-device memory (arguments, temporaries, outputs, peak vs
the chip's HBM), per-device compiled FLOPs next to the budget's per-device share, the collectives in
the program, the compiler's step-time estimate and the MFU it implies. A layout that does not fit
comes back with `fits=False` and the compiler's message, not as an exception.

Caveats (docs/parallelism.md): Pallas kernels contribute only their `cost_estimate` to the compiled
FLOPs, remat recomputation and the logits are in the program but not the budget, so `flops_ratio` is
a consistency check; the step-time estimate (`optimal_seconds`) has come back negative for these
programs, and then no MFU is given. Memory is the compiler's buffer assignment for the real program.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax

from smelt_jax import aot, sharding
from smelt_jax import budget as budget_lib
from smelt_jax.descriptors import Parallelism, RunSpec

# Per chip: HBM bytes and dense bf16 peak FLOP/s (vendor data sheets).
CHIPS = {
    "v4": {"hbm": 32 * 2**30, "peak": 275e12, "cores_per_chip": 2},
    "v5e": {"hbm": 16 * 2**30, "peak": 197e12, "cores_per_chip": 1},
    "v5p": {"hbm": 95 * 2**30, "peak": 459e12, "cores_per_chip": 2},
    "v6e": {"hbm": 32 * 2**30, "peak": 918e12, "cores_per_chip": 1},
}
# Chips -> physical topology for the 3D-torus generations and the 2D ones.
_TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
             256: "4x8x8", 512: "8x8x8"}
_GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_COLLECTIVE_RE = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: 'v5p-128' is 128 TensorCores = 64 chips (v4/v5p count cores, v5e/v6e chips)."""

    name: str
    generation: str
    chips: int
    topology: str  # get_topology_desc name, e.g. 'v5p:4x4x4'

    @property
    def hbm_bytes(self) -> int:
        return CHIPS[self.generation]["hbm"]

    @property
    def peak_flops(self) -> float:
        return CHIPS[self.generation]["peak"]


def parse_slice(name: str) -> Slice:
    """'v5p-128' -> Slice(generation 'v5p', 64 chips, topology 'v5p:4x4x4')."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
    if not match:
        raise ValueError(f"TPU slice {name!r}: want e.g. v5p-128, v5e-256, v6e-64, v4-32")
    generation = "v5e" if match.group(1) == "v5litepod" else match.group(1)
    chips = int(match.group(2)) // CHIPS[generation]["cores_per_chip"]
    table = _TORUS_3D if generation in ("v4", "v5p") else _GRID_2D
    if chips not in table:
        raise ValueError(f"TPU slice {name!r}: {chips} chips is not a known {generation} shape "
                         f"({sorted(table)})")
    return Slice(name, generation, chips, f"{generation}:{table[chips]}")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops by kind in an HLO module's text (async pairs counted once, by their start)."""
    counts = {kind: 0 for kind in COLLECTIVES}
    for match in _COLLECTIVE_RE.finditer(hlo_text):
        counts[match.group(1)] += 1
    return {kind: n for kind, n in counts.items() if n}


@dataclasses.dataclass(frozen=True)
class CompileReport:
    run_id: str
    slice: str
    layout: dict[str, int]
    remat: str
    expert_impl: str
    fits: bool
    error: str | None
    compile_seconds: float
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    peak_bytes: int | None = None
    hbm_bytes: int | None = None
    compiled_flops: float | None = None  # per device
    budget_flops: float | None = None  # per device: train_flops_per_token * tokens per step / devices
    optimal_seconds: float | None = None
    mfu: float | None = None  # budget FLOPs / (estimated step time * chip peak)
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def flops_ratio(self) -> float | None:
        if not self.compiled_flops or not self.budget_flops:
            return None
        return self.compiled_flops / self.budget_flops

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "flops_ratio": self.flops_ratio}


# The expert backend a TPU run uses: "auto" resolved *for the TPU platform* (Pallas), since
# `resolve_impl("auto")` alone reads JAX's default backend, which is the CPU on this machine. Mosaic
# (Pallas) kernels cannot be partitioned by GSPMD ("Mosaic kernels cannot be automatically
# partitioned"), so the kernel only compiles inside the expert-parallel shard_map, which the MoE layer
# takes when the mesh has an `expert` axis > 1; on other multi-device meshes "auto" becomes XLA's
# partitionable grouped matmul.
TPU_EXPERT_IMPL = "auto"
GSPMD_EXPERT_IMPL = "ragged_dot"


def _tpu_config(run: RunSpec, remat: str, mesh: jax.sharding.Mesh):
    from smelt_jax.kernels import resolve_impl

    impl = run.model.expert_impl if run.model.expert_impl != "auto" else TPU_EXPERT_IMPL
    if impl == "auto" and mesh.shape.get("expert", 1) == 1 and mesh.size > 1:
        impl = GSPMD_EXPERT_IMPL
    return run.model.replace(remat=remat, expert_impl=resolve_impl(impl, platform="tpu"))


def compile_run(run: RunSpec, slice_name: str, layout: Parallelism | None = None,
                remat: str | None = None) -> CompileReport:
    """Compile `run`'s train step for `slice_name` with `layout` (default: the run's parallelism)."""
    from smelt_jax.parallel import train_state
    from smelt_jax.train.step import make_train_step, optimizer

    tpu = parse_slice(slice_name)
    layout = layout if layout is not None else run.parallelism
    remat = remat if remat is not None else layout.remat
    devices = aot.tpu_topology(tpu.topology).devices
    mesh = sharding.make_mesh(layout, devices)
    cfg = _tpu_config(run, remat, mesh)
    schedule = run.schedule
    tx = optimizer(schedule)
    plan = train_state.plan_training(cfg, tx, mesh)
    params, opt_state = plan.abstract_state()
    batch = plan.abstract_batch(schedule.batch_size, schedule.seq_len)
    replicated = sharding.replicated(mesh)
    lr = jax.ShapeDtypeStruct((), "float32", sharding=replicated)
    step = make_train_step(plan.graphdef, cfg, tx)
    base = {"run_id": run.id, "slice": slice_name, "layout": dict(mesh.shape), "remat": remat,
                "expert_impl": cfg.expert_impl, "hbm_bytes": tpu.hbm_bytes}
    start = time.perf_counter()
    try:
        compiled, summary = aot.compile_for_tpu(
            step, (params, opt_state, batch, lr), mesh,
            in_shardings=(plan.params_shardings, plan.opt_shardings,
                          plan.batch_shardings(schedule.batch_size, schedule.seq_len), replicated),
            out_shardings=(plan.params_shardings, plan.opt_shardings, replicated),
            donate_argnums=(0, 1))
    except aot.TpuOutOfMemory as err:
        return CompileReport(**base, fits=False, error=_first_line(err),
                             compile_seconds=time.perf_counter() - start)
    budget_flops = (budget_lib.train_flops_per_token(cfg) * schedule.tokens_per_step / mesh.size)
    mfu = None
    if summary.optimal_seconds and summary.optimal_seconds > 0:  # the estimate can come back negative
        mfu = budget_flops / (summary.optimal_seconds * tpu.peak_flops)
    peak = summary.peak_bytes
    return CompileReport(
        **base, fits=peak is None or peak <= tpu.hbm_bytes, error=None,
        compile_seconds=summary.compile_seconds, argument_bytes=summary.argument_bytes,
        output_bytes=summary.output_bytes, temp_bytes=summary.temp_bytes, peak_bytes=peak,
        compiled_flops=summary.flops, budget_flops=budget_flops,
        optimal_seconds=summary.optimal_seconds, mfu=mfu,
        collectives=count_collectives(compiled.as_text()))


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    for line in text.splitlines():
        if "RESOURCE_EXHAUSTED" in line or "exceeds" in line or "HBM" in line:
            return line.strip()[:300]
    return text.splitlines()[0][:300] if text else type(err).__name__


def format_report(report: CompileReport) -> str:
    """Human-readable lines for one compile."""
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f} GiB"
    lines = [(f"{report.run_id} on {report.slice}, layout {report.layout}, remat {report.remat}, "
             f"experts {report.expert_impl}: compiled in {report.compile_seconds:.1f} s")]
    if not report.fits and report.peak_bytes is None:
        lines.append(f"  OUT OF MEMORY: {report.error}")
        return "\n".join(lines)
    lines.append(f"  per device: arguments {gib(report.argument_bytes)}, temporaries "
                 f"{gib(report.temp_bytes)}, outputs {gib(report.output_bytes)}, peak "
                 f"{gib(report.peak_bytes)} of {gib(report.hbm_bytes)} HBM"
                 + ("" if report.fits else "  (DOES NOT FIT)"))
    ratio = report.flops_ratio
    lines.append(f"  per-device FLOPs: compiled {report.compiled_flops or 0:.3e}, budget share "
                 f"{report.budget_flops or 0:.3e}" + (f" (x{ratio:.2f})" if ratio else ""))
    lines.append(f"  collectives: {report.collectives or 'none'}")
    if report.mfu is not None:
        lines.append(f"  estimated step {report.optimal_seconds:.3f} s -> MFU {100 * report.mfu:.1f}%")
    else:
        lines.append(f"  step-time estimate unusable ({report.optimal_seconds})")
    return "\n".join(lines)

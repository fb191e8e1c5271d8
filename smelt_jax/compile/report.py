"""Ahead-of-time compilation of a run's real train step for a TPU slice, from this CPU machine.

`compile_run(run, "v5p-128", layout)` builds the slice's compile-only devices (`smelt_jax.compile.aot`), a
mesh over them from the layout, and compiles `train_step(params, opt_state, batch, lr)` with the
shardings the trainer uses. The report: per-device memory (arguments, temporaries, outputs, peak vs
the chip's HBM), per-device FLOPs (the compiler's count, the program's count with loops unrolled, and
the budget's share), the collectives the program executes and the bytes they move, and a step-time
estimate with the MFU it implies. A layout the compiler rejects for memory comes back with `peak_fits_hbm=False` and
the compiler's message, not as an exception. (`peak_fits_hbm` is the compiler's verdict: it accepted the
program and its peak is within HBM. Whether a layout is *kept* also asks for headroom:
`layout_search.fits_with_headroom`.)

Why not the compiler's own step time: XLA's `optimal_seconds` counts each `while` body once (the
decoder scans its layers) and adds -1 for every SparseCore offload, so it came back negative for every
train step (docs/parallelism.md, "What the numbers mean"). The estimate here is a roofline from the
compiled program (docs/roofline.md): max(program FLOPs / chip peak, HBM bytes walked from the per-device
HLO / HBM bandwidth, bytes sent by the executed collectives / the ICI bandwidth of the torus axes each
spans), plus the expert exchange's ICI time where the schedule does not overlap it. It is a lower bound
on the step time (so both MFUs are upper bounds): every matmul at peak, every byte moved once at full
bandwidth, the overlappable terms fully overlapped. Two MFUs, both "roofline MFU": the paper budget's
FLOPs (6 N_exec + 400 attended keys) and the conventional numerator (6 N_exec + the LM head + causal
attention, as MaxText reports).
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import time
from typing import Any

import jax

from smelt_jax.design import budget as budget_lib
from smelt_jax.parallel import sharding
from smelt_jax.compile import aot, checkpoint_cadence
from smelt_jax.compile.overflow import step_overflow_passes
from smelt_jax.compile.breakdown import Breakdown, TopRow, breakdown
from smelt_jax.compile.exchange_exposure import exposed_exchange_seconds
from smelt_jax.compile.hlo_module import COLLECTIVE_KINDS
from smelt_jax.compile.hlo_stats import EXCHANGE_KINDS, hlo_stats
from smelt_jax.compile.program_flops import ProgramFlops, program_flops
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.hardware import Slice, parse_slice
from smelt_jax.platform.xla_options import compiler_options
from smelt_jax.kernels import splash
from smelt_jax.kernels.backend import (choose_attention_backend, choose_expert_backend, choose_expert_exchange,
                                       choose_layer_loop)
from smelt_jax.model.expert_exchange import buffer_fill, token_axes
from smelt_jax.model.ring_exchange import ring_fill
from smelt_jax.compile.report_text import format_report  # noqa: F401  (re-exported: cr.format_report)

@dataclasses.dataclass(frozen=True)
class CompileReport:
    run_id: str
    slice: str
    layout: dict[str, int]
    remat: str
    expert_impl: str
    peak_fits_hbm: bool  # the compiler accepted it and its peak <= HBM (no headroom: see layout_search)
    error: str | None
    compile_seconds: float
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    peak_bytes: int | None = None
    hbm_bytes: int | None = None
    compiled_flops: float | None = None  # per device, XLA's count (each `while` body once)
    budget_flops: float | None = None  # per device: train_flops_per_token * tokens per step / devices
    optimal_seconds: float | None = None  # XLA's estimate, raw (see the module docstring)
    mfu: float | None = None  # budget FLOPs / (step_seconds * chip peak): an upper bound
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # static count in the HLO
    program_flops: float | None = None  # per device: matmul FLOPs executed, loops x trip count (jaxpr)
    program_flops_by_kind: dict[str, float] | None = None  # per device, Pallas at its cost_estimate
    pallas_fill: float | None = None  # share of the Pallas kernels' rows that carry tokens
    executed_collectives: dict[str, int] | None = None  # per device, loops x trip count (HLO)
    collective_bytes: dict[str, float] | None = None  # result bytes of the executed collectives
    send_bytes: float | None = None  # estimated bytes each device sends per step
    sparsecore_offloads: int | None = None  # each adds -1 to optimal_seconds
    # Per device, program_flops split into where it comes from (`flop_accounting`); sums to program_flops.
    flops_accounting: dict[str, float] | None = None
    compute_seconds: float | None = None  # program_flops / chip peak
    comm_seconds: float | None = None  # send_bytes / chip ICI bandwidth
    # Projection for a padded program: the all-to-alls sending only their filled rows (expert_exchange
    # "ragged"), i.e. all-to-all bytes x pallas_fill. None for a program that is ragged already.
    comm_seconds_ragged: float | None = None
    analysis_version: int = 0  # ANALYSIS_VERSION of `analyse` when these derived fields were computed
    # roofline: max(compute_seconds, hbm_seconds, comm_seconds - exchange_exposed_seconds)
    #           + exchange_exposed_seconds
    step_seconds: float | None = None
    hbm_traffic_bytes: float | None = None  # per device per step, walked from the HLO (`hbm_traffic`)
    hbm_seconds: float | None = None  # hbm_traffic_bytes / chip HBM bandwidth
    exchange_exposed_seconds: float | None = None  # the expert exchange's ICI time not overlapped
    # per device: 6 N_exec + LM head + causal attention (12 L q_width seq/2) per token x tokens / chips,
    # the convention MaxText reports MFU in
    conventional_flops: float | None = None
    mfu_conventional: float | None = None  # conventional_flops / (step_seconds * chip peak)
    dominant_term: str | None = None  # 'compute', 'HBM', 'ICI' or 'exchange': what sets step_seconds
    checkpoint_bytes: int | None = None  # one save: parameters + Adam state, whole model
    expert_exchange: str | None = None  # the exchange the program was compiled with (None: not recorded)
    suite: str | None = None  # the run's suite: its checkpoint interval (`checkpoint_cadence`)
    # hbm_traffic_bytes by category (`walk_categories.CATEGORIES`; sums to it), the MoE overflow loop at
    # `overflow_passes` (expected from measured load, `compile.overflow`), its worst case beside it
    hbm_by_category: dict[str, float] | None = None
    hbm_overflow_per_pass: float | None = None  # bytes one overflow pass adds (all layers, fwd + bwd)
    overflow_passes: float | None = None  # expected: a mean over measured loads
    overflow_passes_worst: int | None = None
    hbm_top: list[dict] | None = None  # the 25 largest instructions (`breakdown.TopRow` fields)
    # ICI_ACCOUNTING of the collective figures (0: the ring exchange sent n/n of a group; `upgrade_ici`)
    ici_accounting: int = 0
    layer_loop: str | None = None  # 'scan' or 'unrolled' (None: compiled before it was recorded: a scan)
    collective_form: str | None = None  # the compiler options' form (None: before it was recorded: 'auto')
    host_peak_bytes: int | None = None  # the compiling process's peak resident memory (`compile.isolated`)

    def breakdown(self) -> Breakdown | None:
        """The walk's breakdown kept in this report (None before ANALYSIS_VERSION 4)."""
        if self.hbm_by_category is None or self.hbm_traffic_bytes is None:
            return None
        return Breakdown(total=self.hbm_traffic_bytes, by_category=self.hbm_by_category,
                         overflow_per_trip=self.hbm_overflow_per_pass or 0.0,
                         overflow_passes=self.overflow_passes or 0,
                         overflow_passes_worst=self.overflow_passes_worst or 0,
                         top=tuple(TopRow(**row) for row in self.hbm_top or ()))

    @property
    def flops_ratio(self) -> float | None:
        """XLA's compiled FLOPs / the budget's share (each loop body once: not a work measure)."""
        if not self.compiled_flops or not self.budget_flops:
            return None
        return self.compiled_flops / self.budget_flops

    @property
    def program_ratio(self) -> float | None:
        """Program FLOPs (loops unrolled) / the budget's share: the work the step does per budget FLOP."""
        if not self.program_flops or not self.budget_flops:
            return None
        return self.program_flops / self.budget_flops

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "flops_ratio": self.flops_ratio, "program_ratio": self.program_ratio}


# Bump when `analyse` derives its fields differently: cached reports are then re-analysed (no recompile).
ANALYSIS_VERSION = 7  # 3: the HBM walk charges in-place updates in multi-output fusions their update
# 4: the walk by category; tile padding, VMEM buffers, gathers/scatters by rows; overflow at expected passes
# 5: expected overflow passes the mean over trained routers' measured loads (compile/overflow.py); an in-place
# scatter one fusion deep (TPU's scatter_custom_fusion) charged its rows
# 6: an `AllocateBuffer` custom-call (a scan's stack allocated without a fill) moves nothing
# 7: a reduce-scatter XLA:TPU emits as a fusion around an all-reduce counts as a reduce-scatter, the
# ring's (exposed) when it scatters a ring all-gather's shape (hlo_stats._scatter_fusions)
# The collectives' accounting, versioned apart so the ledger's records (no HLO kept) are recomputed from
# what they store, not compiled again: `upgrade_ici`. 1: the ring exchange sends (n-1)/n of a group of n
# (issue 50); async collectives counted once in every form XLA:TPU emits (hlo_async.counted_source).
ICI_ACCOUNTING = 1


def analyse(report: CompileReport, program_flops_by_kind: dict[str, float] | None, hlo_text: str | None,
            pallas_fill: float = 1.0, conventional_flops: float | None = None,
            overflow_passes: tuple[float, int] = (1, 1)) -> CompileReport:
    """`report` with the program's FLOPs, the HBM traffic and executed collectives of its compiled HLO
    (when given), and the roofline step time with the two MFUs it implies.

    `program_flops_by_kind` is the whole program's (all devices; divided here by the device count).
    Pallas kernels enter at `pallas_fill` x their cost estimate: the estimate counts every row of the
    expert-parallel receive buffer, the kernels only compute the rows that carry tokens
    (`model.expert_exchange.buffer_fill`). `conventional_flops` (per device; default: the report's)
    is the numerator of the conventional MFU (`conventional_train_flops`). `overflow_passes`
    (expected, worst) is how often the walk charges the MoE overflow loop (`overflow.step_overflow_passes`).

    The step bound (docs/roofline.md): compute = program FLOPs / peak; HBM = walked bytes / HBM
    bandwidth; ICI = bytes sent per collective / the bandwidth of the torus axes its group spans. The
    expert exchange is on the critical path (added after the max) unless the schedule overlaps it.
    """
    tpu = parse_slice(report.slice)
    devices = tpu.chips
    fields: dict[str, Any] = {}
    if conventional_flops is not None:
        fields["conventional_flops"] = conventional_flops
    if program_flops_by_kind is not None:
        per_device = {kind: value / devices for kind, value in program_flops_by_kind.items()}
        executed = executed_flops(per_device, pallas_fill)
        fields.update(program_flops=executed, program_flops_by_kind=per_device, pallas_fill=pallas_fill,
                      compute_seconds=executed / tpu.peak_flops)
    if hlo_text is not None:
        stats = hlo_stats(hlo_text)
        # A ragged all-to-all's result is its whole receive buffer; only the filled rows travel.
        ragged = stats.collective_bytes.get("ragged-all-to-all", 0.0)
        send = stats.send_bytes - ragged * (1.0 - pallas_fill)

        def ici_seconds(kinds=COLLECTIVE_KINDS, filled=("ragged-all-to-all",)) -> float:
            """Seconds the collectives of `kinds` take, those of `filled` sending only filled rows."""
            return sum(sent * (pallas_fill if kind in filled else 1.0)
                       / tpu.ici_bytes_per_second_for_group(group or devices)
                       for kind, group, sent in stats.send_bytes_by_group if kind in kinds)

        ici = ici_seconds()
        walked = breakdown(hlo_text, overflow_passes)
        # the expert exchange's own collectives (all-to-all kinds, or the ring's all-gather / reduce-scatter)
        exposed = exposed_exchange_seconds(stats, walked.bytes_by_name, tpu, pallas_fill)
        traffic = walked.total
        fields.update(collectives=stats.static_counts, executed_collectives=stats.collective_counts,
                      collective_bytes=stats.collective_bytes,
                      send_bytes=send, sparsecore_offloads=stats.sparsecore_offloads,
                      comm_seconds=ici, exchange_exposed_seconds=exposed,
                      hbm_traffic_bytes=traffic, hbm_seconds=traffic / tpu.hbm_bytes_per_second,
                      hbm_by_category=walked.by_category, hbm_overflow_per_pass=walked.overflow_per_trip,
                      overflow_passes=overflow_passes[0], overflow_passes_worst=overflow_passes[1],
                      hbm_top=[dataclasses.asdict(row) for row in walked.top], ici_accounting=ICI_ACCOUNTING,
                      comm_seconds_ragged=None if ragged else
                      ici_seconds(filled=EXCHANGE_KINDS))
    return _with_roofline(dataclasses.replace(report, **fields, analysis_version=ANALYSIS_VERSION), tpu)


def _with_roofline(report: CompileReport, tpu: Slice) -> CompileReport:
    """`report` with its step (`roofline_terms`), the term that sets it and both MFUs."""
    terms = roofline_terms(report)
    if terms is None:
        return report
    step, dominant = terms
    mfu = report.budget_flops / (step * tpu.peak_flops) if report.budget_flops else None
    conventional = report.conventional_flops / (step * tpu.peak_flops) if report.conventional_flops else None
    return dataclasses.replace(report, step_seconds=step, mfu=mfu, mfu_conventional=conventional,
                               dominant_term=dominant)


def upgrade_ici(report: CompileReport) -> CompileReport:
    """A report analysed before ICI_ACCOUNTING 1, its ring exchange charged (n-1)/n of its expert group
    of n (`hlo_stats._send_factor`), from the fields it stores: the exposed exchange x (n-1)/n; the ICI
    term and bytes sent less the exposed exchange's 1/n (every ring collective of those programs is
    synchronous, so exposed: the whole of the ring's share); step and MFUs again. Other reports as
    they are (their async forms were counted right: none in the ledger's programs)."""
    exposed = report.exchange_exposed_seconds
    n = (report.layout or {}).get("expert", 1)
    if report.ici_accounting >= 1 or report.expert_exchange != "ring" or not exposed or n <= 1:
        return report
    tpu = parse_slice(report.slice)
    fields = {"exchange_exposed_seconds": exposed * (n - 1) / n, "ici_accounting": ICI_ACCOUNTING}
    if report.comm_seconds is not None:
        fields["comm_seconds"] = report.comm_seconds - exposed / n
    if report.send_bytes is not None:
        fields["send_bytes"] = report.send_bytes - exposed * tpu.ici_bytes_per_second_for_group(n) / n
    return _with_roofline(dataclasses.replace(report, **fields), tpu)


def roofline_terms(report: CompileReport) -> tuple[float, str] | None:
    """(step seconds >=, the term that sets it) from a report's compute, HBM and ICI seconds: the
    overlappable terms run concurrently (their max), the exposed expert exchange after them. None
    until all three are known."""
    if report.compute_seconds is None or report.comm_seconds is None or report.hbm_seconds is None:
        return None
    exposed = report.exchange_exposed_seconds or 0.0
    overlapped = {"compute": report.compute_seconds, "HBM": report.hbm_seconds,
                  "ICI": max(report.comm_seconds - exposed, 0.0)}
    dominant = max(overlapped, key=overlapped.get)
    step = overlapped[dominant] + exposed
    return step, ("exchange" if exposed > overlapped[dominant] else dominant)


def conventional_train_flops(cfg, tokens_per_device: float) -> float:
    """Per device, per step: 6 N_exec + the LM head (2 d vocab x 3) + causal attention (12 L_exec
    q_width x seq/2), the numerator MaxText's MFU uses (the budget's convention counts 400 keys and
    no LM head)."""
    return budget_lib.train_flops_per_token(cfg, attended_keys=cfg.seq_len / 2,
                                            include_unembedding=True) * tokens_per_device


# The backends a TPU run uses (expert FFN, expert exchange, attention), decided as the TPU would run them
# on `mesh` (this machine's own platform is the CPU, so the platform is named): kernels/backend.py.
def _tpu_config(run: RunSpec, mesh: jax.sharding.Mesh):
    model = run.model
    return model.replace(
        expert_impl=choose_expert_backend(model.expert_impl, "tpu", mesh),
        expert_exchange=choose_expert_exchange(model.expert_exchange, "tpu"),
        attention_impl=choose_attention_backend(model.attention_impl, "tpu", seq_len=run.schedule.seq_len))


@dataclasses.dataclass(frozen=True)
class _Program:
    """The train step of a run, set up for a TPU slice: what compiling or tracing it needs."""

    tpu: Slice
    mesh: jax.sharding.Mesh
    cfg: Any
    remat: str
    layer_loop: str  # 'scan' or 'unrolled' (the layout's, 'auto' resolved for a TPU)
    collectives: str  # the layout's collectives form (platform/xla_options.py)
    step: Any
    args: tuple
    in_shardings: tuple
    out_shardings: tuple
    budget_flops: float  # per device
    conventional_flops: float  # per device (`conventional_train_flops`)


def _program(run: RunSpec, slice_name: str, layout: Parallelism | None, remat: str | None) -> _Program:
    from smelt_jax.train import state as train_state
    from smelt_jax.train.step import make_train_step, optimizer

    tpu = parse_slice(slice_name)
    layout = layout if layout is not None else run.parallelism
    remat = remat if remat is not None else layout.remat
    mesh = sharding.make_mesh(layout, aot.tpu_topology(tpu.topology_desc).devices)
    run = dataclasses.replace(run, model=layout.with_exchange(run.model))  # the layout's exchange, if chosen
    cfg = _tpu_config(run, mesh)
    schedule = run.schedule
    tx = optimizer(schedule)
    plan = train_state.plan_training(cfg, tx, mesh, remat=remat, layer_loop=layout.layer_loop)
    params, opt_state = plan.abstract_state()
    batch = plan.abstract_batch(schedule.batch_size, schedule.seq_len)
    lr = jax.ShapeDtypeStruct((), "float32", sharding=sharding.replicated(mesh))
    in_shardings, out_shardings = plan.step_shardings(schedule.batch_size, schedule.seq_len)
    return _Program(
        tpu=tpu, mesh=mesh, cfg=cfg, remat=remat, layer_loop=choose_layer_loop(layout.layer_loop, "tpu"),
        collectives=layout.collectives, step=make_train_step(plan.graphdef, cfg, tx),
        args=(params, opt_state, batch, lr), in_shardings=in_shardings, out_shardings=out_shardings,
        budget_flops=budget_lib.train_flops_per_token(cfg) * schedule.tokens_per_step / mesh.size,
        conventional_flops=conventional_train_flops(cfg, schedule.tokens_per_step / mesh.size))


ACCOUNTING_TERMS = ("budget", "attention_window", "unembedding", "remat", "other")


def executed_flops(by_kind: dict[str, float], pallas_fill: float) -> float:
    """Matmul FLOPs executed: Pallas kernels at the share of their rows that carry tokens."""
    return sum(value * (pallas_fill if kind == "pallas" else 1.0) for kind, value in by_kind.items())


def flop_accounting(cfg, tokens_per_device: float, executed_with_remat: float,
                    executed_without_remat: float) -> dict[str, float]:
    """Where a device's program FLOPs come from, per step (terms sum to `executed_with_remat`):

    budget            6 N_exec + 12 L_exec q_width x 400 keys, per token (the paper's convention);
    attention_window  the keys the attention executes per query beyond the budget's 400: the reference
                      computes every [seq, seq] score and masks it (seq keys); splash skips the blocks
                      after the diagonal (`kernels.splash.dense_equivalent_keys`: 2688 of 4096);
    unembedding       2 d vocab per token forward, x3 for training (outside the budget by convention);
    remat             recomputation: the program traced with remat 'none' subtracted (measured);
    other             the rest: Pallas tile padding of d_model and the expert width to lane-tile
                      multiples, the router's matmuls, and anything else the budget does not count.
    """
    keys = cfg.seq_len
    if choose_attention_backend(cfg.attention_impl, "tpu", seq_len=cfg.seq_len) == "splash":
        keys = splash.dense_equivalent_keys(cfg.seq_len)
    budget = budget_lib.train_flops_per_token(cfg) * tokens_per_device
    window = budget_lib.train_flops_per_token(cfg, attended_keys=keys) * tokens_per_device
    with_logits = budget_lib.train_flops_per_token(cfg, attended_keys=keys,
                                                   include_unembedding=True) * tokens_per_device
    return {"budget": budget, "attention_window": window - budget, "unembedding": with_logits - window,
            "remat": executed_with_remat - executed_without_remat,
            "other": executed_without_remat - with_logits}


def compile_run(run: RunSpec, slice_name: str, layout: Parallelism | None = None,
                remat: str | None = None, hlo_path: str | os.PathLike | None = None) -> CompileReport:
    """Compile `run`'s train step for `slice_name` with `layout` (default: the run's parallelism).

    With `hlo_path`, the compiled (optimized, partitioned) HLO module's text is written there, gzipped,
    so its executed collectives and loops can be re-analysed without compiling again.
    """
    program = _program(run, slice_name, layout, remat)
    tpu, cfg = program.tpu, program.cfg
    base = {"run_id": run.id, "suite": run.suite, "slice": slice_name, "layout": dict(program.mesh.shape),
            "remat": program.remat, "expert_exchange": cfg.expert_exchange, "layer_loop": program.layer_loop,
            "collective_form": program.collectives,
            "expert_impl": cfg.expert_impl, "hbm_bytes": tpu.hbm_bytes}
    start = time.perf_counter()
    try:
        compiled, summary = aot.compile_for_tpu(
            program.step, program.args, program.mesh, in_shardings=program.in_shardings,
            out_shardings=program.out_shardings, donate_argnums=(0, 1),
            compiler_options=compiler_options(program.collectives, "tpu"))
    except aot.TpuOutOfMemory as err:
        return CompileReport(**base, peak_fits_hbm=False, error=_first_line(err),
                             compile_seconds=time.perf_counter() - start)
    peak = summary.peak_bytes
    hlo_text = compiled.as_text()
    if hlo_path is not None:
        write_hlo(hlo_path, hlo_text)
    report = CompileReport(
        **base, peak_fits_hbm=peak is None or peak <= tpu.hbm_bytes, error=None,
        checkpoint_bytes=checkpoint_cadence.save_bytes(run),
        compile_seconds=summary.compile_seconds, argument_bytes=summary.argument_bytes,
        output_bytes=summary.output_bytes, temp_bytes=summary.temp_bytes, peak_bytes=peak,
        compiled_flops=summary.flops, budget_flops=program.budget_flops,
        optimal_seconds=summary.optimal_seconds)
    report = analyse(report, summary.program_flops, hlo_text, pallas_fill=_pallas_fill(program, run),
                     conventional_flops=program.conventional_flops,
                     overflow_passes=step_overflow_passes(run, dict(program.mesh.shape)))
    return with_accounting(report, run, trace_program_flops)


def with_accounting(report: CompileReport, run: RunSpec, trace_fn) -> CompileReport:
    """`report` with `flops_accounting`, tracing the step once more with remat 'none' (`trace_fn`, as
    `trace_program_flops`) to measure the recomputation. Needs `program_flops` set."""
    if report.program_flops is None or report.pallas_fill is None:
        return report
    layout = Parallelism(**report.layout, tpu_type=report.slice,
                         exchange="ring" if report.expert_exchange == "ring" else "auto")
    flops, fill = trace_fn(run, report.slice, layout, remat="none")
    devices = parse_slice(report.slice).chips
    without = executed_flops(flops.by_kind, fill) / devices
    cfg = run.model
    accounting = flop_accounting(cfg, run.schedule.tokens_per_step / devices, report.program_flops, without)
    return dataclasses.replace(report, flops_accounting=accounting)


def _pallas_fill(program: _Program, run: RunSpec) -> float:
    shards = program.mesh.shape.get("expert", 1)
    if shards <= 1:
        return 1.0
    token_shards = math.prod(program.mesh.shape[a] for a in token_axes(program.mesh))
    if program.cfg.expert_exchange == "ring":
        return ring_fill(program.cfg.top_k, program.cfg.n_experts, shards,
                         tokens_local=-(-run.schedule.tokens_per_step // token_shards),
                         slack=program.cfg.expert_buffer_slack)
    return buffer_fill(program.cfg.top_k, program.cfg.n_experts, shards,
                       tokens_local=-(-run.schedule.tokens_per_step // token_shards),
                       slack=program.cfg.expert_buffer_slack)


def trace_program_flops(run: RunSpec, slice_name: str, layout: Parallelism | None = None,
                        remat: str | None = None) -> tuple[ProgramFlops, float]:
    """(the train step's matmul FLOPs: whole program, loops x trip count; the Pallas fill) from tracing
    alone: seconds, no compile. What `compile_run` passes to `analyse`, for reports made before."""
    program = _program(run, slice_name, layout, remat)
    with jax.set_mesh(program.mesh):
        traced = jax.jit(program.step, in_shardings=program.in_shardings,
                         out_shardings=program.out_shardings).trace(*program.args)
    return program_flops(traced.jaxpr), _pallas_fill(program, run)


def write_hlo(path: str | os.PathLike, hlo_text: str) -> None:
    """Gzipped HLO text at `path`, written atomically (a crash leaves no half file)."""
    tmp = f"{os.fspath(path)}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)  # the cache folder may not exist yet
    with gzip.open(tmp, "wt", compresslevel=6) as f:
        f.write(hlo_text)
    os.replace(tmp, path)


def read_hlo(path: str | os.PathLike) -> str:
    with gzip.open(path, "rt") as f:
        return f.read()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    for line in text.splitlines():
        if "RESOURCE_EXHAUSTED" in line or "exceeds" in line or "HBM" in line:
            return line.strip()[:300]
    return text.splitlines()[0][:300] if text else type(err).__name__

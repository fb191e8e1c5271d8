"""The compile report as text: what `smelt compile ID --topology SLICE` prints (`format_report`), with
`--breakdown` the walk by category beside the ideal step's (`compile.ideal_step`), and the member's
physical limit: the floor, the per-op limit and the efficiency (per-op limit / walked roofline step)."""

from __future__ import annotations

from smelt_jax.compile import checkpoint_cadence
from smelt_jax.compile.breakdown import format_breakdown


def format_report(report, with_breakdown: bool = False, ideal=None) -> str:
    """Human-readable lines for one compile; with the walk by category and its top instructions."""
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f} GiB"
    lines = [(f"{report.run_id} on {report.slice}, layout {report.layout}, remat {report.remat}, "
             f"experts {report.expert_impl}, exchange {report.expert_exchange}"
              + (f", layers {report.layer_loop}" if report.layer_loop else "")
              + (f", collectives {report.collective_form}" if report.collective_form not in (None, "auto") else "")
              + f": compiled in {report.compile_seconds:.1f} s")]
    if not report.peak_fits_hbm and report.peak_bytes is None:
        lines.append(f"  OUT OF MEMORY: {report.error}")
        return "\n".join(lines)
    lines.append(f"  per device: arguments {gib(report.argument_bytes)}, temporaries "
                 f"{gib(report.temp_bytes)}, outputs {gib(report.output_bytes)}, peak "
                 f"{gib(report.peak_bytes)} of {gib(report.hbm_bytes)} HBM"
                 + ("" if report.peak_fits_hbm else "  (PEAK OVER HBM)"))
    ratio, program_ratio = report.flops_ratio, report.program_ratio
    lines.append(f"  per-device FLOPs: budget share {report.budget_flops or 0:.3e}; program (loops unrolled) "
                 + (f"{report.program_flops:.3e} (x{program_ratio:.2f})" if program_ratio else "?")
                 + f"; XLA cost analysis {report.compiled_flops or 0:.3e}"
                 + (f" (x{ratio:.2f}, each loop body once)" if ratio else ""))
    lines.append(f"  collectives in the HLO: {report.collectives or 'none'}")
    if report.executed_collectives is not None:
        lines.append(f"  executed per step: {report.executed_collectives}, "
                     f"{(report.send_bytes or 0) / 2**30:.2f} GiB sent per device; "
                     f"{report.sparsecore_offloads} SparseCore offloads")
    if report.hbm_traffic_bytes is not None:
        lines.append(f"  HBM traffic walked from the HLO (operands + results of every top-level op, loops x "
                     f"trip count): {report.hbm_traffic_bytes / 1e9:.1f} GB per device per step"
                     + ("" if report.overflow_passes is None else
                        f" (MoE overflow loop at {report.overflow_passes} expected passes, worst case "
                        f"{report.overflow_passes_worst}: --breakdown)"))
    if report.step_seconds is not None:
        exposed = report.exchange_exposed_seconds or 0.0
        lines.append(f"  roofline step >= {report.step_seconds:.4g} s = max(compute {report.compute_seconds:.4g} s, "
                     f"HBM {report.hbm_seconds:.4g} s, ICI {report.comm_seconds - exposed:.4g} s) "
                     f"+ exposed expert exchange {exposed:.4g} s; dominant: {report.dominant_term}")
        conventional = "?" if report.mfu_conventional is None else f"{100 * report.mfu_conventional:.1f}%"
        lines.append(f"  roofline MFU <= {100 * (report.mfu or 0):.1f}% (paper budget FLOPs), "
                     f"roofline MFU <= {conventional} (6N + LM head + causal attention, as MaxText)")
    if report.comm_seconds_ragged is not None:
        lines.append(f"  projected ICI with expert_exchange='ragged' (all-to-all bytes x fill "
                     f"{report.pallas_fill:.3f}): {report.comm_seconds_ragged:.3f} s")
    if report.checkpoint_bytes is not None:
        chosen = checkpoint_cadence.cadence(report.suite or "", report.step_seconds)
        every = ("no interval set for this suite: the trainer's --checkpoint-every" if chosen is None else
                 f"every {chosen[1]:,} steps = {chosen[0]:g} min at the roofline step")
        lines.append(f"  checkpoint: {report.checkpoint_bytes / 1e9:.1f} GB per save (parameters + Adam state); "
                     f"{every}")
    lines.append(f"  XLA optimal_seconds {report.optimal_seconds} (each loop body once, -1 per SparseCore "
                 "offload: not a step time)")
    if ideal is not None:
        lines += limit_lines(ideal, report.step_seconds)
    walked = report.breakdown() if with_breakdown else None
    if walked is not None:
        lines.append(format_breakdown(walked, None if ideal is None else ideal.by_category))
    return "\n".join(lines)


def limit_lines(ideal, step_seconds: float | None) -> list[str]:
    """The physical limit of the member (`ideal_step.IdealStep`) against its walked roofline step."""
    ms = lambda seconds: f"{1e3 * seconds:.1f} ms"
    lines = [f"  physical limit (compile/ideal_step.py, docs/roofline.md): {ideal.hbm_bytes / 1e9:.1f} GB, "
             f"{ideal.flops / 1e12:.2f} TFLOP per device; floor {ms(ideal.floor_seconds)} = max(compute "
             f"{ms(ideal.compute_seconds)}, HBM {ms(ideal.hbm_seconds)}, ICI {ms(ideal.ici_seconds)}); per-op "
             f"limit {ms(ideal.per_op_seconds)} (MXU-padded, no overlap between ops; the ring exchange's "
             f"{ms(ideal.exchange_ici_seconds)} of ICI behind compute)"]
    if step_seconds:
        lines.append(f"  efficiency: per-op limit / roofline step = {ideal.per_op_seconds / step_seconds:.0%} "
                     f"(walked step {ms(step_seconds)} = {step_seconds / ideal.per_op_seconds:.2f}x the per-op "
                     f"limit, {step_seconds / ideal.floor_seconds:.2f}x the floor)")
    return lines

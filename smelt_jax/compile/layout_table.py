"""The layout search's results as the markdown of docs/parallelism.md (`render_table`: one row per
configuration, the HBM walk by category, the loop-form comparison of `compile.loop_form`) and the
generated-block splice every generated doc uses (`replace_generated`). Moved out of
`compile.layout_search` (issue 50 item 2), which re-exports these names."""

from __future__ import annotations

from collections.abc import Iterable

from smelt_jax.compile.breakdown import category_header, category_row
from smelt_jax.compile.candidates import HBM_HEADROOM
from smelt_jax.compile.loop_form import loop_form_section
from smelt_jax.compile.report import CompileReport
from smelt_jax.platform.hardware import parse_slice

# Results are layout_search.SearchResult values (not imported: layout_search imports this module).


def _gib(value: float | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f}"


def _collectives(counts: dict[str, int]) -> str:
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
             "ragged-all-to-all": "rA2A", "collective-permute": "CP"}
    return " ".join(f"{short[k]} {v}" for k, v in sorted(counts.items())) or "none"


def _tflop(value: float | None) -> str:
    return "?" if value is None else f"{value / 1e12:.1f}"


TABLE_HEADER = (
    "| config | slice | layout (data x fsdp x expert x tensor) | remat | args GiB | temps GiB | out GiB "
    "| args+temps / peak / HBM GiB | TFLOP per device: budget / program (x) | program - budget, per budget FLOP "
    "| XLA count (x) | executed collectives (GiB sent) | HBM GB walked | step >= s (compute / HBM / ICI + exchange) "
    "| roofline MFU <= (budget) | roofline MFU <= (6N + head + causal attn) | compile s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


ACCOUNTING_SHORT = {"attention_window": "window", "unembedding": "logits", "remat": "remat", "other": "other"}


def _accounting(report: CompileReport) -> str:
    terms = report.flops_accounting
    if not terms:
        return "?"
    return " ".join(f"{short} {terms[key] / terms['budget']:+.2f}" for key, short in ACCOUNTING_SHORT.items())


def table_row(result) -> str:
    name = f"{result.key}"
    if result.status != "fits" or result.report is None:
        reason = result.status
        if result.status == "does not fit" and result.report is not None:
            r = result.report
            over = (f"arguments + temporaries {_gib((r.argument_bytes or 0) + (r.temp_bytes or 0))} GiB "
                    f"> {HBM_HEADROOM:.0%} of HBM")
            reason = f"does not fit: {(r.error or over)[:120]}"
        return f"| {name} | {result.slice} | {reason} |" + " |" * 14
    r = result.report
    lay = r.layout
    program = (f"{_tflop(r.budget_flops)} / {_tflop(r.program_flops)}"
               + (f" (x{r.program_ratio:.2f})" if r.program_ratio else ""))
    xla = f"{_tflop(r.compiled_flops)}" + (f" (x{r.flops_ratio:.2f})" if r.flops_ratio else "")
    if r.executed_collectives is not None:
        executed = f"{_collectives(r.executed_collectives)} ({(r.send_bytes or 0) / 2**30:.1f})"
    else:
        executed = f"static: {_collectives(r.collectives)} (HLO not kept)"
    hbm = "?" if r.hbm_traffic_bytes is None else f"{r.hbm_traffic_bytes / 1e9:,.0f}"
    if r.step_seconds is not None:
        ragged = "" if r.comm_seconds_ragged is None else f"; ragged {r.comm_seconds_ragged:.2f}"
        exposed = r.exchange_exposed_seconds or 0.0
        step = (f"{r.step_seconds:.2f} ({r.compute_seconds:.2f} / {r.hbm_seconds:.2f} / "
                f"{r.comm_seconds - exposed:.2f} + {exposed:.2f}{ragged}; {r.dominant_term})")
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "?"
        mfu_conventional = f"{100 * r.mfu_conventional:.1f}%" if r.mfu_conventional is not None else "?"
    else:
        step = "?" if r.compute_seconds is None else f"? ({r.compute_seconds:.2f} / ? / ?)"
        mfu = mfu_conventional = "?"
    return (f"| {name} | {r.slice} | {lay['data']} x {lay['fsdp']} x {lay['expert']} x {lay['tensor']} "
            f"| {r.remat}{_loop_note(result)} | {_gib(r.argument_bytes)} | {_gib(r.temp_bytes)} | {_gib(r.output_bytes)} "
            f"| {_gib((r.argument_bytes or 0) + (r.temp_bytes or 0))} / {_gib(r.peak_bytes)} / "
            f"{_gib(r.hbm_bytes)} | {program} | {_accounting(r)} | {xla} | {executed} | {hbm} | {step} | {mfu} "
            f"| {mfu_conventional} "
            f"| {r.compile_seconds:.0f} |")


def _loop_note(result) -> str:
    """', unrolled' when the chosen layout's layer stacks are unrolled (a scan is the TPU's default), and
    ', async' when it compiles with the async collectives options (XLA's defaults otherwise)."""
    chosen = result.chosen
    if chosen is None:
        return ""
    return "".join(f", {form}" for form in (chosen.layer_loop, chosen.collectives) if form != "auto")


def _roofline_terms(results: list) -> tuple[str, str, str]:
    """('459 TFLOP/s', '2765 GB/s HBM', '200 GB/s ICI per torus axis') from the hardware table when every
    result is on one chip."""
    chips = {parse_slice(r.slice).chip for r in results}
    if len(chips) != 1:
        return "chip peak", "chip HBM bandwidth", "chip ICI bandwidth per torus axis"
    chip = chips.pop()
    return (f"{chip.peak_flops / 1e12:.0f} TFLOP/s", f"{chip.hbm_bytes_per_second / 1e9:,.0f} GB/s HBM",
            f"{chip.ici_bytes_per_second / chip.torus_dims / 1e9:.0f} GB/s ICI per torus axis")


def render_table(results: Iterable, command: str) -> str:
    results = list(results)
    fitted = sum(r.status == "fits" for r in results)
    peak, hbm, ici = _roofline_terms(results)
    intro = (f"Generated by `{command}` (`make compile-report`): {fitted} of {len(results)} "
             "configurations compiled and fit. Per-device numbers from the TPU compiler's program "
             "(compiled, never run). **budget** = train_flops_per_token x tokens per step / chips; "
             "**program** = the matmul FLOPs the step executes (jaxpr, loops x trip count, Pallas kernels "
             "at the rows that carry tokens, splash attention at the blocks it runs), and the terms that "
             "separate the two, as shares of the budget "
             "(**window**: the keys each query's attention executes beyond the budget's 400: all 4096 for the "
             "reference attention, the dense equivalent of 2688 for splash; **logits**: the unembedding; "
             "**remat**: recomputation, measured by tracing with remat none; **other**: the rest, mostly Pallas "
             "tile padding); **XLA count** = `cost_analysis()` FLOPs, which count each "
             "loop body once (not a work measure). **Executed collectives** per step with loops x trip "
             "count, and the GiB each device sends (all-reduce twice its size). **HBM GB walked**: operands + "
             "results of every top-level op of the per-device HLO, loops x trip count (docs/roofline.md). "
             f"**step >=** = max(program FLOPs / {peak}, HBM bytes / {hbm}, bytes sent / ({ici} x the axes "
             "each collective's group spans)) + the expert exchange where the schedule does not overlap it, "
             "and the term that sets it: a roofline lower bound, so both **roofline MFU <=** are upper "
             "bounds: budget FLOPs (the paper's convention) or 6N + LM head + causal attention (MaxText's), "
             "over step x peak; 'ragged' projects the ICI time "
             "if the expert all-to-alls sent only their filled rows (shown for padded programs only). "
             "Fit = compiler accepted, peak "
             f"< HBM, and arguments + temporaries <= {HBM_HEADROOM:.0%} of HBM.")
    lines = [intro, "", TABLE_HEADER]
    lines += [table_row(r) for r in results]
    lines += ["", "**HBM GB walked by category** (per device per step; docs/roofline.md, `smelt compile ID "
              "--breakdown` lists the largest instructions): the MoE overflow loop at its expected passes from "
              "measured load, the worst case in brackets; the categories sum to the total.", "",
              category_header()]
    lines += [category_row(r.key, *_categories(r)) for r in results]
    lines += loop_form_section(results)
    lines += program_lines(results)
    return "\n".join(lines) + "\n"


def program_lines(results: Iterable) -> list[str]:
    """Markdown lines: which kept programs and how many compared records are of an older program than this
    checkout's (`layout_search.PROGRAM_VERSION`)."""
    results = list(results)
    kept_older = [r.key for r in results if getattr(r, "chosen_is_older", False)]
    records = sum(len(getattr(r, "older_programs", ())) for r in results) - len(kept_older)
    kept = sum(r.chosen is not None for r in results)
    lines = ["", f"**Program versions** (`layout_search.PROGRAM_VERSION`): {kept - len(kept_older)} of {kept} kept "
             "programs were compiled by this checkout's program"
             + (f"; {len(kept_older)} by an older one ({', '.join(kept_older)}), until `make compile-report` "
                "compiles them again" if kept_older else "")
             + f". {records} record(s) of candidates the search compared and did not keep are of an older program "
             "and were compared as recorded (marked 'older program' above where listed): a version is bumped only "
             "for a change that alters every candidate alike, not how they rank."]
    return lines


def _categories(result) -> tuple[dict[str, float] | None, float | None]:
    r = result.report
    if result.status != "fits" or r is None or r.hbm_by_category is None:
        return None, None
    worst = (r.overflow_passes_worst or 0) * (r.hbm_overflow_per_pass or 0.0)
    return r.hbm_by_category, worst


BEGIN = "<!-- compile-report:begin (generated; edit smelt_jax/compile/layout_search.py instead) -->"
END = "<!-- compile-report:end -->"


def replace_generated(doc: str, generated: str, begin: str = BEGIN, end: str = END) -> str:
    """`doc` with the text between `begin` and `end` replaced (both appended at the end when absent)."""
    block = f"{begin}\n{generated}{end}"
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    return doc.rstrip("\n") + "\n\n" + block + "\n"

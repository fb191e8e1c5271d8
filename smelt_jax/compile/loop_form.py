"""The layer stacks' loop form as a dimension of the layout search (issue 50 item 2).

A stack of layers runs as a `lax.scan` on TPU (one compiled body for any depth: the TPU's `auto`,
kernels/backend.py) or unrolled (a Python loop over the layers: `Parallelism.layer_loop = 'unrolled'`;
tests/test_model_decoder.py checks both give the same loss and gradients). The scan writes each layer's
saved activations into stacked [layers, ...] buffers and reads its weights by dynamic slices; unrolled,
XLA sees every layer and keeps them as separate buffers, at the price of a longer compile (100M S95 on
v5p-128: the issue-50 review measured SMELT 327 -> 269 GB walked and the Baseline at 215 GB, at 3.8-7 min
of compile; docs/performance.md has this module's own measurements).

The search (`layout_search.search_layout`) finds the winning exchange and remat with the first loop form
(`SearchPolicy.layer_loops[0]`, the scan), then `best_form` compiles each other form at the *winning
exchange*: its first remat (none -> dots -> full) that fits with headroom, then its following remats
while each lowers the roofline step (the stage-2 rule; unrolled there are no scan stacks to save, so its
best remat can differ from the scan's: the 100M S95 Baseline's scan wins at remat full). The faster
program that fits is kept (ties: the scan, which compiles faster); the choice is the layout's
`layer_loop` (experiments/layouts.json, left out while the scan wins) and every compile, with its compile
time, is a ledger record. Without a compile (`--cached-only`, a time budget) a form not yet compiled is
left out of the comparison: that configuration keeps its scan program.

Cheapest while still finding the faster one: the exchange and the scan's remats are not searched again
for the unrolled form (the exchange's lead, 1.6x on the 100M pairs, is not a loop effect), so a
configuration costs 1-3 compiles more (2 when remat none fits and dots is slower).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from smelt_jax.compile.candidates import Candidate, fits_with_headroom

Attempt = Callable[[Candidate], Any]  # a candidate -> its CompileReport, or None when not compiled


def form_chain(group: Iterable[Candidate], exchange: str, layer_loop: str) -> list[Candidate]:
    """The candidates of one expert size at `exchange` with `layer_loop` (XLA's default collectives), in
    remat order."""
    return [c for c in group if c.layout.exchange == exchange and c.layout.layer_loop == layer_loop
            and c.layout.collectives == "auto"]


def faster(report, than) -> bool:
    """Whether `report`'s roofline step is known and below `than`'s (a report without one never wins)."""
    return report.step_seconds is not None and (than.step_seconds is None
                                                or report.step_seconds < than.step_seconds)


def walk_chain(chain: Sequence[Candidate], attempt: Attempt, compared: list) -> tuple[Candidate, Any] | None:
    """The first remat of `chain` that fits with headroom, then the following ones while each fits and
    lowers the step: (candidate, report), or None when none fits or one is not compiled before a fit.
    Every compile tried is appended to `compared` as (layout, report)."""
    best = None
    for candidate in chain:
        report = attempt(candidate)
        if report is None:  # not compiled (cached results only): the walk ends here
            break
        compared.append((candidate.layout, report))
        if best is None:
            if fits_with_headroom(report):
                best = (candidate, report)
            continue
        if not fits_with_headroom(report) or not faster(report, best[1]):
            break
        best = (candidate, report)
    return best


def best_form(group: Sequence[Candidate], winner: Candidate, report, layer_loops: Sequence[str],
              attempt: Attempt) -> tuple[Candidate, Any, tuple]:
    """The faster of `winner` (the first loop form's choice, with its `report`) and each other form of
    `layer_loops` walked at the winner's exchange (`walk_chain`): (candidate, report, compared), where
    `compared` lists (layout, report) of the winner and of every other-form compile tried, in order
    (empty when there is no other form to compare)."""
    others = [form for form in layer_loops if form != winner.layout.layer_loop]
    if not others:
        return winner, report, ()
    best, compared = (winner, report), [(winner.layout, report)]
    for form in others:
        found = walk_chain(form_chain(group, winner.layout.exchange, form), attempt, compared)
        if found is not None and faster(found[1], best[1]):
            best = found
    return best[0], best[1], tuple(compared)


def _form(layout) -> str:
    return "scan" if layout.layer_loop in ("auto", "scan") else layout.layer_loop


def _row(key: str, layout, report, kept: bool, older: bool = False) -> str:
    fits = fits_with_headroom(report)
    step = "?" if report.step_seconds is None or not report.peak_fits_hbm else f"{report.step_seconds:.3f}"
    walked = "?" if report.hbm_traffic_bytes is None else f"{report.hbm_traffic_bytes / 1e9:,.0f}"
    memory = ("?" if report.argument_bytes is None else
              f"{((report.argument_bytes or 0) + (report.temp_bytes or 0)) / 2**30:.1f}")
    verdict = ("**kept**" if kept else ("fits" if fits else "does not fit")) + (" (older program)" if older else "")
    return (f"| {key} | {_form(layout)} | {layout.collectives} | {layout.remat} | {step} | {walked} | {memory} "
            f"| {report.compile_seconds:.0f} | {verdict} |")


def loop_form_section(results: Iterable[Any]) -> list[str]:
    """Markdown lines for docs/parallelism.md: per configuration whose other loop forms were compiled,
    each program compared (the scan's winner first) with its remat, step, walked GB, memory and compile
    time, the kept one marked; and how many configurations keep their scan program uncompared."""
    results = list(results)
    compared = [r for r in results if len(getattr(r, "compared", ())) > 1]
    waiting = sum(r.status == "fits" and len(getattr(r, "compared", ())) <= 1 for r in results)
    lines = ["", f"**Layer loop form and collectives** (`compile/loop_form.py`, `compile/collective_form.py`, "
             "issue 50 items 2 and 5): the winning exchange's program with its layer stacks a scan (the TPU's "
             "default, through the search above) and unrolled (from its first remat that fits, then while the step "
             "falls), then the kept one compiled with the 'async' collectives options "
             "(platform/xla_options.py); the faster program that fits is kept and recorded as the layout's "
             f"`layer_loop` and `collectives`. Compared for {len(compared)} configuration(s); the other {waiting} "
             "that fit keep their scan programs with XLA's default options until `make compile-report` compiles "
             "the others."]
    if not compared:
        return lines
    lines += ["", "| config | layers | collectives | remat | step >= s | HBM GB walked | args+temps GiB | compile s | |",
              "|---|---|---|---|---|---|---|---|---|"]
    for result in compared:
        older = getattr(result, "older_programs", ())
        for layout, report in result.compared:
            lines.append(_row(result.key, layout, report, kept=layout == result.chosen,
                              older=Candidate(layout).label in older))
    return lines

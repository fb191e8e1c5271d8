"""Choosing a parallelism layout for every configuration of a suite by compiling it for a TPU slice.

For each configuration, `search_layout` compiles the real train step (`report.compile_run`) for the
slice its suite's placement gives its scale, with an ordered list of candidate layouts: for the first
expert axis size where any fits with headroom (`fits_with_headroom`), each exchange at its first remat
that fits, then the winning exchange's further remats while each lowers the roofline step (the steps
are HBM-bound with compute to spare, so recomputing the forward can cost less than saving it: 100M
S95 Baseline on v5p-128, remat none 0.117 s, dots 0.112 s; docs/performance.md), then the layer stacks
unrolled instead of scanned at the winning exchange (`compile.loop_form`). Every compile
result is cached as one JSON file under data_cache/compile_report/ (key: configuration content,
slice, layout, remat, CACHE_VERSION), so an interrupted report resumes without recompiling what it
already has, and recorded in the suite's ledger (`compile.results_ledger`), which travels with the
repository, so it resumes on another machine too. `compile_suite` is that
resumable loop over a suite (`smelt compile-report`); `render_table` (`compile.layout_table`) turns the
results into the markdown of docs/parallelism.md; `layouts_document` into the suite's layouts file
(experiments/layouts.json for smelt16).

The suite's policy (slice per scale, expert axis sizes, which configurations go first) is a
`SearchPolicy` built in `experiments/placement.py`, next to the suites; nothing here names a suite.

Candidates all have an `expert` axis: the TPU expert backend is a Pallas kernel, which GSPMD cannot
partition, so it only compiles inside the expert-parallel shard_map (an `expert` axis > 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from smelt_jax.compile.candidates import (HBM_HEADROOM, Candidate, SearchPolicy, candidates,  # noqa: F401
                                          fits_with_headroom)
from smelt_jax.compile.checkpoint_cadence import cadence_document, save_bytes
from smelt_jax.compile.layout_table import (BEGIN, END, TABLE_HEADER, program_lines, render_table,  # noqa: F401
                                            replace_generated, table_row)
from smelt_jax.compile.collective_form import best_collectives
from smelt_jax.compile.isolated import CompileCrashed, Isolated
from smelt_jax.compile.loop_form import best_form, faster, form_chain
from smelt_jax.compile.overflow import step_overflow_passes
from smelt_jax.compile.results_ledger import Ledger, report_from_dict
from smelt_jax.compile.report import (
    ANALYSIS_VERSION,
    CompileReport,
    analyse,
    conventional_train_flops,
    read_hlo,
    with_accounting,
)
from smelt_jax.design.descriptors import Parallelism, RunSpec, content_hash
from smelt_jax.platform.errors import UsageError
from smelt_jax.platform.hardware import parse_slice
from smelt_jax.compile.pair_cost import BEGIN as COST_BEGIN
from smelt_jax.compile.pair_cost import END as COST_END
from smelt_jax.compile.pair_cost import cost_table
from smelt_jax.parallel.layout import run_key
from smelt_jax.platform.paths import checkout_root

# Bump when the compiled program or the report's fields change: older cache files are then ignored.
CACHE_VERSION = 5  # 2: Pallas lane tiles chosen to pad least; HLO kept. 3: splash + ragged defaults on TPU
# 4: d and f one block in the expert kernels (kernels/gmm.py ONE_BLOCK_LANES); ring exchange candidates
# 5: a looped model's scans of distinct lengths (model/layer.py distinct_scan_lengths; Baselines unchanged)
# Bump when a change alters the compiled programs but not how a configuration's candidates rank (a kernel
# that removes the same work from every candidate): every record keeps the version of the program that made
# it (`recorded_program`); records of an older program still answer for the candidates the search compares
# and rejects, and the candidate it keeps is compiled again (`search_layout`), so a report after a bump costs
# one compile per configuration instead of the whole search, and the report lists what is still older.
# Bump CACHE_VERSION instead when older records can no longer be compared with new ones.
PROGRAM_VERSION = 2  # 1: every record made before versions were recorded
# 2: the router weight applied and differentiated in the down-projection kernel (kernels/gmm.py row_weight)
CACHE_DIR = checkout_root() / "data_cache" / "compile_report"

def cache_path(run: RunSpec, candidate: Candidate, cache_dir: Path = CACHE_DIR) -> Path:
    """One file per (configuration content, layout): independent of the run's own parallelism field,
    so run ids that change when layouts are written into the descriptors still hit the cache."""
    digest = content_hash({"version": CACHE_VERSION, "model": run.model.to_dict(),
                           "schedule": run.schedule.to_dict(), "layout": candidate.layout.to_dict()})
    return Path(cache_dir) / f"{run_key(run).replace('/', '_')}__{digest}.json"


def hlo_path(cache_file: Path) -> Path:
    """Where the compiled HLO of a cached compile is kept (next to its JSON; absent for an OOM)."""
    return cache_file.with_name(cache_file.name.removesuffix(".json") + ".hlo.gz")


def _write_cache(path: Path, run: RunSpec, candidate: Candidate, report: CompileReport,
                 program: int | None = None) -> None:
    """The cache file of one compile; `program`: the version that compiled it (default this checkout's)."""
    program = PROGRAM_VERSION if program is None else program
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": run_key(run), "candidate": candidate.layout.to_dict(),
                               "report": report.as_dict(), "program": program}, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: an interrupted write leaves no half file behind


def recorded_program(run: RunSpec, candidate: Candidate, cache_dir: Path = CACHE_DIR,
                     ledger: Ledger | None = None) -> int | None:
    """The PROGRAM_VERSION of the program `compile_cached` would answer with (1 for records made before
    versions were recorded), None when nothing is recorded."""
    path = cache_path(run, candidate, cache_dir)
    if path.exists():
        return json.loads(path.read_text()).get("program", 1)
    if ledger is not None and ledger.get(path.name) is not None:
        return ledger.program(path.name)
    return None


def is_cached(run: RunSpec, candidate: Candidate, cache_dir: Path = CACHE_DIR,
              ledger: Ledger | None = None) -> bool:
    """Whether `compile_cached` would answer without compiling."""
    path = cache_path(run, candidate, cache_dir)
    return path.exists() or (ledger is not None and ledger.get(path.name) is not None)


def compile_cached(run: RunSpec, candidate: Candidate, compile_fn: Callable[..., CompileReport],
                   cache_dir: Path = CACHE_DIR, ledger: Ledger | None = None) -> tuple[CompileReport, bool]:
    """(report, from_cache) for one candidate: the cache file, else the ledger's current record, else
    compiled (and the cache file written)."""
    path = cache_path(run, candidate, cache_dir)
    if path.exists():
        data = json.loads(path.read_text())
        report = report_from_dict(data["report"])
        if report.analysis_version < ANALYSIS_VERSION and hlo_path(path).exists():
            report = _reanalysed(run, report, read_hlo(hlo_path(path)))  # every candidate by one walk
            _write_cache(path, run, candidate, report, data.get("program", 1))
        return report, True
    recorded = ledger.get(path.name) if ledger is not None else None
    if recorded is not None:
        return recorded, True
    return compile_fresh(run, candidate, compile_fn, cache_dir), False


def compile_fresh(run: RunSpec, candidate: Candidate, compile_fn: Callable[..., CompileReport],
                  cache_dir: Path = CACHE_DIR) -> CompileReport:
    """Compile one candidate by this checkout's program, whatever is recorded, and cache the result."""
    path = cache_path(run, candidate, cache_dir)
    layout = candidate.layout
    report = compile_fn(run, layout.tpu_type, layout, remat=layout.remat, hlo_path=hlo_path(path))
    _write_cache(path, run, candidate, report)
    return report


def _reanalysed(run: RunSpec, report: CompileReport, hlo_text: str | None, by_kind: dict | None = None,
                fill: float | None = None) -> CompileReport:
    """`report` analysed again by the current `analyse` from its kept HLO and program FLOPs (`by_kind`:
    all devices; default the report's own)."""
    devices = parse_slice(report.slice).chips
    if by_kind is None and report.program_flops_by_kind is not None:
        by_kind = {kind: value * devices for kind, value in report.program_flops_by_kind.items()}
    conventional = report.conventional_flops or conventional_train_flops(
        run.model, run.schedule.tokens_per_step / devices)
    return analyse(report, by_kind, hlo_text, pallas_fill=fill or report.pallas_fill or 1.0,
                   conventional_flops=conventional, overflow_passes=step_overflow_passes(run, report.layout))


def complete_analysis(run: RunSpec, result: SearchResult, trace_fn: Callable[..., Any],
                      cache_dir: Path = CACHE_DIR, ledger: Ledger | None = None) -> SearchResult:
    """`result` with its chosen report's program FLOPs, executed collectives and roofline filled in
    when a cached report (made before they existed) lacks them: FLOPs by tracing the train step
    (`trace_fn`, e.g. `compile_report.trace_program_flops`: seconds, no compile), collectives from the
    compiled HLO kept next to the cache file (absent for compiles made before HLO was kept: those stay
    without, until recompiled), the FLOP accounting by one more trace with remat 'none'. Reports
    analysed by an older ANALYSIS_VERSION are re-analysed from their kept HLO. The cache file is
    updated, so this runs once per configuration."""
    report = result.report
    if result.chosen is None or report is None:
        return result
    candidate = Candidate(result.chosen)
    path = cache_path(run, candidate, cache_dir)
    hlo = hlo_path(path)
    need_flops = report.program_flops is None
    need_hlo = report.executed_collectives is None and hlo.exists()
    stale = (report.analysis_version < ANALYSIS_VERSION or report.flops_accounting is None
             or report.checkpoint_bytes is None)
    if not (need_flops or need_hlo or stale):
        return result
    by_kind, fill = None, None
    if need_flops:
        flops, fill = trace_fn(run, result.slice, result.chosen, remat=result.chosen.remat)
        by_kind = flops.by_kind
    report = _reanalysed(run, report, read_hlo(hlo) if hlo.exists() else None, by_kind, fill)
    report = dataclasses.replace(report, suite=run.suite, checkpoint_bytes=save_bytes(run))
    if report.flops_accounting is None:
        report = with_accounting(report, run, trace_fn)
    _write_cache(path, run, candidate, report, recorded_program(run, candidate, cache_dir, ledger))
    return dataclasses.replace(result, report=report)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    key: str
    run_id: str
    slice: str
    chosen: Parallelism | None  # None: nothing fitted, or not (fully) compiled
    report: CompileReport | None  # the chosen layout's report, else the last one tried
    tried: tuple[tuple[str, str], ...]  # (candidate label, outcome) in order
    status: str  # "fits" | "does not fit" | "not compiled (...)"
    # the loop-form and collectives comparisons (`loop_form.best_form`, `collective_form.best_collectives`):
    # (layout, report) of the scan's winner, then of every other-form compile; () when none was compiled
    compared: tuple = ()
    # labels of the candidates whose answer came from an older program than PROGRAM_VERSION, in `tried` order
    older_programs: tuple[str, ...] = ()

    @property
    def chosen_is_older(self) -> bool:
        """The kept candidate's record is of an older program (a report run that compiled nothing)."""
        return self.chosen is not None and Candidate(self.chosen).label in self.older_programs


def search_layout(run: RunSpec, compile_fn: Callable[..., CompileReport], policy: SearchPolicy, *,
                  cache_dir: Path = CACHE_DIR, ledger: Ledger | None = None, skip_reason: str | None = None,
                  log: Callable[[str], None] = lambda line: None) -> SearchResult:
    """Search `candidates(run, policy.slice_for(run), ..., policy.exchanges)` (cached results reused),
    an expert axis size at a time, in two stages:

    1. each exchange at the first remat (none -> dots -> full) that fits with headroom; the exchange
       with the lowest roofline step wins (ties: the earlier in `policy.exchanges`);
    2. at that exchange, the following remats in order while each lowers the step (the steps are
       HBM-bound with compute to spare, so recomputing can cost less than saving: 100M S95 Baseline,
       none 0.117 s, dots 0.112, full 0.111; S0 SMELT 0.199, 0.194, 0.198, docs/performance.md);
    3. with stages 1-2 in the first of `policy.layer_loops` (the scan), each other loop form (unrolled)
       at the winning exchange: its first remat that fits, then while the step falls; the faster program
       that fits is kept (ties: the scan; `loop_form.best_form`, recorded in `SearchResult.compared`);
    4. the kept program once more with each other collectives form (compiler options: 'async'); the
       faster that fits is kept (ties: 'auto'; `collective_form.best_collectives`, also in `compared`).

    That is 4 compiles (+ 1-3 for stage 3) for a configuration whose 'none' fits (not the 6 of every pair), and the same
    choice as comparing all six on the 100M pairs measured so far. The first expert size with a fitting
    layout is kept. With a `skip_reason` nothing is compiled: only cached results are used; a missing
    one of the first exchange stops the search with status 'not compiled (skip_reason)', of a later
    exchange leaves it out of the comparison, of stage 2 ends the walk, of stage 3 leaves that loop form
    out (the configuration keeps its scan program). A compile that crashes (`compile_fn` raising
    `isolated.CompileCrashed`: killed for host memory, a libtpu crash) is not compiled in the same way,
    its reason in `tried` and, for the first exchange, in the status; it is not cached.

    Records of an older program (PROGRAM_VERSION) answer like any other, and are listed in
    `older_programs`; the candidate kept is then compiled again by this checkout's program (without a
    `skip_reason`), and its new report is the result's (status 'does not fit (by program N)' if that one
    does not fit with headroom).
    """
    slice_name = policy.slice_for(run)
    tried: list[tuple[str, str]] = []
    older: list[str] = []  # candidates answered by a record of an older program
    last = None
    why = skip_reason  # why the last candidate answered None (not compiled)

    def attempt(candidate: Candidate) -> CompileReport | None:
        nonlocal last, why
        if skip_reason is not None and not is_cached(run, candidate, cache_dir, ledger):
            tried.append((candidate.label, f"not compiled ({skip_reason})"))
            return None
        start = time.perf_counter()
        try:
            report, cached = compile_cached(run, candidate, compile_fn, cache_dir, ledger)
        except CompileCrashed as err:  # this candidate fails alone (`compile.isolated`)
            why = str(err)
            log(f"  {run_key(run)} {candidate.label}: not compiled ({why})")
            tried.append((candidate.label, f"not compiled ({why})"))
            return None
        program = recorded_program(run, candidate, cache_dir, ledger) if cached else PROGRAM_VERSION
        if program < PROGRAM_VERSION and candidate.label not in older:
            older.append(candidate.label)
        log_outcome(candidate, report, "(cached)" if cached else _compiled_note(report, start),
                    "" if program == PROGRAM_VERSION else f", program {program}")
        last = report
        return report

    def log_outcome(candidate: Candidate, report: CompileReport, note: str, program_note: str = "") -> None:
        outcome = ("fits" if fits_with_headroom(report) else "out of memory" if not report.peak_fits_hbm
                   else f"over {HBM_HEADROOM:.0%} of HBM") + f" {note}"
        log(f"  {run_key(run)} {candidate.label}: {outcome}{program_note}")
        tried.append((candidate.label, outcome + program_note))

    def current_program(candidate: Candidate, report: CompileReport, compared: tuple):
        """The kept candidate by this checkout's program: compiled again when its record is older
        (not with a `skip_reason`: then it stays listed in `older`)."""
        if candidate.label not in older or skip_reason is not None:
            return report, compared
        start = time.perf_counter()
        try:
            fresh = compile_fresh(run, candidate, compile_fn, cache_dir)
        except CompileCrashed as err:  # the older program's record stays, listed as older
            log(f"  {run_key(run)} {candidate.label}: not compiled again ({err}); the older program's record kept")
            tried.append((candidate.label, f"not compiled again ({err})"))
            return report, compared
        older.remove(candidate.label)
        log_outcome(candidate, fresh, f"(kept, compiled again by program {PROGRAM_VERSION}: "
                    + _compiled_note(fresh, start)[1:])
        compared = tuple((layout, fresh if layout == candidate.layout else r) for layout, r in compared)
        return fresh, compared

    loops = policy.layer_loops
    cands = candidates(run, slice_name, policy.expert_axis_sizes, policy.exchanges, loops, policy.collectives)
    for _, group in itertools.groupby(cands, key=lambda c: dataclasses.replace(
            c.layout, exchange="auto", remat="none", layer_loop="auto", collectives="auto")):
        group = list(group)
        chains = [form_chain(group, exchange, loops[0]) for exchange in policy.exchanges]
        firsts = []  # (chain, position, candidate, report) of each exchange's first fitting remat
        for n, chain in enumerate(chains):
            for position, candidate in enumerate(chain):
                report = attempt(candidate)
                if report is None:
                    if n == 0:
                        return SearchResult(run_key(run), run.id, slice_name, None, last, tuple(tried),
                                            f"not compiled ({why})")
                    break
                if fits_with_headroom(report):
                    firsts.append((chain, position, candidate, report))
                    break
        if not firsts:
            continue
        best = firsts[0]
        for entry in firsts[1:]:
            if faster(entry[3], best[3]):
                best = entry
        chain, position, candidate, report = best
        for following in chain[position + 1:]:
            next_report = attempt(following)
            if next_report is None or not fits_with_headroom(next_report) or not faster(next_report, report):
                break
            candidate, report = following, next_report
        candidate, report, compared = best_form(group, candidate, report, loops, attempt)  # 3. the loop form
        candidate, report, compared = best_collectives(candidate, report, policy.collectives, attempt,
                                                       compared)  # 4. the compiler options
        report, compared = current_program(candidate, report, compared)
        if not fits_with_headroom(report):  # the kept candidate's current program no longer fits
            return SearchResult(run_key(run), run.id, slice_name, None, report, tuple(tried),
                                f"does not fit (by program {PROGRAM_VERSION})", compared, tuple(older))
        return SearchResult(run_key(run), run.id, slice_name, candidate.layout, report, tuple(tried), "fits",
                            compared, tuple(older))
    return SearchResult(run_key(run), run.id, slice_name, None, last, tuple(tried), "does not fit",
                        older_programs=tuple(older))


def _compiled_note(report: CompileReport, start: float) -> str:
    host = f", {report.host_peak_bytes / 1e9:.1f} GB host" if report.host_peak_bytes else ""
    return f"({time.perf_counter() - start:.0f} s{host})"


def ordered(runs: Iterable[RunSpec], priority: Sequence[str] = ()) -> list[RunSpec]:
    """The `priority` configurations first, then the rest in their given order."""
    runs = list(runs)
    rank = {key: i for i, key in enumerate(priority)}
    return sorted(runs, key=lambda r: (rank.get(run_key(r), len(rank)), runs.index(r)))


def layouts_document(results: Iterable[SearchResult], suite: str) -> str:
    """experiments/layouts.json text: {'suite', 'layouts': {key: Parallelism fields}} for the fitting
    configurations, keys and fields sorted (byte-identical for the same results)."""
    layouts = {r.key: r.chosen.to_dict() for r in results if r.chosen is not None}
    return json.dumps({"suite": suite, "layouts": dict(sorted(layouts.items()))},
                      indent=1, sort_keys=True) + "\n"


@dataclasses.dataclass(frozen=True)
class SuiteReport:
    results: tuple[SearchResult, ...]  # in suite order
    seconds: float
    written: tuple[Path, ...]          # the files (re)written

    @property
    def fitted(self) -> int:
        return sum(r.status == "fits" for r in self.results)

    def summary(self) -> str:
        return f"{self.fitted} of {len(self.results)} configurations fit; {self.seconds:.0f} s"


def compile_suite(runs: Sequence[RunSpec], policy: SearchPolicy, *, suite: str,
                  only: Iterable[str] = (), time_budget: float | None = None, cached_only: bool = False,
                  cache_dir: Path = CACHE_DIR, markdown_out: Path | None = None,
                  json_out: Path | None = None, costs_out: Path | None = None,
                  cadence_out: Path | None = None, results_out: Path | None = None,
                  command: str | None = None, flop_savings: dict | None = None,
                  compile_fn: Callable[..., CompileReport] | None = None,
                  trace_fn: Callable[..., Any] | None = None,
                  libtpu: tuple[bool, str] | None = None,
                  log: Callable[[str], None] = lambda line: None) -> SuiteReport:
    """Choose a layout for every configuration of `runs` (a suite, in its order); resumable.

    Configurations go in `policy.priority` order. Nothing is compiled (cached results only, the rest
    reported 'not compiled (why)') when libtpu is unavailable, with `cached_only`, for a configuration
    outside `only` (scales or layout keys), or once `time_budget` seconds have passed. Reports cached
    before program FLOPs and collectives were recorded get them (`complete_analysis`). Writes the
    markdown table section of `markdown_out`, the layouts file `json_out`, the pair-cost section of
    `costs_out` (`compile.pair_cost`, with `flop_savings` priced in chip-hours when given) and the
    checkpoint cadence file `cadence_out` (`compile.checkpoint_cadence`) when given. With
    `results_out`, compiles are also looked up in that ledger (`compile.results_ledger`: the committed
    record that lets a report resume on another machine) and every compile of the suite's current
    candidates is written to it after each configuration, records of candidates no longer searched
    dropped.
    """
    from smelt_jax.compile import aot, report

    compile_fn = compile_fn or Isolated(report.compile_run)  # each compile in a child: fails alone
    trace_fn = trace_fn or report.trace_program_flops
    available, reason = libtpu if libtpu is not None else aot.libtpu_status()
    runs = list(runs)
    in_priority = ordered(runs, policy.priority)
    wanted = set(only)
    unknown = wanted - {r.scale for r in runs} - {run_key(r) for r in runs}
    if unknown:
        raise UsageError(f"--only {sorted(unknown)}: not a scale or key of suite {suite}")
    ledger = Ledger.load(results_out)
    names = {run_key(run): [(c, cache_path(run, c, cache_dir)) for c in
                            candidates(run, policy.slice_for(run), policy.expert_axis_sizes, policy.exchanges,
                                       policy.layer_loops, policy.collectives)]
             for run in runs}
    ledger.keep_only({path.name for listed in names.values() for _, path in listed})
    start = time.perf_counter()
    results = {}
    for i, run in enumerate(in_priority, 1):
        key = run_key(run)
        skip = None
        if not available:
            skip = f"libtpu unavailable: {reason}"
        elif cached_only:
            skip = "not yet: no cached compile; `make compile-report` compiles it"
        elif wanted and run.scale not in wanted and key not in wanted:
            skip = "not yet: outside --only in the last report run; `make compile-report` resumes"
        elif time_budget is not None and time.perf_counter() - start > time_budget:
            skip = (f"not yet: the last report run stopped at its {time_budget:.0f} s budget; "
                    "`make compile-report` resumes")
        log(f"[{i}/{len(in_priority)}] {key} on {policy.slice_for(run)} "
            f"({time.perf_counter() - start:.0f} s elapsed)" + (f": cached results only ({skip})" if skip else ""))
        result = search_layout(run, compile_fn, policy, cache_dir=cache_dir, ledger=ledger, skip_reason=skip,
                               log=log)
        if available:  # program FLOPs and collectives for reports cached before they were recorded
            result = complete_analysis(run, result, trace_fn, cache_dir, ledger)
        log(f"  -> {result.status}")
        results[key] = result
        if results_out:  # after every configuration: an interrupted report loses no compile
            for _, path in names[key]:
                if path.exists():
                    data = json.loads(path.read_text())
                    ledger.add(path.name, key, data["candidate"], report_from_dict(data["report"]),
                               data.get("program", 1))
            ledger.write()
    in_order = tuple(results[run_key(r)] for r in runs)
    written = []
    if markdown_out:
        out = Path(markdown_out)
        doc = out.read_text() if out.exists() else "# Parallelism\n"
        command = command or (f"smelt compile-report --suite {suite} --out {markdown_out}"
                              + (f" --costs-out {costs_out}" if costs_out else ""))
        out.write_text(replace_generated(doc, render_table(in_order, command)))
        log(f"wrote {out}")
        written.append(out)
    if costs_out:
        out = Path(costs_out)
        out.write_text(replace_generated(out.read_text() if out.exists() else "", cost_table(runs, in_order, flop_savings),
                                         COST_BEGIN, COST_END))
        log(f"wrote {out}")
        written.append(out)
    if cadence_out:
        Path(cadence_out).write_text(cadence_document(runs, in_order, suite))
        log(f"wrote {cadence_out}")
        written.append(Path(cadence_out))
    if json_out:
        Path(json_out).write_text(layouts_document(in_order, suite))
        log(f"wrote {json_out}")
        written.append(Path(json_out))
    if results_out:
        ledger.write()
        log(f"wrote {results_out}")
        written.append(Path(results_out))
    return SuiteReport(in_order, time.perf_counter() - start, tuple(written))

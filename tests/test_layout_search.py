"""Layout search for the compile report (with a stand-in compiler), experiments/layouts.json, and the
slow acceptance check: the smelt16 200M and 1.6B S~97% pairs compile for their chosen TPU slices."""

import dataclasses
import json
import warnings

import pytest

import experiments
from experiments.placement import LAYOUTS_FILE, SMELT16_POLICY
from smelt_jax.parallel import sharding
from smelt_jax.compile import aot
from smelt_jax.compile import layout_search as ls
from smelt_jax.compile import report as cr
from smelt_jax.compile.candidates import REMAT_ORDER
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.platform.hardware import parse_slice
from smelt_jax.parallel.layout import layout_key, load_layouts, run_key

SMELT16 = experiments.load_suite("smelt16")
# Stages 1-2 (exchange, remat) with the layer stacks a scan only: what these tests count. The loop form
# (stage 3: unrolled at the winning exchange, compile/loop_form.py) is tested in tests/test_loop_form.py.
SCAN_ONLY = dataclasses.replace(SMELT16_POLICY, layer_loops=("auto",), collectives=("auto",))


def _run(key):
    return next(r for r in SMELT16 if run_key(r) == key)


def _fake_compiler(fits_when, calls):
    """A compile_run stand-in: fits when `fits_when(layout)`; records every call."""
    def compile_fn(run, slice_name, layout, remat, hlo_path=None):
        calls.append((run.id, layout.remat))
        fits = fits_when(layout)
        return cr.CompileReport(
            run_id=run.id, slice=slice_name, layout={"data": layout.data, "fsdp": layout.fsdp,
                                                     "expert": layout.expert, "tensor": layout.tensor},
            remat=remat, expert_impl="pallas", peak_fits_hbm=fits,
            error=None if fits else "RESOURCE_EXHAUSTED: exceeds available HBM", compile_seconds=1.0,
            argument_bytes=2**30, output_bytes=2**30, temp_bytes=3 * 2**30,
            peak_bytes=4 * 2**30 if fits else None, hbm_bytes=95 * 2**30, compiled_flops=3e13,
            budget_flops=2e13, optimal_seconds=-1.0, collectives={"all-to-all": 8})
    return compile_fn


def test_candidates_split_experts_evenly_and_fill_the_slice():
    for run in SMELT16:
        slice_name = SMELT16_POLICY.slice_for(run)
        chips = parse_slice(slice_name).chips
        cands = ls.candidates(run, slice_name, SMELT16_POLICY.expert_axis_sizes)
        assert [c.layout.remat for c in cands] == list(REMAT_ORDER)
        for c in cands:
            p = c.layout
            assert run.model.n_experts % p.expert == 0 and p.expert > 1  # Pallas needs the shard_map path
            assert run.model.d_model % p.fsdp == 0  # else fit_spec replicates weights over fsdp
            assert sharding.mesh_shape(p, chips) == (p.data, p.fsdp, p.expert, p.tensor)
            assert p.tpu_type == slice_name


def test_search_keeps_the_first_fitting_candidate_and_resumes_from_the_cache(tmp_path):
    run = _run("200m/s97/smelt")
    calls = []
    compile_fn = _fake_compiler(lambda p: p.remat == "full", calls)
    first = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path)
    assert first.status == "fits" and first.chosen.remat == "full"
    # each exchange (the ring, then the default) down the remats to the first that fits
    assert [remat for _, remat in calls] == ["none", "dots", "full", "none", "dots", "full"]
    assert [outcome.split(" ")[0] for _, outcome in first.tried] == ["out", "out", "fits"] * 2
    # A second report run compiles nothing and gives the same answer.
    again = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path)
    assert len(calls) == 6 and again.chosen == first.chosen and again.report == first.report
    assert all(outcome.endswith("(cached)") for _, outcome in again.tried)


def test_a_layout_the_compiler_accepts_but_without_headroom_is_not_chosen(tmp_path):
    run = _run("1.6b/s97/smelt")
    base = _fake_compiler(lambda p: True, [])

    def tight(run, slice_name, layout, remat, hlo_path=None):  # accepted, peak under HBM, args + temps at 96% of HBM
        r = base(run, slice_name, layout, remat)
        temps = int(0.96 * r.hbm_bytes) - r.argument_bytes if remat != "full" else r.temp_bytes
        return dataclasses.replace(r, temp_bytes=temps)

    result = ls.search_layout(run, tight, SCAN_ONLY, cache_dir=tmp_path)
    assert result.chosen.remat == "full"
    assert [o.split(" (")[0] for _, o in result.tried] == ["over 95% of HBM", "over 95% of HBM", "fits"] * 2


def test_of_the_first_fitting_layout_the_exchange_with_the_lower_roofline_step_wins(tmp_path):
    run = _run("100m/s95/smelt")
    steps = {"auto": 0.30, "ring": 0.25}

    def compile_fn(run_, slice_name, layout, remat, hlo_path=None):
        r = _fake_compiler(lambda p: p.remat == "dots", [])(run_, slice_name, layout, remat)
        return dataclasses.replace(r, step_seconds=steps[layout.exchange])

    result = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path)
    assert result.chosen.remat == "dots" and result.chosen.exchange == "ring"
    assert result.report.step_seconds == 0.25
    # both exchanges to their first fitting remat, then the winner's next remat (it does not fit: stop)
    assert _labels(result) == [("none", "ring"), ("dots", "ring"), ("none", "auto"), ("dots", "auto"),
                               ("full", "ring")]
    document = json.loads(ls.layouts_document([result], "smelt16"))
    assert document["layouts"]["100m/s95/smelt"]["exchange"] == "ring"  # recorded with the layout
    assert load_layouts_text(document)["100m/s95/smelt"].with_exchange(run.model).expert_exchange == "ring"
    steps["auto"] = 0.20  # the padded exchange wins: 'auto' is left out of the layouts file
    padded = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path / "again")
    assert padded.chosen.exchange == "auto" and "exchange" not in padded.chosen.to_dict()
    assert padded.chosen.with_exchange(run.model) == run.model


def test_the_winning_exchange_walks_the_remats_while_the_step_falls(tmp_path):
    """HBM-bound steps can be cheaper with recomputation: remat is chosen by step, not by fit alone."""
    run = _run("100m/s95/baseline")
    steps = {("none", "auto"): 0.130, ("none", "ring"): 0.117, ("dots", "auto"): 0.125,
             ("dots", "ring"): 0.112, ("full", "auto"): 0.126, ("full", "ring"): 0.111}
    calls = []

    def compile_fn(run_, slice_name, layout, remat, hlo_path=None):
        r = _fake_compiler(lambda p: True, calls)(run_, slice_name, layout, remat)
        return dataclasses.replace(r, step_seconds=steps[(remat, layout.exchange)])

    result = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path)
    # 100M S95 Baseline's measured steps: none for both exchanges, then dots and full of the ring: 4 compiles
    assert _labels(result) == [("none", "ring"), ("none", "auto"), ("dots", "ring"), ("full", "ring")]
    assert (result.chosen.remat, result.chosen.exchange) == ("full", "ring") and result.report.step_seconds == 0.111
    steps[("full", "ring")] = steps[("dots", "ring")]  # a tie: the earlier (cheaper to compile, less memory)
    tie = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path / "tie")
    assert (tie.chosen.remat, tie.chosen.exchange) == ("dots", "ring")
    # 100M S0 SMELT's measured shape: dots best, full worse
    steps.update({("none", "auto"): 0.30, ("none", "ring"): 0.199, ("dots", "ring"): 0.194,
                  ("full", "ring"): 0.198})
    s0 = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path / "s0")
    assert (s0.chosen.remat, s0.report.step_seconds) == ("dots", 0.194) and len(s0.tried) == 4
    steps[("dots", "ring")] = 0.205  # dots slower than none: the walk stops, full is never compiled
    early = ls.search_layout(run, compile_fn, SCAN_ONLY, cache_dir=tmp_path / "early")
    assert _labels(early) == [("none", "ring"), ("none", "auto"), ("dots", "ring")]
    assert (early.chosen.remat, early.report.step_seconds) == ("none", 0.199)


def _labels(result):
    """(remat, exchange) of each candidate the search tried, in order."""
    out = []
    for label, _ in result.tried:
        fields = dict(part.split("=") for part in label.split(","))
        out.append((fields["remat"], fields.get("exchange", "auto")))
    return out


def load_layouts_text(document):
    return {key: Parallelism(**fields) for key, fields in document["layouts"].items()}


def test_skipped_configurations_are_reported_without_numbers(tmp_path):
    run = _run("1.6b/s97/baseline")
    calls = []
    result = ls.search_layout(run, _fake_compiler(lambda p: True, calls), SMELT16_POLICY, cache_dir=tmp_path,
                              skip_reason="time budget of 10 s spent")
    assert calls == [] and result.chosen is None
    assert result.status == "not compiled (time budget of 10 s spent)"
    row = ls.table_row(result)
    assert "not compiled (time budget of 10 s spent)" in row and "GiB" not in row
    assert not any(ch.isdigit() for ch in row.split("|")[4])  # no invented memory figure
    nofit = ls.search_layout(run, _fake_compiler(lambda p: False, []), SMELT16_POLICY, cache_dir=tmp_path)
    assert nofit.status == "does not fit" and "RESOURCE_EXHAUSTED" in ls.table_row(nofit)


def test_table_and_layouts_file_are_deterministic(tmp_path):
    runs = [_run("200m/s97/smelt"), _run("100m/s0/baseline")]
    results = [ls.search_layout(r, _fake_compiler(lambda p: p.remat == "dots", []), SMELT16_POLICY,
                                cache_dir=tmp_path)
               for r in runs]
    doc = ls.layouts_document(results, "smelt16")
    assert doc == ls.layouts_document(list(reversed(results)), "smelt16")
    data = json.loads(doc)
    assert list(data["layouts"]) == sorted(data["layouts"]) == ["100m/s0/baseline", "200m/s97/smelt"]
    table = ls.render_table(results, "smelt compile-report")
    assert "30.0 (x1.50)" in table  # XLA's count: 3e13 / 2e13
    row = next(line for line in table.splitlines() if line.startswith("| 100m/s0/baseline | v5p-128 |")).split("|")
    assert row[-4].strip() == "?" and row[-3].strip() == "?"  # no program FLOPs yet: no step, no MFU
    doc_md = ls.replace_generated("# P\n\ntext\n", table)
    assert ls.replace_generated(doc_md, table) == doc_md and doc_md.startswith("# P\n\ntext\n")


def test_cached_reports_get_program_flops_and_collectives_once(tmp_path):
    from smelt_jax.compile.program_flops import ProgramFlops
    from smelt_jax.compile.report import write_hlo
    from tests.hlo_samples import SYNTHETIC_HLO

    run = _run("200m/s97/smelt")
    result = ls.search_layout(run, _fake_compiler(lambda p: p.remat == "full", []), SMELT16_POLICY,
                              cache_dir=tmp_path)
    path = ls.cache_path(run, ls.Candidate(result.chosen), tmp_path)
    write_hlo(ls.hlo_path(path), SYNTHETIC_HLO)
    traced = []

    def trace_fn(run_, slice_name, layout, remat):
        traced.append(remat)
        return ProgramFlops(64 * 40e12, {"dot_general": 64 * 40e12}, 0, 0), 1.0

    done = ls.complete_analysis(run, result, trace_fn, tmp_path)
    assert traced == ["full", "none"] and done.report.program_flops == 40e12  # "none": the remat term
    assert done.report.executed_collectives == {"all-gather": 12, "all-reduce": 12, "all-to-all": 1}
    assert done.report.mfu == pytest.approx(20e12 / 40e12)  # compute-bound: budget / program
    again = ls.search_layout(run, _fake_compiler(lambda p: True, []), SMELT16_POLICY, cache_dir=tmp_path)
    assert again.report.program_flops == 40e12  # written back to the cache
    assert ls.complete_analysis(run, again, trace_fn, tmp_path).report == again.report
    assert traced == ["full", "none"]  # nothing traced again
    assert done.report.flops_accounting["remat"] == 0.0  # the fake traces equal with and without remat
    assert "40.0 (x2.00)" in ls.table_row(done) and "| 50.0% |" in ls.table_row(done)


def test_committed_layouts_are_valid_parallelism_for_their_slice():
    layouts = load_layouts(LAYOUTS_FILE)
    if not LAYOUTS_FILE.exists():
        pytest.fail(f"{LAYOUTS_FILE} missing: run `make compile-report`")
    raw = json.loads(LAYOUTS_FILE.read_text())
    assert raw["suite"] == "smelt16" and layouts
    keys = {layout_key(r.scale, r.sparsity_label, r.arch): r for r in SMELT16}
    for key, layout in layouts.items():
        assert key in keys, key
        assert set(raw["layouts"][key]) == set(layout.to_dict())  # every field ('exchange' when not auto)
        tpu = parse_slice(layout.tpu_type)
        assert layout.remat in ("none", "full", "dots", "dots_no_batch")
        assert keys[key].model.n_experts % layout.expert == 0
        assert keys[key].model.d_model % layout.fsdp == 0
        shape = sharding.mesh_shape(layout, tpu.chips)
        assert shape[0] * shape[1] * shape[2] * shape[3] == tpu.chips
    # make_mesh accepts every layout over its slice's (compile-only) TPU devices.
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(f"mesh shapes checked; make_mesh over TPU devices needs libtpu: {reason}")
    for layout in layouts.values():
        tpu = parse_slice(layout.tpu_type)
        with warnings.catch_warnings():  # every layout in ring order: no fallback to the listed order
            warnings.simplefilter("error", RuntimeWarning)
            mesh = sharding.make_mesh(layout, aot.tpu_topology(tpu.topology_desc).devices)
        assert mesh.size == tpu.chips and mesh.shape["expert"] == layout.expert


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize("key", ["200m/s97/baseline", "200m/s97/smelt",
                                 "1.6b/s97/baseline", "1.6b/s97/smelt"])
def test_acceptance_pairs_compile_for_their_chosen_slices(key):
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    layout = load_layouts(LAYOUTS_FILE).get(key)
    assert layout is not None, f"{key} has no layout in {LAYOUTS_FILE}"
    report = cr.compile_run(_run(key), layout.tpu_type, layout)
    print(cr.format_report(report))
    assert report.peak_fits_hbm and report.error is None and ls.fits_with_headroom(report)
    assert 0 < report.peak_bytes < report.hbm_bytes
    assert report.argument_bytes + report.temp_bytes <= ls.HBM_HEADROOM * report.hbm_bytes
    # experts exchanged over the expert axis: all-to-alls, or the ring's gathers and scatters
    exchanged = "reduce-scatter" if layout.exchange == "ring" else "all-to-all"
    assert report.collectives.get(exchanged, 0) > 0


def test_tpu_expert_backend_is_pallas_only_where_the_shard_map_path_runs():
    run = _run("200m/s97/smelt")
    with_experts = sharding.make_mesh(Parallelism(data=1, fsdp=-1, expert=2))
    without = sharding.make_mesh(Parallelism(data=2, fsdp=-1, expert=1))
    assert cr._tpu_config(run, with_experts).expert_impl == "pallas"
    assert cr._tpu_config(run, without).expert_impl == "ragged_dot"  # GSPMD must partition it


def test_compile_suite_is_resumable_and_writes_the_table_and_layouts(tmp_path):
    from smelt_jax.compile.program_flops import ProgramFlops

    runs = [_run("100m/s0/baseline"), _run("200m/s97/smelt")]
    calls, lines = [], []
    compile_fn = _fake_compiler(lambda p: p.remat == "dots", calls)

    def trace_fn(run_, slice_name, layout, remat):
        return ProgramFlops(64 * 40e12, {"dot_general": 64 * 40e12}, 0, 0), 1.0

    md, layouts = tmp_path / "p.md", tmp_path / "layouts.json"
    report = ls.compile_suite(runs, SCAN_ONLY, suite="smelt16", cache_dir=tmp_path / "cache",
                              markdown_out=md, json_out=layouts, compile_fn=compile_fn,
                              trace_fn=trace_fn, libtpu=(True, ""), log=lines.append)
    assert report.fitted == 2 and [r.key for r in report.results] == ["100m/s0/baseline", "200m/s97/smelt"]
    assert lines[0].startswith("[1/2] 200m/s97/smelt on v5p-128")  # the priority order
    # per configuration: ring none, dots (fits); auto none, dots (fits, no faster); ring full (no fit: stop)
    assert len(calls) == 10 and report.written == (md, layouts)
    assert "smelt compile-report --suite smelt16 --out" in md.read_text()
    first = layouts.read_text()
    # Without libtpu nothing compiles: the cache alone gives the same layouts.
    again = ls.compile_suite(runs, SCAN_ONLY, suite="smelt16", cache_dir=tmp_path / "cache",
                             json_out=layouts, compile_fn=compile_fn, trace_fn=trace_fn,
                             libtpu=(False, "no libtpu here"))
    assert len(calls) == 10 and layouts.read_text() == first and again.summary().startswith("2 of 2")
    with pytest.raises(ValueError, match="not a scale or key"):
        ls.compile_suite(runs, SCAN_ONLY, suite="smelt16", only=["9b"], libtpu=(False, ""))


def test_the_ledger_lets_a_report_resume_on_another_machine(tmp_path):
    """The committed ledger stands in for a missing cache: a clone compiles nothing already recorded;
    records of another analysis version are compiled again; a damaged line is a clear error."""
    from smelt_jax.compile.program_flops import ProgramFlops
    from smelt_jax.compile.results_ledger import Ledger, results_file
    from smelt_jax.platform.errors import UsageError

    assert results_file(LAYOUTS_FILE).name == "compile_results.jsonl"
    assert results_file(LAYOUTS_FILE.with_name("layouts_ablations200m.json")).name == \
        "compile_results_ablations200m.jsonl"
    runs = [_run("100m/s95/baseline"), _run("100m/s95/smelt")]
    calls = []
    fake = _fake_compiler(lambda p: True, calls)
    steps = {"auto": 0.30, "ring": 0.25}

    def compile_fn(run_, slice_name, layout, remat, hlo_path=None):
        r = fake(run_, slice_name, layout, remat)
        step = steps[layout.exchange] - 0.01 * ("none", "dots", "full").index(remat)
        return dataclasses.replace(r, step_seconds=step, analysis_version=cr.ANALYSIS_VERSION,
                                   hbm_top=[{"name": "fusion.1"}])

    def trace_fn(run_, slice_name, layout, remat):
        return ProgramFlops(64 * 40e12, {"dot_general": 64 * 40e12}, 0, 0), 1.0

    ledger_file, layouts = tmp_path / "compile_results.jsonl", tmp_path / "layouts.json"
    kwargs = dict(suite="smelt16", json_out=layouts, results_out=ledger_file, compile_fn=compile_fn,
                  trace_fn=trace_fn, libtpu=(True, ""))
    first = ls.compile_suite(runs, SCAN_ONLY, cache_dir=tmp_path / "cache", **kwargs)
    assert len(calls) == 8 and ledger_file in first.written  # 4 compiles per configuration
    lines = ledger_file.read_text().splitlines()
    assert len(lines) == 8 and lines == sorted(lines, key=lambda line: json.loads(line)["name"])
    assert all("hbm_top" not in json.loads(line)["report"] for line in lines)  # kept small
    chosen = layouts.read_text()
    # Another machine: an empty cache, the ledger from git. Nothing compiles; the same choice.
    second = ls.compile_suite(runs, SCAN_ONLY, cache_dir=tmp_path / "fresh", **kwargs)
    assert len(calls) == 8 and layouts.read_text() == chosen
    assert [r.chosen for r in second.results] == [r.chosen for r in first.results]
    assert ledger_file.read_text().splitlines() == lines  # rewritten byte for byte
    # A record analysed by another version does not count: that candidate is compiled again.
    stale = [json.loads(line) for line in lines]
    stale[0]["report"]["analysis_version"] = cr.ANALYSIS_VERSION - 1
    ledger_file.write_text("".join(json.dumps(r) + "\n" for r in stale))
    assert Ledger.load(ledger_file).get(stale[0]["name"]) is None
    ls.compile_suite(runs, SCAN_ONLY, cache_dir=tmp_path / "fresh2", **kwargs)
    assert len(calls) == 9
    ledger_file.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(UsageError, match=r"compile_results.jsonl:2: not a compile record"):
        Ledger.load(ledger_file)


def test_a_cached_compile_analysed_by_an_older_walk_is_walked_again_from_its_hlo(tmp_path):
    """Every candidate the search compares is analysed by the same walk: a cache file of an older
    ANALYSIS_VERSION is re-analysed from the HLO kept beside it (no compile) and rewritten."""
    from smelt_jax.compile.candidates import Candidate
    from smelt_jax.compile.hbm_traffic import hbm_bytes
    from tests.hlo_walk_samples import GATHER_SCATTER_HLO

    run = _run("100m/s95/baseline")
    calls = []
    candidate = Candidate(ls.candidates(run, "v5p-128", (8,), ("ring",))[0].layout)
    old = dataclasses.replace(_fake_compiler(lambda p: True, [])(run, "v5p-128", candidate.layout, "none"),
                              analysis_version=cr.ANALYSIS_VERSION - 1, hbm_traffic_bytes=1.0)
    path = ls.cache_path(run, candidate, tmp_path)
    ls._write_cache(path, run, candidate, old)
    cr.write_hlo(ls.hlo_path(path), GATHER_SCATTER_HLO)
    report, cached = ls.compile_cached(run, candidate, _fake_compiler(lambda p: True, calls), tmp_path)
    assert cached and not calls  # nothing compiled
    assert report.analysis_version == cr.ANALYSIS_VERSION
    assert report.hbm_traffic_bytes == pytest.approx(hbm_bytes(GATHER_SCATTER_HLO).total)
    assert json.loads(path.read_text())["report"]["analysis_version"] == cr.ANALYSIS_VERSION  # rewritten


def test_a_kept_candidate_of_an_older_program_is_compiled_again_and_the_rest_compared_as_recorded(
        tmp_path, monkeypatch):
    """After a PROGRAM_VERSION bump a report compiles one candidate per configuration (the kept one),
    lists the older records it compared, stores the version in cache and ledger; a run that compiles
    nothing keeps the older program's record and says so."""
    from smelt_jax.compile.program_flops import ProgramFlops
    from smelt_jax.compile.results_ledger import Ledger

    run = _run("100m/s95/smelt")
    calls = []
    fake = _fake_compiler(lambda p: True, calls)

    def compile_fn(run_, slice_name, layout, remat, hlo_path=None):
        r = fake(run_, slice_name, layout, remat)
        step = {"auto": 0.30, "ring": 0.25}[layout.exchange] - 0.01 * REMAT_ORDER.index(remat)
        # every later compile of the same candidate is a little faster (a program that lost some work)
        step -= 0.001 * sum(c == (run_.id, remat) for c in calls[:-1])
        return dataclasses.replace(r, step_seconds=step, analysis_version=cr.ANALYSIS_VERSION)

    def trace_fn(run_, slice_name, layout, remat):
        return ProgramFlops(64 * 40e12, {"dot_general": 64 * 40e12}, 0, 0), 1.0

    ledger_file = tmp_path / "compile_results.jsonl"
    kwargs = dict(suite="smelt16", results_out=ledger_file, compile_fn=compile_fn, trace_fn=trace_fn,
                  libtpu=(True, ""), cache_dir=tmp_path / "cache")
    first = ls.compile_suite([run], SCAN_ONLY, **kwargs).results[0]
    assert len(calls) == 4 and first.older_programs == () and not first.chosen_is_older
    kept = ls.Candidate(first.chosen)
    assert ls.recorded_program(run, kept, tmp_path / "cache") == ls.PROGRAM_VERSION

    monkeypatch.setattr(ls, "PROGRAM_VERSION", ls.PROGRAM_VERSION + 1)  # a change that alters every program
    second = ls.compile_suite([run], SCAN_ONLY, **kwargs).results[0]
    assert len(calls) == 5 and calls[-1] == (run.id, kept.layout.remat)  # only the kept one, once
    assert second.chosen == first.chosen and second.report.step_seconds == pytest.approx(
        first.report.step_seconds - 0.001)
    assert kept.label not in second.older_programs and len(second.older_programs) == 3
    assert ls.recorded_program(run, kept, tmp_path / "cache") == ls.PROGRAM_VERSION
    ledger = Ledger.load(ledger_file)
    versions = sorted(ledger.program(name) for name in ledger.records)
    assert versions == [ls.PROGRAM_VERSION - 1] * 3 + [ls.PROGRAM_VERSION]
    lines = ls.program_lines([second])
    assert "1 of 1 kept programs were compiled by this checkout's program. 3 record(s)" in lines[-1]

    # Another bump, and a report run that compiles nothing: the older record answers and is named.
    monkeypatch.setattr(ls, "PROGRAM_VERSION", ls.PROGRAM_VERSION + 1)
    third = ls.compile_suite([run], SCAN_ONLY, cached_only=True, **kwargs).results[0]
    assert len(calls) == 5 and third.chosen == first.chosen and third.chosen_is_older
    assert "0 of 1 kept programs" in ls.program_lines([third])[-1] and run_key(run) in ls.program_lines([third])[-1]
    # On a clone (no cache, the ledger from git) the same versions are read from the ledger.
    clone = ls.compile_suite([run], SCAN_ONLY, **{**kwargs, "cache_dir": tmp_path / "fresh"}).results[0]
    assert len(calls) == 6 and not clone.chosen_is_older  # the kept one compiled again, the others read

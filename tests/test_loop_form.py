"""The layer stacks' loop form as a dimension of the layout search (issue 50 item 2,
compile/loop_form.py): the layout field that carries it (never part of a run id), the plumbing that
gives it to the model (trainer and ahead-of-time compile), and the search's stage 3 with a stand-in
compiler: the faster program that fits is kept, its compiles are ledger records, and a fresh clone
reproduces the choice from the ledger without compiling."""

import dataclasses
import json

import jax
import pytest
from flax import nnx

import experiments
from experiments.placement import SMELT16_POLICY
from smelt_jax.compile import layout_search as ls
from smelt_jax.compile import loop_form
from smelt_jax.compile import report as cr
from smelt_jax.compile.program_flops import ProgramFlops
from smelt_jax.design.config import ConfigError
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.parallel.layout import run_key

SMELT16 = experiments.load_suite("smelt16")
# the loop-form stage alone (the collectives stage after it: tests/test_collective_form.py)
LOOPS = dataclasses.replace(SMELT16_POLICY, collectives=("auto",))


def _run(key):
    return next(r for r in SMELT16 if run_key(r) == key)


def test_the_layout_carries_the_loop_form_and_the_run_id_ignores_it():
    assert Parallelism().layer_loop == "auto" and "layer_loop" not in Parallelism().to_dict()
    unrolled = Parallelism(data=1, fsdp=8, expert=8, tpu_type="v5p-128", layer_loop="unrolled")
    assert unrolled.to_dict()["layer_loop"] == "unrolled" and Parallelism(**unrolled.to_dict()) == unrolled
    with pytest.raises(ConfigError, match="layer_loop 'while'"):
        Parallelism(layer_loop="while")
    run = _run("100m/s95/smelt")
    moved = dataclasses.replace(run, parallelism=dataclasses.replace(run.parallelism, layer_loop="unrolled"))
    assert moved.id == run.id and moved.to_dict()["parallelism"]["layer_loop"] == "unrolled"


def _micro():
    return experiments.load_suite("micro")[0]


def test_the_trainer_gives_the_layouts_loop_form_to_the_model(tmp_path):
    from smelt_jax.train.phase import Phase, TrainOptions

    run = _micro()
    for form in ("scan", "unrolled"):
        layout = dataclasses.replace(run.parallelism, layer_loop=form)
        phase = Phase(run, None, tmp_path, None, TrainOptions(), layout, stop=None)
        model = nnx.merge(phase.plan.graphdef, phase.plan.abstract_params)
        assert model.layer_loop == form
    with pytest.raises(ValueError, match="layer_loop"):
        from smelt_jax.model import Decoder
        nnx.eval_shape(lambda: Decoder(run.model, rngs=nnx.Rngs(0), layer_loop="while"))


def _equations(jaxpr, name: str) -> int:
    """`name` equations written in a jaxpr, each sub-jaxpr (a scan's body) counted once."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for sub in jax.core.jaxprs_in_params(eqn.params):
            count += _equations(sub, name)
    return count


def test_the_tpu_program_is_traced_in_the_layouts_loop_form():
    """What `smelt compile --layer-loop unrolled` and the search's unrolled candidates compile: the train
    step traced for a TPU slice without the layer scans (no compile: a trace on this CPU)."""
    from smelt_jax.compile import aot

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    run = _micro()
    counts = {}
    for form in ("auto", "unrolled"):
        layout = Parallelism(data=-1, fsdp=1, expert=1, tpu_type="v5p-8", layer_loop=form)
        program = cr._program(run, "v5p-8", layout, "none")
        assert program.layer_loop == ("scan" if form == "auto" else "unrolled")
        with jax.set_mesh(program.mesh):
            traced = jax.jit(program.step, in_shardings=program.in_shardings,
                             out_shardings=program.out_shardings).trace(*program.args)
        counts[form] = _equations(traced.jaxpr.jaxpr, "dot_general")
    # unrolled, every layer's matmuls are written out; in a scan, its body's once per stack
    assert counts["unrolled"] > counts["auto"] > 0


def _compiler(steps, calls, fits=lambda layout: True, headroom=lambda layout: True):
    """A compile_run stand-in: the step of (remat, exchange, layer_loop) from `steps`; records each call."""
    def compile_fn(run, slice_name, layout, remat, hlo_path=None):
        calls.append((remat, layout.exchange, layout.layer_loop))
        ok = fits(layout)
        step = steps.get((remat, layout.exchange, layout.layer_loop))
        temps = 3 * 2**30 if headroom(layout) else 90 * 2**30
        return cr.CompileReport(
            run_id=run.id, slice=slice_name, layout={"data": layout.data, "fsdp": layout.fsdp,
                                                     "expert": layout.expert, "tensor": layout.tensor},
            remat=remat, expert_impl="pallas", peak_fits_hbm=ok,
            error=None if ok else "RESOURCE_EXHAUSTED: exceeds available HBM",
            compile_seconds=300.0 if layout.layer_loop == "unrolled" else 120.0,
            argument_bytes=2**30, output_bytes=2**30, temp_bytes=temps, peak_bytes=4 * 2**30 if ok else None,
            hbm_bytes=95 * 2**30, budget_flops=2e13, step_seconds=step, hbm_seconds=step, compute_seconds=0.05,
            comm_seconds=0.01, exchange_exposed_seconds=0.0, dominant_term="HBM", hbm_traffic_bytes=1e11,
            analysis_version=cr.ANALYSIS_VERSION,
            layer_loop="unrolled" if layout.layer_loop == "unrolled" else "scan")
    return compile_fn


# 100M S95 Baseline's scan steps (docs/performance.md): the ring wins, full is its fastest remat
SCAN = {("none", "ring", "auto"): 0.116, ("none", "auto", "auto"): 0.196, ("dots", "ring", "auto"): 0.1158,
        ("full", "ring", "auto"): 0.1157}


def test_unrolled_wins_where_it_is_faster_and_walks_its_own_remats(tmp_path):
    run = _run("100m/s95/baseline")
    steps = {**SCAN, ("none", "ring", "unrolled"): 0.094, ("dots", "ring", "unrolled"): 0.099}
    calls = []
    result = ls.search_layout(run, _compiler(steps, calls), LOOPS, cache_dir=tmp_path)
    # stages 1-2 as before (4 compiles), then unrolled at the ring from remat none; dots slower: stop
    assert calls == [("none", "ring", "auto"), ("none", "auto", "auto"), ("dots", "ring", "auto"),
                     ("full", "ring", "auto"), ("none", "ring", "unrolled"), ("dots", "ring", "unrolled")]
    assert (result.chosen.layer_loop, result.chosen.remat, result.chosen.exchange) == ("unrolled", "none", "ring")
    assert result.report.step_seconds == 0.094 and result.tried[-1][0].endswith(",layers=unrolled")
    assert [(layout.remat, layout.layer_loop) for layout, _ in result.compared] == [
        ("full", "auto"), ("none", "unrolled"), ("dots", "unrolled")]
    document = json.loads(ls.layouts_document([result], "smelt16"))
    assert document["layouts"]["100m/s95/baseline"]["layer_loop"] == "unrolled"
    # the table marks the choice and gives each program's compile time
    table = ls.render_table([result], "smelt compile-report")
    assert "| none, unrolled |" in table
    section = table[table.index("**Layer loop form and collectives**"):]
    assert "Compared for 1 configuration(s); the other 0" in section
    rows = [line for line in section.splitlines() if line.startswith("| 100m/s95/baseline |")]
    assert rows == ["| 100m/s95/baseline | scan | auto | full | 0.116 | 100 | 4.0 | 120 | fits |",
                    "| 100m/s95/baseline | unrolled | auto | none | 0.094 | 100 | 4.0 | 300 | **kept** |",
                    "| 100m/s95/baseline | unrolled | auto | dots | 0.099 | 100 | 4.0 | 300 | fits |"]


def test_the_scan_is_kept_when_unrolled_is_slower_tied_or_without_headroom(tmp_path):
    run = _run("100m/s95/smelt")
    steps = {**SCAN, ("none", "ring", "unrolled"): 0.130, ("dots", "ring", "unrolled"): 0.125,
             ("full", "ring", "unrolled"): 0.126}
    calls = []
    slower = ls.search_layout(run, _compiler(steps, calls), LOOPS, cache_dir=tmp_path / "a")
    # unrolled walks none -> dots (falls) -> full (rises: stop); its best, 0.125, loses to the scan's 0.1157
    assert calls[4:] == [("none", "ring", "unrolled"), ("dots", "ring", "unrolled"), ("full", "ring", "unrolled")]
    assert (slower.chosen.layer_loop, slower.chosen.remat) == ("auto", "full")
    assert "layer_loop" not in json.loads(ls.layouts_document([slower], "smelt16"))["layouts"]["100m/s95/smelt"]
    tie = {**SCAN, ("none", "ring", "unrolled"): 0.1157, ("dots", "ring", "unrolled"): 0.2}
    assert ls.search_layout(run, _compiler(tie, []), LOOPS, cache_dir=tmp_path / "b").chosen.layer_loop \
        == "auto"  # a tie: the scan, which compiles faster
    fast = {**SCAN, ("none", "ring", "unrolled"): 0.05, ("dots", "ring", "unrolled"): 0.06,
            ("full", "ring", "unrolled"): 0.07}
    tight = ls.search_layout(run, _compiler(fast, [], headroom=lambda p: p.layer_loop == "auto"), LOOPS,
                             cache_dir=tmp_path / "c")  # accepted, but over 95% of HBM: never kept
    assert tight.chosen.layer_loop == "auto" and tight.report.step_seconds == 0.1157
    assert [o.split(" (")[0] for _, o in tight.tried[-3:]] == ["over 95% of HBM"] * 3


def test_unrolled_starts_at_its_own_first_fitting_remat():
    steps = {**SCAN, ("dots", "ring", "unrolled"): 0.09, ("full", "ring", "unrolled"): 0.10}
    calls = []
    fits = lambda layout: not (layout.layer_loop == "unrolled" and layout.remat == "none")
    group = ls.candidates(_run("100m/s95/smelt"), "v5p-128", (8,), ("ring", "auto"), ("auto", "unrolled"))
    compile_fn = _compiler(steps, calls, fits=fits)
    winner = next(c for c in group if (c.layout.remat, c.layout.exchange, c.layout.layer_loop) == ("full", "ring", "auto"))
    scan_report = compile_fn(_run("100m/s95/smelt"), "v5p-128", winner.layout, "full")
    attempt = lambda c: compile_fn(_run("100m/s95/smelt"), "v5p-128", c.layout, c.layout.remat)
    candidate, report, compared = loop_form.best_form(group, winner, scan_report, ("auto", "unrolled"), attempt)
    assert (candidate.layout.layer_loop, candidate.layout.remat, report.step_seconds) == ("unrolled", "dots", 0.09)
    assert [layout.remat for layout, _ in compared] == ["full", "none", "dots", "full"]
    assert loop_form.best_form(group, winner, scan_report, ("auto",), attempt) == (winner, scan_report, ())


def _trace_fn(run_, slice_name, layout, remat):
    return ProgramFlops(64 * 40e12, {"dot_general": 64 * 40e12}, 0, 0), 1.0


def test_a_fresh_clone_reproduces_the_choice_from_the_ledger_without_compiling(tmp_path):
    """The loop-form compiles are ledger records beside the scan's; `--cached-only` (no compile) on an
    empty cache gives the same layouts and table; a configuration whose unrolled program was never
    compiled keeps its scan program."""
    runs = [_run("100m/s95/baseline"), _run("100m/s95/smelt")]
    steps = {**SCAN, ("none", "ring", "unrolled"): 0.094, ("dots", "ring", "unrolled"): 0.099}
    calls = []
    ledger, layouts, md = tmp_path / "compile_results.jsonl", tmp_path / "layouts.json", tmp_path / "p.md"
    kwargs = dict(suite="smelt16", json_out=layouts, results_out=ledger, markdown_out=md,
                  compile_fn=_compiler(steps, calls), trace_fn=_trace_fn)
    ls.compile_suite(runs, LOOPS, cache_dir=tmp_path / "cache", libtpu=(True, ""),
                     only=["100m/s95/baseline"], **kwargs)
    assert len(calls) == 6
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    unrolled = [r for r in records if r["candidate"].get("layer_loop") == "unrolled"]
    assert len(records) == 6 and len(unrolled) == 2
    assert {r["report"]["compile_seconds"] for r in unrolled} == {300.0}
    # The SMELT member's scan compiled, its unrolled program not (yet): its records enter the ledger
    # from the cache on the next report run, which compiles nothing.
    scan_only = dataclasses.replace(LOOPS, layer_loops=("auto",))
    ls.search_layout(runs[1], kwargs["compile_fn"], scan_only, cache_dir=tmp_path / "cache")
    assert len(calls) == 10
    ls.compile_suite(runs, LOOPS, cache_dir=tmp_path / "cache", cached_only=True, libtpu=(True, ""),
                     **kwargs)
    assert len(calls) == 10 and len(ledger.read_text().splitlines()) == 10
    before = ledger.read_text()
    # Another machine: an empty cache, the ledger from git, cached results only.
    fresh = ls.compile_suite(runs, LOOPS, cache_dir=tmp_path / "fresh", cached_only=True,
                             libtpu=(True, ""), **kwargs)
    assert len(calls) == 10  # nothing compiled
    baseline, smelt = fresh.results
    assert baseline.chosen.layer_loop == "unrolled" and smelt.chosen.layer_loop == "auto"
    assert smelt.status == "fits" and "not compiled" in smelt.tried[-1][1]
    assert ledger.read_text() == before  # every record kept, none added
    chosen = json.loads(layouts.read_text())["layouts"]
    assert chosen["100m/s95/baseline"]["layer_loop"] == "unrolled" and "layer_loop" not in chosen["100m/s95/smelt"]
    assert "Compared for 1 configuration(s); the other 1 that fit keep their scan programs" in md.read_text()

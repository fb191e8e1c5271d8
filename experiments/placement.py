"""Where each suite's runs go: the TPU slice per scale, the layout of every run, and the policy the
compile report searches layouts with. This is the one place a suite's placement is decided; the compile
report (`smelt compile-report`), the sweep backends (xpk, tpu-vm: TPU type and `--layout`/`--remat` of
every job) and the smelt16 descriptors all read it.

    placement_for(run) -> Parallelism with tpu_type, mesh axes and remat set
    layouts(suite)     -> {layout key: Parallelism}: the suite's layout table
    search_policy(suite), layouts_file(suite): what `smelt compile-report --suite SUITE` uses

- **smelt16**: the layouts `smelt compile-report` chose by compiling (experiments/layouts.json); the
  descriptors carry them (`RunSpec.parallelism`, so they are part of the run ids).
- **ablations200m**: the 200M placement of smelt16 (same slice, same policy). A configuration identical
  to a smelt16 one (model and schedule) takes that configuration's compiled layout; the others take,
  from experiments/layouts_ablations200m.json when `smelt compile-report --suite ablations200m` has
  written it, their compiled layout, and until then one *derived by smelt16's candidate rule*: the
  first candidate layout (`smelt_jax.compile.candidates`: expert 8, fsdp the largest share that divides
  d_model, data the rest) with remat 'full', the last and least memory-hungry of the search's order
  (every smelt16 200M configuration fits with it). These layouts are resolved here at render time and are
  not written into the descriptors, so the ablation run ids are unchanged.
- **micro**, **smoke**: CPU-sized; on a TPU they take the smallest v5p slice with the run's own layout.

A run whose own parallelism names a TPU type keeps it (an explicit pin wins). A run with no placement
is an error at render time, naming the command that would make one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from smelt_jax.compile.candidates import SearchPolicy, candidates
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.errors import UsageError
from smelt_jax.parallel.layout import load_layouts, run_key

HERE = Path(__file__).resolve().parent
LAYOUTS_FILE = HERE / "layouts.json"  # smelt16's

# Both members of a matched pair always share a slice. v5p-128 (64 chips, 95 GiB HBM each) for 100M,
# 200M and 600M. 1.6B: the S97 Baseline (54B parameters) compiled on v5p-128 with remat full at
# 10.3 GiB of arguments + 85.6 GiB of temporaries per chip (over HBM_HEADROOM) and fit v5p-256
# (5.1 + 42.9 GiB), but the S97 SMELT model needed 143 GB of temporaries there, so 1.6B gets v5p-512.
SMELT16_SCALE_SLICES = {"100m": "v5p-128", "200m": "v5p-128", "600m": "v5p-128", "1.6b": "v5p-512"}
# 8 divides every smelt16 expert count (8, 64, 192, 336; 16, 96, 288, 504).
SMELT16_EXPERT_AXIS_SIZES = (8,)
# The acceptance pairs first (200M and 1.6B at S~97%), then the grid in suite order.
SMELT16_PRIORITY = ("200m/s97/baseline", "200m/s97/smelt", "1.6b/s97/baseline", "1.6b/s97/smelt")

# Both exchanges are compiled at the first remat that fits; the lower roofline step wins (ties: the ring)
# and is recorded as the layout's `exchange` (left out of layouts.json when 'auto', the padded all-to-all
# on TPU, wins). The ring first: it won both 100M pairs by 1.6x (docs/performance.md), so a report cut
# short by its time budget still has the likely winner of every configuration it reached.
SMELT16_EXCHANGES = ("ring", "auto")
SMELT16_POLICY = SearchPolicy(SMELT16_SCALE_SLICES, SMELT16_EXPERT_AXIS_SIZES, SMELT16_PRIORITY,
                              SMELT16_EXCHANGES)
# 200M only, on smelt16's 200M slice, with smelt16's expert axis sizes and exchanges.
ABLATIONS200M_POLICY = SearchPolicy({"200m": SMELT16_SCALE_SLICES["200m"]}, SMELT16_EXPERT_AXIS_SIZES,
                                    exchanges=SMELT16_EXCHANGES)
DERIVED_REMAT = "full"

# CPU-sized suites never need more than the smallest slice.
CPU_SUITE_SLICE = "v5p-8"
CPU_SUITES = ("micro", "ablationsmicro", "smoke")

_POLICIES = {"smelt16": SMELT16_POLICY, "ablations200m": ABLATIONS200M_POLICY}


def search_policy(suite: str) -> SearchPolicy:
    """The compile report's policy for `suite` (slice per scale, expert axis sizes, order)."""
    if suite not in _POLICIES:
        raise UsageError(f"suite {suite!r} has no compile-report policy (known: {', '.join(_POLICIES)}); "
                         f"{', '.join(CPU_SUITES)} are CPU-sized")
    return _POLICIES[suite]


def layouts_file(suite: str) -> Path:
    """The layouts file `smelt compile-report --suite SUITE` writes and this module reads."""
    return LAYOUTS_FILE if suite == "smelt16" else HERE / f"layouts_{suite}.json"


def smelt16_layouts() -> dict[str, Parallelism]:
    """smelt16's compiled layouts (what its descriptors carry)."""
    return load_layouts(LAYOUTS_FILE)


def derived_layout(run: RunSpec, policy: SearchPolicy) -> Parallelism:
    """smelt16's candidate rule without compiling: the first candidate's axes, remat DERIVED_REMAT."""
    first = candidates(run, policy.slice_for(run), policy.expert_axis_sizes)[0].layout
    return dataclasses.replace(first, remat=DERIVED_REMAT)


def _content(run: RunSpec) -> str:
    return json.dumps({"model": run.model.to_dict(), "schedule": run.schedule.to_dict()}, sort_keys=True)


@functools.cache
def layouts(suite: str) -> dict[str, Parallelism]:
    """The suite's layout table: {layout key: Parallelism with tpu_type and remat set} for every run
    that has one ({} for the CPU suites: their runs keep their own layout)."""
    from smelt_jax.design import suites  # this package, through the registry it fills (no import cycle)

    if suite == "smelt16":
        return smelt16_layouts()
    if suite == "ablations200m":
        compiled = load_layouts(layouts_file(suite))
        smelt16 = smelt16_layouts()
        by_content = {_content(r): smelt16[run_key(r)] for r in suites.load_suite("smelt16")
                      if run_key(r) in smelt16}
        table = {}
        for run in suites.load_suite(suite):
            key = run_key(run)
            table[key] = (compiled.get(key) or by_content.get(_content(run))
                          or derived_layout(run, ABLATIONS200M_POLICY))
        return table
    return {}


def placement_for(run: RunSpec) -> Parallelism:
    """The TPU type, mesh axes and remat a job of `run` gets."""
    if run.parallelism.tpu_type:  # chosen already (smelt16's descriptors) or pinned
        return run.parallelism
    if run.suite in CPU_SUITES:
        return dataclasses.replace(run.parallelism, tpu_type=CPU_SUITE_SLICE)
    table = layouts(run.suite)
    key = run_key(run)
    if key not in table:
        raise UsageError(f"run {run.id}: no TPU placement (no layout {key!r} for suite {run.suite!r}); "
                         f"`smelt compile-report --suite {run.suite}` chooses one "
                         f"(experiments/placement.py)")
    return table[key]

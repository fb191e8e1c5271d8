"""Experiment suites, built from code. `load_suite(name)` returns its runs; `find_run(id)` any run.

The library reaches them through `smelt_jax.design.suites`, which importing this package fills (`register`).

Suites: `smelt16` (the paper's 16 matched pairs), `ablations200m` (loop span, depth, loop count),
`micro` (the same structure, shrunk to train on a 2-core CPU), `ablationsmicro` (the ablations at micro
scale), `smoke` (a subset of `micro`), `nano` (one sparsity, widths and tokens chosen so the law can be
identified on a CPU), `nanolr` (its learning-rate sweep) and `nano2` (looping against reshaping at nano
scale: docs/results-nano2.md) and `ladder` (where SMELT starts to win: a width ladder with
seeds, docs/results-ladder.md).
"""

from __future__ import annotations

import difflib
import functools
import importlib

from smelt_jax.design.descriptors import RunSpec
from smelt_jax.platform.errors import AmbiguousName, UnknownName

# suite -> (module of this package, builder function). A module that fails to import is an error
# (with its traceback), never an "unknown suite".
_BUILDERS = {"smelt16": ("smelt16", "build"), "ablations200m": ("ablations200m", "build"),
             "micro": ("micro", "build"), "ablationsmicro": ("ablationsmicro", "build"),
             "smoke": ("micro", "build_smoke"), "nano": ("nano", "build"),
             "nanolr": ("nano", "build_lr_sweep"), "nano2": ("nano2", "build"),
             "ladder": ("ladder", "build")}
SUITE_NAMES = tuple(_BUILDERS)


@functools.cache
def load_suite(name: str) -> tuple[RunSpec, ...]:
    if name not in _BUILDERS:
        raise UnknownName(f"unknown suite {name!r}; known: {', '.join(SUITE_NAMES)}")
    module, function = _BUILDERS[name]
    return tuple(getattr(importlib.import_module(f"experiments.{module}"), function)())


def find_run(run_id: str) -> RunSpec:
    """The run with this id, or with this unique prefix of an id (`smelt16-200m-s97-smelt`), in any
    suite (the id's first field names its suite when it is one). A miss lists the nearest ids."""
    suite = run_id.split("-", 1)[0]
    runs = [run for name in ([suite] if suite in SUITE_NAMES else SUITE_NAMES) for run in load_suite(name)]
    exact = [run for run in runs if run.id == run_id]
    if exact:
        return exact[0]
    matches = [run for run in runs if run.id.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(run.id for run in matches[:6]) + (", ..." if len(matches) > 6 else "")
        raise AmbiguousName(f"{run_id!r} is the start of {len(matches)} run ids ({shown}); give more of it")
    ids = [run.id for run in (runs if suite in SUITE_NAMES else
                               [r for name in SUITE_NAMES for r in load_suite(name)])]
    near = difflib.get_close_matches(run_id, ids, n=3, cutoff=0.5)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    raise UnknownName(f"no run with id {run_id!r}{hint} (list them with `smelt experiments list`)")


def placement_for(run: RunSpec):
    """The run's TPU placement (`experiments.placement.placement_for`)."""
    from experiments.placement import placement_for as placement
    return placement(run)


def layouts_file(suite: str):
    """The suite's layouts file (`experiments.placement.layouts_file`): where its compiled files live."""
    from experiments.placement import layouts_file as where
    return where(suite)


def register() -> None:
    """Fill the library's suite registry (`smelt_jax.design.suites`) with these suites."""
    import sys

    from smelt_jax.design import suites
    suites.register(sys.modules[__name__])


register()

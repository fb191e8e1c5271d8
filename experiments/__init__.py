"""Experiment suites, built from code. `load_suite(name)` returns its runs; `find_run(id)` any run.

Suites: `smelt16` (the paper's 16 matched pairs), `ablations200m` (loop span, depth, loop count),
`micro` (the same structure, shrunk to train on a 2-core CPU) and `smoke` (a subset of `micro`).
"""

from __future__ import annotations

import functools

from smelt_jax.descriptors import RunSpec


def _builders():
    import importlib
    modules = {"smelt16": ("smelt16", "build"), "ablations200m": ("ablations200m", "build"),
               "micro": ("micro", "build"), "smoke": ("micro", "build_smoke")}
    out = {}
    for suite, (module, function) in modules.items():
        try:
            out[suite] = getattr(importlib.import_module(f"experiments.{module}"), function)
        except ModuleNotFoundError:
            continue
    return out


SUITE_NAMES = ("smelt16", "ablations200m", "micro", "smoke")


@functools.cache
def load_suite(name: str) -> tuple[RunSpec, ...]:
    builders = _builders()
    if name not in builders:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(SUITE_NAMES)}")
    return tuple(builders[name]())


def find_run(run_id: str) -> RunSpec:
    """The run with this id in any suite (suite taken from the id's first field when known)."""
    suite = run_id.split("-", 1)[0]
    for name in ([suite] if suite in SUITE_NAMES else SUITE_NAMES):
        for run in load_suite(name):
            if run.id == run_id:
                return run
    raise KeyError(f"no run with id {run_id!r} (list them with `smelt experiments list`)")

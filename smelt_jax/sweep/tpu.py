"""TPU placement of a sweep job: which slice and layout a run gets, and what that slice looks like to
GKE and to gcloud.

The slice and layout come from the run's suite placement (experiments/placement.py, reached through
`smelt_jax.design.suites`: the layouts the
compile report chose, or the suite's rule), so every job a sweep renders uses the slice and layout the
compile report uses. The slice's facts (chips, hosts, GKE labels, runtime) come from
`smelt_jax.platform.hardware`.
"""

from __future__ import annotations

from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.hardware import Slice, parse_slice
from smelt_jax.parallel.layout import format_layout


def placement(run: RunSpec) -> Parallelism:
    """The run's TPU type, mesh axes and remat (its suite's placement; a clear error if it has none)."""
    from smelt_jax.design import suites  # the suites' policy lives with the suites (experiments/placement.py)

    return suites.placement_for(run)


def tpu_type_for(run: RunSpec) -> str:
    return placement(run).tpu_type


def tpu_slice(tpu_type: str) -> Slice:
    return parse_slice(tpu_type)


def layout_args(run: RunSpec) -> list[str]:
    """The trainer flags that pin the placement's layout: ['--layout', 'data=..', '--remat', P]."""
    layout = placement(run)
    return ["--layout", format_layout(layout), "--remat", layout.remat]

"""Checkpoint cadence by time: a suite's interval in minutes, turned into steps by the compile report's
roofline step, and the bytes one save writes.

    save_bytes(run)                        -> bytes of one checkpoint: parameters + optimizer state
    steps_between_saves(minutes, step_s)   -> the trainer's --checkpoint-every for that interval
    cadence_document(runs, results, suite) -> the cadence file `smelt compile-report` writes
    checkpoint_args(run)                   -> ['--checkpoint-every', N] for a sweep job (sweep/base.py)

The step time is the compile report's lower bound (`CompileReport.step_seconds`), so real steps are
slower and saves come at most that often: the interval is a floor on the time between saves. An
explicit `smelt train --checkpoint-every N` is the trainer's own setting (default 100); the cadence only
fills that flag in the commands of sweep jobs, and a run the cadence file does not list gets none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from smelt_jax.parallel.layout import run_key

# Minutes between checkpoints, per suite: long pod runs lose at most this much work to a preemption.
SUITE_CHECKPOINT_MINUTES = {"smelt16": 30.0, "ablations200m": 30.0}


def save_bytes(run) -> int:
    """Bytes one checkpoint of `run` writes: its train state (parameters and the optimizer's state:
    Adam's two moments and its step counters), from the abstract state (nothing allocated)."""
    import jax

    from smelt_jax.train.state import abstract_train_state
    from smelt_jax.train.step import optimizer

    _, abstract = abstract_train_state(run.model, optimizer(run.schedule))
    return int(sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(abstract)))


def steps_between_saves(minutes: float, step_seconds: float) -> int:
    """Steps that take at least `minutes` at `step_seconds` each (>= 1)."""
    if minutes <= 0 or step_seconds <= 0:
        raise ValueError(f"need positive minutes and step seconds, got {minutes}, {step_seconds}")
    return max(1, math.ceil(minutes * 60.0 / step_seconds - 1e-9))


def cadence(suite: str, step_seconds: float | None) -> tuple[float, int] | None:
    """(minutes, steps between saves) for a run of `suite` at `step_seconds`; None for a suite without
    an interval or an unknown step time."""
    minutes = SUITE_CHECKPOINT_MINUTES.get(suite)
    if minutes is None or not step_seconds:
        return None
    return minutes, steps_between_saves(minutes, step_seconds)


def cadence_document(runs: Sequence, results: Sequence, suite: str) -> str:
    """The cadence file's text: {'suite', 'minutes', 'runs': {layout key: {'checkpoint_every',
    'step_seconds', 'save_bytes'}}} for every run whose layout search fits (`results[i]` belongs to
    `runs[i]`, a layout_search.SearchResult); sorted, so the same results give the same bytes."""
    entries = {}
    for run, result in zip(runs, results, strict=True):
        report = result.report if result.status == "fits" else None
        chosen = cadence(suite, report.step_seconds if report else None)
        if chosen is None:
            continue
        entries[run_key(run)] = {"checkpoint_every": chosen[1], "step_seconds": round(report.step_seconds, 6),
                                 "save_bytes": save_bytes(run)}
    return json.dumps({"suite": suite, "minutes": SUITE_CHECKPOINT_MINUTES.get(suite),
                       "runs": dict(sorted(entries.items()))}, indent=1, sort_keys=True) + "\n"


def cadence_file(layouts_file: Path) -> Path:
    """The cadence file beside a suite's layouts file: layouts.json -> checkpoint_cadence.json,
    layouts_SUITE.json -> checkpoint_cadence_SUITE.json."""
    layouts_file = Path(layouts_file)
    return layouts_file.with_name(layouts_file.name.replace("layouts", "checkpoint_cadence", 1))


def checkpoint_args(run, path: Path | None = None) -> list[str]:
    """['--checkpoint-every', N] from the run's suite cadence file (default: beside its layouts file),
    or [] when the file or the run's entry is missing."""
    if path is None:
        from smelt_jax.design import suites  # the suites' files live with the suites (experiments/)

        path = cadence_file(suites.layouts_file(run.suite))
    if not Path(path).exists():
        return []
    entry = json.loads(Path(path).read_text()).get("runs", {}).get(run_key(run))
    return [] if entry is None else ["--checkpoint-every", str(entry["checkpoint_every"])]

"""The compiler options' collectives form as the layout search's last stage (issue 50 item 5).

With XLA's defaults (`Parallelism.collectives = 'auto'`) the ring exchange's all-gathers and
reduce-scatters run synchronously on TPU: the step waits for every byte (the report's "exposed expert
exchange", 20 ms of 100M S95 SMELT's 109 ms). 'async' compiles the same step with
`platform/xla_options.ASYNC_COLLECTIVES_TPU`: the all-gathers become multi-step async collective fusions
with independent work fused into their steps, the reduce-scatters run on the SparseCores; the report
reads both forms (`hlo_async`) and charges only the exchange with no work in its window.

The search (`layout_search.search_layout`) compiles the kept program of stages 1-3 (exchange, remat,
loop form) once more with each other form of `SearchPolicy.collectives` and keeps the faster program
that fits (ties: 'auto'): one compile more per configuration. The choice is the layout's `collectives`
(experiments/layouts.json, left out at 'auto'); the trainer compiles with the same options
(`train.state.jit_train_step`). Without a compile (`--cached-only`, a time budget) the other form is
left out and the configuration keeps its 'auto' program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smelt_jax.compile.candidates import Candidate, fits_with_headroom
from smelt_jax.compile.loop_form import Attempt, faster


def best_collectives(winner: Candidate, report, forms: Sequence[str], attempt: Attempt,
                     compared: Sequence = ()) -> tuple[Candidate, object, tuple]:
    """The faster of `winner` (with its `report`) and `winner` compiled with each other form of `forms`
    that fits with headroom: (candidate, report, compared), `compared` extended with (layout, report) of
    every compile tried (the winner first when `compared` is empty)."""
    compared = list(compared) or [(winner.layout, report)]
    best = (winner, report)
    for form in forms:
        if form == winner.layout.collectives:
            continue
        candidate = Candidate(dataclasses.replace(winner.layout, collectives=form))
        tried = attempt(candidate)
        if tried is None:  # not compiled (cached results only): the form is left out
            continue
        compared.append((candidate.layout, tried))
        if fits_with_headroom(tried) and faster(tried, best[1]):
            best = (candidate, tried)
    return best[0], best[1], tuple(compared) if len(compared) > 1 else ()

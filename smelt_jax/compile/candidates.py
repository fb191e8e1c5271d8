"""Candidate layouts for a run on a TPU slice, and a suite's search policy: the part of the layout
search that needs no compiler (and no JAX), so a suite's placement can use the same rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.hardware import parse_slice

REMAT_ORDER = ("none", "dots", "full")  # compile order (layout_search.search_layout walks it)
# The layer stacks' loop forms (kernels.backend.LAYER_LOOPS) the search compiles: the first ('auto', a scan
# on TPU) through the staged search, the others at its winning exchange (compile/loop_form.py).
LAYER_LOOP_ORDER = ("auto", "unrolled")
# The compiler options' collectives forms (platform/xla_options.COLLECTIVE_FORMS): the first through
# stages 1-3, the others on the kept program (compile/collective_form.py).
COLLECTIVES_ORDER = ("auto", "async")

# A layout is kept when the compiler accepts it with its peak under HBM (`CompileReport.peak_fits_hbm`)
# *and* arguments + temporaries (a bound that ignores their live-range overlap, so above the compiler's
# peak) stay under this share of HBM: the runtime needs some HBM too, and the compiler's peak came out
# *below* its temporaries alone. `fits_with_headroom` is that test.
HBM_HEADROOM = 0.95


def fits_with_headroom(report) -> bool:
    """Compiler accepted, peak under HBM, and arguments + temporaries under HBM_HEADROOM x HBM (`report`:
    a `report.CompileReport`)."""
    if not report.peak_fits_hbm or report.hbm_bytes is None:
        return False
    total = (report.argument_bytes or 0) + (report.temp_bytes or 0)
    return total <= HBM_HEADROOM * report.hbm_bytes


@dataclasses.dataclass(frozen=True)
class SearchPolicy:
    """A suite's placement policy for the search (built in experiments/placement.py)."""

    scale_slices: Mapping[str, str]     # scale -> TPU slice; both members of a pair share one
    expert_axis_sizes: Sequence[int]    # candidate `expert` axis sizes, in order
    priority: Sequence[str] = ()        # layout keys compiled first; the rest in suite order
    # expert exchanges compiled at their first remat that fits; the lowest roofline step wins
    exchanges: Sequence[str] = ("auto",)
    # layer loop forms: the first searched as above, each other one at the winning exchange; the faster
    # program that fits is kept (compile/loop_form.py). Every suite's search compiles both.
    layer_loops: Sequence[str] = LAYER_LOOP_ORDER
    # compiler options: the first searched as above, each other one on the kept program
    collectives: Sequence[str] = COLLECTIVES_ORDER

    def slice_for(self, run: RunSpec) -> str:
        if run.scale not in self.scale_slices:
            raise ValueError(f"{run.id}: no TPU slice for scale {run.scale!r} "
                             f"(known: {sorted(self.scale_slices)})")
        return self.scale_slices[run.scale]


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Parallelism  # with tpu_type and remat set

    @property
    def label(self) -> str:
        p = self.layout
        exchange = "" if p.exchange == "auto" else f",exchange={p.exchange}"
        loop = "" if p.layer_loop == "auto" else f",layers={p.layer_loop}"
        collectives = "" if p.collectives == "auto" else f",collectives={p.collectives}"
        return (f"data={p.data},fsdp={p.fsdp},expert={p.expert},tensor={p.tensor},remat={p.remat}{exchange}{loop}"
                f"{collectives}")


def candidates(run: RunSpec, slice_name: str, expert_axis_sizes: Sequence[int] = (8,),
               exchanges: Sequence[str] = ("auto",), layer_loops: Sequence[str] = ("auto",),
               collectives: Sequence[str] = ("auto",)) -> list[Candidate]:
    """Ordered candidate layouts for `run` on `slice_name`: expert over each of `expert_axis_sizes`,
    fsdp over the largest share of the rest that divides d_model, data over what is left; remat none ->
    dots -> full, each with every one of `exchanges` in every one of `layer_loops`, each with every one
    of `collectives` (one expert size's candidates are adjacent: the search compares them). Expert sizes
    that do not divide the expert count or the chip count are skipped.

    fsdp must divide d_model (the `embed` dimension it shards): otherwise `fit_spec` replicates every
    weight over fsdp (measured: 1.6B S97 SMELT, d 1848, needed 133-143 GB per chip at fsdp 16 and 32).
    """
    chips = parse_slice(slice_name).chips
    out = []
    for expert in expert_axis_sizes:
        if run.model.n_experts % expert or chips % expert:
            continue
        rest = chips // expert
        fsdp = max(f for f in range(1, rest + 1) if rest % f == 0 and run.model.d_model % f == 0)
        for remat in REMAT_ORDER:
            out += [Candidate(Parallelism(data=rest // fsdp, fsdp=fsdp, expert=expert, tensor=1,
                                          tpu_type=slice_name, remat=remat, exchange=exchange, layer_loop=loop,
                                          collectives=form))
                    for loop in layer_loops for exchange in exchanges for form in collectives]
    if not out:
        raise ValueError(f"{run.id}: no candidate layout for {run.model.n_experts} experts on {slice_name}")
    return out

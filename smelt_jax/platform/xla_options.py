"""The XLA compiler options a train step is compiled with, in one place (issue 50 item 5).

    compiler_options(collectives, platform) -> {option: value} for `jax.jit(..., compiler_options=...)`

A layout's `Parallelism.collectives` names the form: 'auto' (XLA's defaults: on TPU the ring exchange's
all-gathers and reduce-scatters run synchronously, nothing overlaps them) or 'async' (on TPU, the options
below: the all-gathers become multi-step async collective fusions whose continuation steps carry
independent work, and the reduce-scatters are offloaded to the SparseCores, which run them while the
TensorCore computes). The compile report's layout search compiles both and keeps the faster program that
fits (`compile/collective_form.py`); the trainer and the ahead-of-time compile pass the same options,
so the program a report measured is the program a TPU runs.

Read in the compiled program (100M S95 SMELT on v5p-128, ring exchange, layers unrolled, 2026-12-06):
with 'async' 61% of the ring exchange's bytes have work scheduled inside their window (3.17 of 8.09 GB
left exposed), against none with 'auto'. The options are libtpu's (checked by compiling: an unknown name
is refused with "No such compile option"); on other platforms 'async' adds none.
"""

from __future__ import annotations

COLLECTIVE_FORMS = ("auto", "async")  # valid `Parallelism.collectives` values

ASYNC_COLLECTIVES_TPU = {
    # all-gathers as async collective fusions, split in steps that other work is fused into
    "xla_enable_async_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    # reduce-scatters on the SparseCores (v5p has them), asynchronous to the TensorCore
    "xla_tpu_enable_sparse_core_collective_offload_reduce_scatter": "true",
}


def compiler_options(collectives: str = "auto", platform: str = "tpu") -> dict[str, str]:
    """The compiler options of a train step for the layout's `collectives` form on `platform`."""
    if collectives not in COLLECTIVE_FORMS:
        raise ValueError(f"collectives {collectives!r} not in {COLLECTIVE_FORMS}")
    if collectives == "async" and platform == "tpu":
        return dict(ASYNC_COLLECTIVES_TPU)
    return {}

"""What a phase checks before its first byte is written (issue 53): the branch, and the layout against
the devices present. The run's description itself (model, schedule, parallelism, data kind) was checked
when its `RunSpec` was made, whatever it came from (a suite, a config file, run.json, overrides, flags);
the data and the memory are checked next by the trainer, still before anything is written. Each
refusal is one line (a `SmeltError`, exit 2)."""

from __future__ import annotations

from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.parallel import sharding
from smelt_jax.platform.errors import UsageError
from smelt_jax.train import lr as lr_lib


def check_before_writing(run: RunSpec, branch: int | None, layout: Parallelism, devices: int) -> None:
    """A bad branch, a layout whose mesh the `devices` devices cannot form, or an expert axis the model's
    experts do not split over (UsageError; the last was found by the expert exchange, after run.json)."""
    lr_lib.phase_steps(run.schedule, branch)
    shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(layout, devices)))
    n_experts = run.model.n_experts
    if n_experts and n_experts % shape["expert"]:
        raise UsageError(f"{n_experts} experts of run {run.id} do not split over expert axis of size "
                         f"{shape['expert']}; choose a --layout expert size that divides the expert count")

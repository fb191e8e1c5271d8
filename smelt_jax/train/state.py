"""The train state, assembled in one place: the model, the abstract state, the shardings of parameters,
optimizer state and batches, a sharded init, the restore target, and the train step jitted with those
shardings and with donation. The trainer, the compile tools and evaluation all build it here.

    plan = plan_training(cfg, tx, mesh)
    state = TrainState.initial(plan, tx, seed)            # created already sharded, never whole
    step = jit_train_step(plan, tx)
    batch = global_batch(plan, local_rows)                # this process's rows -> one global batch
    with jax.set_mesh(mesh):
        params, opt_state, metrics = step(params, opt_state, batch, lr)

Parameters carry logical axis names (`smelt_jax.parallel.sharding.param`); `smelt_jax.parallel.sharding` resolves them
to mesh axes. Optimizer moments are placed like their parameters, step counts replicated; batches
split their rows over ('data', 'fsdp', 'expert') (the `batch` rule of
`smelt_jax.parallel.sharding.LOGICAL_AXIS_RULES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from smelt_jax.parallel import sharding
from smelt_jax.design.config import ModelConfig
from smelt_jax.train.step import make_eval_step, make_train_step
from smelt_jax.platform.xla_options import compiler_options

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a run needs to continue, restored and saved whole (`Checkpointer.restore_state` /
    `save_state`): parameters, optimizer state (the pytree's leaves), the step reached and the data
    position (the step whose batch comes next; the batch is a pure function of it). `step` and
    `data_step` are static fields (plain ints): `jax.tree.leaves(state)` are the arrays only."""

    params: Any
    opt_state: Any
    step: int = dataclasses.field(default=0, metadata={"static": True})
    data_step: int = dataclasses.field(default=0, metadata={"static": True})

    @classmethod
    def target(cls, plan: TrainPlan, step: int = 0) -> TrainState:
        """The abstract state (ShapeDtypeStructs with this mesh's shardings) at `step`: a restore
        target, so a checkpoint written on another mesh or host count comes back placed for this one."""
        params, opt_state = plan.abstract_state()
        return cls(params, opt_state, step, step)

    @classmethod
    def initial(cls, plan: TrainPlan, tx: optax.GradientTransformation, seed: int,
                step: int = 0) -> TrainState:
        """Freshly initialised parameters and optimizer state (already sharded) at `step`."""
        params, opt_state = init_state(plan, tx, seed)
        return cls(params, opt_state, step, step)

    @property
    def is_abstract(self) -> bool:
        """True while any leaf is a ShapeDtypeStruct (nothing restored or initialised yet)."""
        return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(self))

    def arrays(self) -> dict[str, Any]:
        """The checkpoint's `state` item: {'params', 'opt_state'} (the on-disk layout)."""
        return {"params": self.params, "opt_state": self.opt_state}

    def positions(self) -> dict[str, int]:
        """The checkpoint's metadata for this state: {'step', 'data_step'}."""
        return {"step": int(self.step), "data_step": int(self.data_step)}

    def with_arrays(self, arrays: dict[str, Any], *, step: int, data_step: int) -> TrainState:
        return TrainState(arrays["params"], arrays["opt_state"], int(step), int(data_step))

    def advanced(self, params: Any, opt_state: Any) -> TrainState:
        """The state after one train step (step and data position move on together)."""
        return TrainState(params, opt_state, self.step + 1, self.data_step + 1)


BATCH_KEYS = {"tokens": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32,
              "positions": jnp.int32, "loss_mask": jnp.float32}


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """Everything static about the sharded train state: shapes, dtypes and shardings (no arrays)."""

    cfg: ModelConfig
    mesh: jax.sharding.Mesh
    graphdef: Any
    abstract_params: Any  # nnx.State of ShapeDtypeStruct (no shardings)
    abstract_opt_state: Any
    params_shardings: Any  # same structure, NamedSharding leaves
    opt_shardings: Any

    def batch_shardings(self, batch_size: int, seq_len: int) -> dict[str, jax.sharding.NamedSharding]:
        shape = (batch_size, seq_len)
        return {key: sharding.batch_sharding(self.mesh, shape) for key in BATCH_KEYS}

    def abstract_batch(self, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        shardings = self.batch_shardings(batch_size, seq_len)
        return {key: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=shardings[key])
                for key, dtype in BATCH_KEYS.items()}

    def step_shardings(self, batch_size: int, seq_len: int) -> tuple[tuple, tuple]:
        """(in_shardings, out_shardings) of train_step(params, opt_state, batch, lr) -> (params,
        opt_state, metrics): state placed by the rules, metrics and the learning rate replicated."""
        replicated = sharding.replicated(self.mesh)
        return ((self.params_shardings, self.opt_shardings, self.batch_shardings(batch_size, seq_len),
                 replicated),
                (self.params_shardings, self.opt_shardings, replicated))

    def restore_target(self) -> dict[str, Any]:
        """{'params', 'opt_state'} as ShapeDtypeStructs with their shardings: what a checkpoint is
        restored into."""
        params, opt_state = self.abstract_state()
        return {"params": params, "opt_state": opt_state}

    def abstract_state(self) -> tuple[Any, Any]:
        """(params, opt_state) as ShapeDtypeStructs carrying their target shardings (restore targets,
        AOT arguments). Built by hand: `nnx.eval_shape` drops shardings (flax issue 5110)."""
        def with_sharding(leaf, target):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=target)
        return (jax.tree.map(with_sharding, self.abstract_params, self.params_shardings),
                jax.tree.map(with_sharding, self.abstract_opt_state, self.opt_shardings))


def _decoder(cfg: ModelConfig, seed: int, remat: str = "none", layer_loop: str = "auto"):
    from smelt_jax.model import Decoder
    return Decoder(cfg, rngs=nnx.Rngs(seed), remat=remat, layer_loop=layer_loop)


def init_params(cfg: ModelConfig, seed: int, remat: str = "none") -> tuple[nnx.GraphDef, nnx.State]:
    """Model graph definition and freshly initialised parameters, on the default device (no mesh).
    `remat` changes the graph definition (how layers run), never the parameters."""
    return nnx.split(_decoder(cfg, seed, remat))


def abstract_train_state(cfg: ModelConfig, tx: optax.GradientTransformation, remat: str = "none",
                         layer_loop: str = "auto") -> tuple[Any, dict]:
    """(graphdef, {'params', 'opt_state'} as ShapeDtypeStructs without shardings): the checkpoint's
    structure, nothing allocated. `TrainPlan.restore_target` adds the mesh's shardings."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: _decoder(cfg, 0, remat, layer_loop)))
    return graphdef, {"params": params, "opt_state": jax.eval_shape(tx.init, params)}


def plan_training(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, *,
                  remat: str = "none", layer_loop: str = "auto") -> TrainPlan:
    """Shapes and shardings of params and optimizer state for `cfg` on `mesh` (nothing allocated);
    the train step runs its layers under the `remat` policy and as the `layer_loop` form (a scan or
    unrolled: kernels.backend.LAYER_LOOPS); the run's layout chooses both, neither changes the
    parameters or the checkpoint's structure."""
    graphdef, abstract = abstract_train_state(cfg, tx, remat, layer_loop)
    abstract_params, abstract_opt_state = abstract["params"], abstract["opt_state"]
    params_shardings = sharding.param_shardings(abstract_params, mesh)
    opt_shardings = sharding.opt_state_shardings(tx, abstract_opt_state, params_shardings, mesh)
    return TrainPlan(cfg, mesh, graphdef, abstract_params, abstract_opt_state, params_shardings,
                     opt_shardings)


def init_state(plan: TrainPlan, tx: optax.GradientTransformation, seed: int) -> tuple[Any, Any]:
    """(params, opt_state) initialised inside one jit whose outputs are already sharded: no device
    ever holds the whole model. Values equal `init_params(cfg, seed)`."""
    def init():
        _, params = init_params(plan.cfg, seed)
        return params, tx.init(params)
    with jax.set_mesh(plan.mesh):
        return jax.jit(init, out_shardings=(plan.params_shardings, plan.opt_shardings))()


def jit_train_step(plan: TrainPlan, tx: optax.GradientTransformation, batch_size: int,
                   seq_len: int, *, donate: bool = True, collectives: str = "auto"):
    """train_step(params, opt_state, batch, lr) -> (params, opt_state, metrics), jitted with input and
    output shardings (metrics replicated) and the compiler options of the layout's `collectives` form
    (platform/xla_options.py). Call it inside `jax.set_mesh(plan.mesh)`: the model's activation
    constraints apply only while a mesh is set."""
    in_shardings, out_shardings = plan.step_shardings(batch_size, seq_len)
    platform = plan.mesh.devices.flat[0].platform
    return jax.jit(make_train_step(plan.graphdef, plan.cfg, tx), in_shardings=in_shardings,
                   out_shardings=out_shardings, donate_argnums=(0, 1) if donate else (),
                   compiler_options=compiler_options(collectives, platform) or None)


def jit_eval_step(plan: TrainPlan, batch_size: int, seq_len: int):
    """eval_step(params, batch) -> (loss sum, token count), replicated outputs."""
    replicated = sharding.replicated(plan.mesh)
    return jax.jit(make_eval_step(plan.graphdef, plan.cfg),
                   in_shardings=(plan.params_shardings, plan.batch_shardings(batch_size, seq_len)),
                   out_shardings=replicated)


def process_row_range(plan: TrainPlan, batch_size: int, seq_len: int) -> tuple[int, int]:
    """[first, last) rows of the global batch that this process's devices hold.

    Usually rows p*B/P .. (p+1)*B/P of process p; a layout that replicates the batch across
    processes gives each process more (or all) rows. Raises if a process's rows are not contiguous.
    """
    batch_sh = sharding.batch_sharding(plan.mesh, (batch_size, seq_len))
    starts, stops = [], []
    for index in batch_sh.addressable_devices_indices_map((batch_size, seq_len)).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(batch_size if rows.stop is None else rows.stop)
    first, last = min(starts), max(stops)
    covered = np.zeros(batch_size, bool)
    for start, stop in zip(starts, stops):
        covered[start:stop] = True
    if not covered[first:last].all():
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows on mesh "
                         f"{dict(plan.mesh.shape)}; order the mesh so each process's rows are contiguous")
    return first, last


def host_split(plan: TrainPlan, batch_size: int, seq_len: int) -> dict[str, int]:
    """{'host_index', 'host_count'} for the data pipeline: this process's rows as an even split.

    With the batch axes outermost in the mesh this is (process_index, process_count); a layout that
    replicates the batch over processes gives (0, 1) (every process reads every row)."""
    first, last = process_row_range(plan, batch_size, seq_len)
    width = last - first
    if batch_size % width or first % width:
        raise ValueError(f"process {jax.process_index()} holds rows [{first}, {last}) of {batch_size}: "
                         "not an even split")
    return {"host_index": first // width, "host_count": batch_size // width}


def global_batch(plan: TrainPlan, local: dict[str, np.ndarray], batch_size: int
                 ) -> dict[str, jax.Array]:
    """One global batch [batch_size, seq] from this process's rows (`process_row_range`)."""
    out = {}
    for key, dtype in BATCH_KEYS.items():
        rows = np.asarray(local[key], dtype=dtype)
        shape = (batch_size,) + rows.shape[1:]
        out[key] = jax.make_array_from_process_local_data(
            sharding.batch_sharding(plan.mesh, shape), rows, shape)
    return out

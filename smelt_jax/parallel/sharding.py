"""Logical axis names and the one table that maps them to mesh axes.

Modules name the axes of every parameter and of the activations they constrain with *logical* names
(`embed`, `heads`, `experts`, ...). Only this module knows which mesh axis (`data`, `fsdp`, `expert`,
`tensor`) carries each name. Parameters are created with `eager_sharding=False`, so building a model
never needs a mesh; placement reads `nnx.get_partition_spec(state)` and resolves it here
(`logical_to_mesh`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
from flax import nnx

from smelt_jax.platform.errors import UsageError

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical name -> mesh axis (a name, a tuple of names, or None for replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("router_experts", None),  # router output columns: small, every device needs all of them
    ("layers", None),
    # Activations.
    # `expert` too: otherwise every activation outside the expert layer is replicated over the expert
    # axis (measured: 8x the logits per device, 149 GB of temporaries for 200M S97 on v5p-128).
    ("batch", ("data", "fsdp", "expert")),
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("act_experts", "expert"),
)

LogicalNames = Sequence[str | None]


def logical_to_mesh(names: LogicalNames, rules=LOGICAL_AXIS_RULES) -> jax.sharding.PartitionSpec:
    """PartitionSpec over mesh axes for a tuple of logical names (None stays None).

    A name missing from the rules is an error: a typo would otherwise silently replicate.
    """
    table = dict(rules)
    resolved = []
    for name in names:
        if name is None:
            resolved.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES")
        resolved.append(table[name])
    return jax.sharding.PartitionSpec(*resolved)


def mesh_is_set() -> bool:
    """True inside `jax.set_mesh(mesh)` (or `with mesh:`) with a non-empty mesh."""
    return not jax.sharding.get_abstract_mesh().empty


def current_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh being traced under (`jax.set_mesh(mesh)`, as an AbstractMesh), or None when none is set."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: jax.Array, names: LogicalNames) -> jax.Array:
    """Constrain an activation's sharding by logical names; a no-op when no mesh is set."""
    if not mesh_is_set():
        return x
    if len(names) != x.ndim:
        raise ValueError(f"{len(names)} logical names {tuple(names)} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(names))


def param(value: jax.Array, names: LogicalNames) -> nnx.Param:
    """An `nnx.Param` carrying its logical axis names (placed later, never at creation)."""
    names = tuple(names)
    if len(names) != value.ndim:
        raise ValueError(f"{len(names)} logical names {names} for a parameter of rank {value.ndim}")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def parameter_logical_specs(model: nnx.Module):
    """State of PartitionSpecs over *logical* names for every parameter of `model`."""
    return nnx.get_partition_spec(nnx.state(model, nnx.Param))


def parameter_mesh_specs(model: nnx.Module, rules=LOGICAL_AXIS_RULES):
    """State of PartitionSpecs over *mesh* axes for every parameter of `model`."""
    logical = parameter_logical_specs(model)
    return jax.tree.map(lambda spec: logical_to_mesh(tuple(spec), rules), logical,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


# --------------------------------------------------------------------------------------------------
# Meshes and placement. Everything below reads LOGICAL_AXIS_RULES; nothing else maps names to axes.
# --------------------------------------------------------------------------------------------------

def mesh_shape(parallelism, n_devices: int) -> tuple[int, ...]:
    """Axis sizes in MESH_AXES order for `parallelism` (any object with data/fsdp/expert/tensor ints).

    At most one size may be -1 ("fill the rest": the devices left over by the others). The sizes
    must multiply out to `n_devices` exactly.
    """
    sizes = [int(getattr(parallelism, axis)) for axis in MESH_AXES]
    fills = [i for i, size in enumerate(sizes) if size == -1]
    if len(fills) > 1:
        raise UsageError(f"at most one mesh axis may be -1 (fill the rest); got {dict(zip(MESH_AXES, sizes))}")
    if any(size == 0 or size < -1 for size in sizes):
        raise UsageError(f"mesh axis sizes must be positive or -1; got {dict(zip(MESH_AXES, sizes))}")
    fixed = 1
    for size in sizes:
        fixed *= size if size > 0 else 1
    if fills:
        if n_devices % fixed:
            raise UsageError(f"{n_devices} devices do not divide by the fixed axes "
                             f"{dict(zip(MESH_AXES, sizes))} (product {fixed})")
        sizes[fills[0]] = n_devices // fixed
    total = 1
    for size in sizes:
        total *= size
    if total != n_devices:
        raise UsageError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {total} devices; {n_devices} available "
                         "(change --layout; -1 fills the rest)")
    return tuple(sizes)


def make_mesh(parallelism, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: every device of every process) with axes MESH_AXES.

    Axis types are Auto (GSPMD-style propagation): JAX 0.10's default, Explicit, would demand an
    `out_sharding` on every einsum that contracts a sharded dimension.
    """
    import numpy as np

    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(parallelism, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    try:  # topology-aware device order (ICI rings) where JAX knows the hardware
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError) as error:
        try:  # e.g. fsdp 8 x expert 8 on a 4x4x4 torus: 8 = 4 x 2 splits a physical axis; still in ring order
            from jax.experimental import mesh_utils
            ordered = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
            return jax.sharding.Mesh(ordered, MESH_AXES, axis_types=axis_types)
        except (ValueError, NotImplementedError, AssertionError):
            pass
        warnings.warn(
            f"jax.make_mesh could not lay out the mesh {dict(zip(MESH_AXES, shape))} over "
            f"{len(devices)} {devices[0].device_kind} devices, not even splitting physical axes "
            f"({type(error).__name__}: {error}); using "
            "the devices in their listed order instead, which may not follow the interconnect "
            "topology (collectives can be slower)", RuntimeWarning, stacklevel=2)
        return jax.sharding.Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def _axis_size(mesh: jax.sharding.Mesh, entry) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def fit_spec(spec: jax.sharding.PartitionSpec, shape: Sequence[int], mesh: jax.sharding.Mesh
             ) -> jax.sharding.PartitionSpec:
    """`spec` with every mesh axis that does not divide its dimension dropped (that dim replicated).

    A tuple entry keeps its longest leading run of axes whose product divides the dimension, so
    ('data', 'fsdp') over a dimension divisible by data only becomes 'data'.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    fitted = []
    for dim, entry in zip(shape, entries):
        if entry is None:
            fitted.append(None)
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        kept: list[str] = []
        for name in names:
            if dim % (_axis_size(mesh, tuple(kept + [name]))) == 0:
                kept.append(name)
            else:
                break
        kept = [name for name in kept if mesh.shape[name] > 1] or []
        fitted.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return jax.sharding.PartitionSpec(*fitted)


def named_sharding(mesh: jax.sharding.Mesh, names: LogicalNames, shape: Sequence[int],
                   rules=LOGICAL_AXIS_RULES) -> jax.sharding.NamedSharding:
    """NamedSharding of an array of `shape` whose axes have logical `names` (non-dividing axes dropped)."""
    return jax.sharding.NamedSharding(mesh, fit_spec(logical_to_mesh(tuple(names), rules), shape, mesh))


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def param_shardings(abstract_params, mesh: jax.sharding.Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedShardings for a parameter State (arrays or ShapeDtypeStructs), from its logical names."""
    specs = nnx.get_partition_spec(abstract_params)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    return jax.tree.map(
        lambda spec, leaf: jax.sharding.NamedSharding(
            mesh, fit_spec(logical_to_mesh(tuple(spec), rules), leaf.shape, mesh)),
        specs, abstract_params, is_leaf=is_spec)


def opt_state_shardings(tx, abstract_opt_state, params_shardings, mesh: jax.sharding.Mesh):
    """Optimizer-state shardings: moments like their parameters, everything else (counts) replicated."""
    import optax

    return optax.tree_map_params(
        tx, lambda _leaf, sharding: sharding, abstract_opt_state, params_shardings,
        transform_non_params=lambda _leaf: replicated(mesh),
        is_leaf=lambda x: isinstance(x, (jax.ShapeDtypeStruct, jax.Array)))


def batch_sharding(mesh: jax.sharding.Mesh, shape: Sequence[int]) -> jax.sharding.NamedSharding:
    """Sharding of a batch array [batch, seq, ...]: 'batch' by the rules, the rest replicated."""
    return named_sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), shape)

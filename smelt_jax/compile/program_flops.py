"""Matrix-multiply FLOPs a traced program executes, loops counted as many times as they run.

XLA's `cost_analysis()` counts a `while` body once, whatever its trip count (measured here on the TPU
compiler: a `scan` of 8 [4096, 4096] matmuls reports the FLOPs and `optimal_seconds` of one), and the
decoder scans its layers, so the compiled FLOPs of a train step miss most of its layers. This module
counts from the jaxpr instead, where a `scan` carries its `length`:

    flops = program_flops(jax.make_jaxpr(train_step)(*abstract_args))

Counted: `dot_general` (2 x output elements x contracted size), `ragged_dot_general` (every row of the
ragged operand once), `pallas_call` (the kernel's own `cost_estimate`), `conv_general_dilated`. Splash
attention's kernels carry no cost estimate: they are counted as what they execute, the matmuls of one
grid step (from the kernel's body) times the steps the causal block mask lets run
(`kernels.splash.kernel_flops`), under the kind "splash". The fused linear cross-entropy's kernels
(`kernels.fused_ce`) count under "fused_ce": the report scales the kind "pallas" (the expert kernels)
by the share of their buffer rows that carry tokens, and every row of the loss is a token.
Elementwise work, reductions and collectives are not FLOPs here (the usual MFU convention). Bodies of
`scan` are multiplied by `length`; `cond` takes its most expensive branch; a `while` (unknown trip
count) is counted once and reported in `unknown_trip_loops`; `shard_map` bodies (per-shard shapes) are
multiplied by the number of shards. Backward passes and remat recomputation are explicit in the jaxpr
of a gradient, so they are included. The result is for the whole program (all devices together).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
from jax._src import core  # ClosedJaxpr/Jaxpr types: not re-exported publicly in JAX 0.10

from smelt_jax.kernels import fused_ce, splash


@dataclasses.dataclass(frozen=True)
class ProgramFlops:
    """FLOPs of one traced program; `by_kind` splits `total` by primitive kind."""

    total: float
    by_kind: dict[str, float]
    unknown_trip_loops: int  # while loops counted once (trip count not known from the jaxpr)
    pallas_without_estimate: int  # pallas_calls without a cost_estimate (counted as 0)


def _jaxprs(value: Any) -> list[core.Jaxpr]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    out = []
    for item in items:
        if isinstance(item, core.ClosedJaxpr):
            out.append(item.jaxpr)
        elif isinstance(item, core.Jaxpr):
            out.append(item)
    return out


def _dot_general_flops(lhs_shape, out_shape, dimension_numbers) -> float:
    (lhs_contract, _), _ = dimension_numbers
    return 2.0 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in lhs_contract)


def _ragged_dot_flops(lhs_shape, out_shape, ragged_dims) -> float:
    """Every row of the ragged dimension meets exactly one group: 2 x m x k x n, however the groups
    split it. With a ragged *contracting* dimension (the weight gradient) the output holds one [k, n]
    block per group, so the group count is divided out."""
    dot_dims = ragged_dims.dot_dimension_numbers
    (lhs_contract, _), _ = dot_dims
    flops = 2.0 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in lhs_contract)
    ragged = ragged_dims.lhs_ragged_dimensions[0]
    if ragged in lhs_contract:
        flops /= out_shape[0]  # out [groups, ...]: each contracted row feeds one group's block
    return flops


def _shards(params: dict[str, Any]) -> int:
    mesh = params.get("mesh")
    axes = params.get("manual_axes", params.get("axis_names", ()))
    if mesh is None:
        return 1
    shape = dict(mesh.shape)
    return math.prod(shape[a] for a in axes) if axes else math.prod(shape.values())


def _walk(jaxpr: core.Jaxpr, acc: dict[str, float], counters: dict[str, int]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        params = eqn.params
        if name == "dot_general":
            acc["dot_general"] += _dot_general_flops(eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape,
                                                     params["dimension_numbers"])
        elif name in ("ragged_dot_general", "ragged_dot"):
            dims = params.get("ragged_dot_dimension_numbers")
            if dims is None:  # plain ragged_dot: lhs [m, k], rhs [g, k, n]
                m, k = eqn.invars[0].aval.shape
                acc["ragged_dot"] += 2.0 * m * k * eqn.invars[1].aval.shape[-1]
            else:
                acc["ragged_dot"] += _ragged_dot_flops(eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape,
                                                       dims)
        elif name == "conv_general_dilated":
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            dn = params["dimension_numbers"]
            in_features = rhs[dn.rhs_spec[1]]
            window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
            del lhs
            acc["conv"] += 2.0 * math.prod(eqn.outvars[0].aval.shape) * in_features * window
        elif name == "pallas_call":
            estimate = params.get("cost_estimate")
            if str(params.get("name", "")).startswith(splash.KERNEL_PREFIX):
                step = sum(_count(_jaxprs(params["jaxpr"]), counters).values())
                acc["splash"] += splash.kernel_flops(params["grid_mapping"].grid, _query_shape(eqn), step)
            elif estimate is None:
                counters["pallas_without_estimate"] += 1
            elif str(params.get("name", "")).startswith(fused_ce.KERNEL_PREFIX):
                acc["fused_ce"] += float(estimate.flops)  # every row real: not scaled by the experts' fill
            else:
                acc["pallas"] += float(estimate.flops)
        elif name == "scan":
            inner = _count(_jaxprs(params["jaxpr"]), counters)
            for kind, value in inner.items():
                acc[kind] += value * params["length"]
        elif name == "while":
            counters["unknown_trip_loops"] += 1
            for kind, value in _count(_jaxprs(params["body_jaxpr"]), counters).items():
                acc[kind] += value
        elif name == "cond":
            branches = [_count([j], counters) for j in _jaxprs(params["branches"])]
            best = max(branches, key=lambda b: sum(b.values()), default={})
            for kind, value in best.items():
                acc[kind] += value
        elif name == "shard_map":
            shards = _shards(params)
            for kind, value in _count(_jaxprs(params["jaxpr"]), counters).items():
                acc[kind] += value * shards
        else:  # pjit, remat, custom_jvp/vjp calls, closed_call, ...: their bodies run once
            for key, value in params.items():
                if key in ("fwd_jaxpr_thunk", "bwd"):
                    continue
                for sub in _jaxprs(value):
                    for kind, flops in _count([sub], counters).items():
                        acc[kind] += flops


def _query_shape(eqn) -> tuple[int, ...]:
    """A splash kernel's query operand, [..., heads, seq, hd]: its first floating input of rank >= 3."""
    for var in eqn.invars:
        aval = var.aval
        if len(aval.shape) >= 3 and jnp.issubdtype(aval.dtype, jnp.floating):
            return tuple(aval.shape)
    raise ValueError(f"no query operand in splash kernel {eqn.params.get('name')}")


def _count(jaxprs: Iterable[core.Jaxpr], counters: dict[str, int]) -> dict[str, float]:
    acc = {"dot_general": 0.0, "ragged_dot": 0.0, "pallas": 0.0, "splash": 0.0, "fused_ce": 0.0, "conv": 0.0}
    for jaxpr in jaxprs:
        _walk(jaxpr, acc, counters)
    return acc


def program_flops(closed_jaxpr: core.ClosedJaxpr | core.Jaxpr) -> ProgramFlops:
    """Matmul FLOPs of the whole program `closed_jaxpr` (from `jax.make_jaxpr`), loops unrolled."""
    counters = {"unknown_trip_loops": 0, "pallas_without_estimate": 0}
    by_kind = _count(_jaxprs(closed_jaxpr), counters)
    by_kind = {kind: value for kind, value in by_kind.items() if value}
    return ProgramFlops(total=sum(by_kind.values()), by_kind=by_kind, **counters)

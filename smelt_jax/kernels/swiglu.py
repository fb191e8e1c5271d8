"""Fused grouped SwiGLU up-projection: h = silu(x @ W_gate[g]) * (x @ W_up[g]) per group, in one pass.

Forward (one kernel, the `grouped_matmul_call` engine of gmm.py): each grid step reads one x tile and the
matching tiles of W_gate and W_up, accumulating both products in two f32 VMEM accumulators; on the last k
step the epilogue writes silu(gate) * up. The pre-activations gate and up never reach HBM; the only output
is h [m, f].

Backward (custom_vjp; residuals are x, the weights and group_sizes, not the pre-activations):
  1. one fused kernel recomputes gate and up (the same two matmuls) and, in its epilogue, turns the
     incoming dh into d_gate = dh * up * silu'(gate) and d_up = dh * silu(gate) (written in x's dtype);
  2. one kernel computes dx = d_gate @ W_gate[g].T + d_up @ W_up[g].T (two products, one accumulator);
  3. one transposed kernel computes dW_gate[g] = x.T @ d_gate and dW_up[g] = x.T @ d_up, reading x once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from smelt_jax.kernels.gmm import MatmulPlan, grouped_matmul_call, grouped_transposed_call, identity_epilogue
from smelt_jax.kernels.gmm_tiles import check_dtype, check_group_sizes, effective_tiling, pad_to, round_up
from smelt_jax.kernels.backend import pallas_interpret


def _swiglu_epilogue(accumulators, row_inputs, row_scales):
    del row_inputs, row_scales
    gate, up = accumulators
    return (gate * jax.nn.sigmoid(gate) * up,)


def _swiglu_grad_epilogue(accumulators, row_inputs, row_scales):
    del row_scales
    gate, up = accumulators
    (grad_h,) = row_inputs
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_silu = sig * (1.0 + gate * (1.0 - sig))
    return grad_h * up * d_silu, grad_h * silu


_FORWARD_PLAN = MatmulPlan(products=((0, 0, 0), (0, 1, 1)), num_accumulators=2, epilogue=_swiglu_epilogue,
                           transcendentals_per_output=1)
_PREACT_GRAD_PLAN = MatmulPlan(products=((0, 0, 0), (0, 1, 1)), num_accumulators=2,
                               epilogue=_swiglu_grad_epilogue, transcendentals_per_output=1)
_INPUT_GRAD_PLAN = MatmulPlan(products=((0, 0, 0), (1, 1, 0)), num_accumulators=1,
                              epilogue=identity_epilogue, transpose_rhs=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _swiglu_aligned(x, w_gate, w_up, group_sizes, tiling, interpret):
    (h,) = grouped_matmul_call([x], [w_gate, w_up], [], group_sizes, plan=_FORWARD_PLAN, out_dtypes=[x.dtype],
                               tiling=tiling, interpret=interpret)
    return h


def _swiglu_aligned_fwd(x, w_gate, w_up, group_sizes, tiling, interpret):
    return _swiglu_aligned(x, w_gate, w_up, group_sizes, tiling, interpret), (x, w_gate, w_up, group_sizes)


def _swiglu_aligned_bwd(tiling, interpret, residuals, grad_h):
    x, w_gate, w_up, group_sizes = residuals
    tm, tk, tn = tiling
    grad_gate, grad_up = grouped_matmul_call(
        [x], [w_gate, w_up], [grad_h], group_sizes, plan=_PREACT_GRAD_PLAN, out_dtypes=[x.dtype, x.dtype],
        tiling=tiling, interpret=interpret)
    (grad_x,) = grouped_matmul_call(
        [grad_gate, grad_up], [w_gate, w_up], [], group_sizes, plan=_INPUT_GRAD_PLAN, out_dtypes=[x.dtype],
        tiling=(tm, tn, tk), interpret=interpret)
    grad_w_gate, grad_w_up = grouped_transposed_call(
        x, [grad_gate, grad_up], group_sizes, out_dtype=w_gate.dtype, tiling=tiling, interpret=interpret)
    return grad_x, grad_w_gate, grad_w_up, None


_swiglu_aligned.defvjp(_swiglu_aligned_fwd, _swiglu_aligned_bwd)


def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array, *,
                   tiling: Sequence[int] | None = None, interpret: bool | None = None) -> jax.Array:
    """silu(x @ w_gate[g]) * (x @ w_up[g]) for the rows of each group g, fused; [m, d] -> [m, f].

    x [m, d] rows sorted by group; w_gate, w_up [G, d, f]; group_sizes [G] int32. Rows past
    sum(group_sizes) give 0. Output dtype = x dtype (f32 accumulation and activation). Differentiable
    in x, w_gate and w_up. tiling=(tm, tk, tn) with k = d and n = f.
    """
    if x.ndim != 2 or w_gate.ndim != 3 or w_gate.shape != w_up.shape or x.shape[1] != w_gate.shape[1]:
        raise ValueError("grouped_swiglu expects x [m, d], w_gate and w_up [G, d, f]; got "
                         f"{x.shape}, {w_gate.shape}, {w_up.shape}")
    for name, array in (("x", x), ("w_gate", w_gate), ("w_up", w_up)):
        check_dtype(name, array)
    check_group_sizes(group_sizes, w_gate.shape[0])
    (m, d), (num_groups, _, f) = x.shape, w_gate.shape
    if m == 0:
        return jnp.zeros((0, f), x.dtype)
    tm, tk, tn = effective_tiling(m, d, f, tiling)
    mp, dp, fp = round_up(m, tm), round_up(d, tk), round_up(f, tn)
    dtype = jnp.promote_types(x.dtype, w_gate.dtype)
    h = _swiglu_aligned(pad_to(x.astype(dtype), (mp, dp)),
                        pad_to(w_gate.astype(dtype), (num_groups, dp, fp)),
                        pad_to(w_up.astype(dtype), (num_groups, dp, fp)),
                        group_sizes, (tm, tk, tn), pallas_interpret(interpret))
    return h[:m, :f].astype(x.dtype)


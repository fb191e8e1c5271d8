"""The `pallas` expert backend: a SwiGLU expert FFN over rows sorted by expert, as two Pallas kernels.

    pallas_expert_ffn(x_sorted [m, d], w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d], group_sizes [E],
                      row_weight=None | [m])
        = gmm(grouped_swiglu(x_sorted, w_gate, w_up), w_down, row_weight=row_weight)           -> [m, d]

The up-projection is the fused SwiGLU kernel (gate and up read together, pre-activations kept in VMEM);
the down-projection is the grouped matmul, with each row's weight (the MoE router's) applied in its
epilogue and the weight's gradient taken in its backward (kernels/gmm.py). Both are differentiable (custom_vjp kernels for the backward).
interpret=None compiles with Mosaic when tracing for a TPU (a TPU host, or inside `jax.set_mesh` over TPU
devices, as in ahead-of-time compilation) and interprets otherwise; see kernels.backend.pallas_interpret.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from smelt_jax.kernels.backend import pallas_interpret
from smelt_jax.kernels.gmm import gmm
from smelt_jax.kernels.gmm_tiles import check_group_sizes
from smelt_jax.kernels.swiglu import grouped_swiglu


def pallas_expert_ffn(x_sorted: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                      group_sizes: jax.Array, *, row_weight: jax.Array | None = None,
                      interpret: bool | None = None, tiling: Sequence[int] | None = None) -> jax.Array:
    """SwiGLU experts on rows sorted by expert: row r of group e -> (silu(x W_gate[e]) * x W_up[e]) W_down[e].

    x_sorted [m, d]; w_gate, w_up [E, d, f]; w_down [E, f, d]; group_sizes [E] int32 (rows past their sum
    give 0); row_weight [m] float32 or None: row r's output times row_weight[r] (applied before rounding).
    tiling=(tm, tk, tn) is used for both kernels (fitted to each problem); None = the default for the TPU
    generation being traced for. Returns [m, d] in x_sorted's dtype.
    """
    num_experts, d, f = w_gate.shape
    if w_down.shape != (num_experts, f, d):
        raise ValueError(f"w_down must have shape {(num_experts, f, d)}; got {w_down.shape}")
    check_group_sizes(group_sizes, num_experts)
    interpret = pallas_interpret(interpret)
    hidden = grouped_swiglu(x_sorted, w_gate, w_up, group_sizes, tiling=tiling, interpret=interpret)
    return gmm(hidden, w_down, group_sizes, row_weight=row_weight, tiling=tiling, interpret=interpret)

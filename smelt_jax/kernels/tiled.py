"""The `tiled` expert backend (the CPU default): a dropless grouped matmul in plain XLA whose work follows
the routed rows, at any expert count.

    tiled_expert_ffn(x_sorted [m, d], w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d],
                     group_sizes [E]) -> [m, d]

Rows are sorted by expert, so expert e owns rows [start_e, start_e + g_e). A loop over the experts reads
each expert's weights once (no per-tile weight copies) and walks its rows in chunks taken from CHUNKS,
largest first: chunks of 256 rows while at least 256 are left, then 64, then 16, then chunks of 8 while
any are left. Each chunk is a dynamic slice of rows and three 2-D matmuls with that expert's weights; the
trip counts are dynamic (`lax.while_loop`), so an empty expert costs nothing and each expert computes its
g_e rows rounded up to 8: at most `padded_rows(m, E)` = m + 7 * min(E, m) rows in all (<= 1.25 m at every
micro and nano shape: tests/test_experts.py). A last chunk that runs past its group writes rows of the
next group, which that group's own chunks overwrite later (groups run in order); rows past sum(g) are
zeroed at the end.

The backward is a `custom_vjp` with the same loop (while loops have no reverse-mode autodiff): per chunk
the gate and up projections are recomputed, the chunk's output cotangent is masked to its group, and the
expert's three weight gradients are accumulated in float32 over its chunks.

Precision as every backend (kernels/experts.py): float32 accumulation, the SwiGLU product in float32 cast
to x's dtype before the down projection; in the backward the hidden cotangent is rounded to x's dtype
where autodiff of the dense reference rounds it, and the gate/up cotangents are cast to x's dtype for
their matmuls.

Measured against the previous design (each expert padded to a 64/128-row tile, a static tile count
floor((m + E(tile - 1)) / tile), per-tile weights gathered [n_tiles, d, f]: 1.73-3.08x the routed rows at
the micro shapes) in benchmarks/bench_tiles.py and docs/kernels.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from smelt_jax.kernels.rows import swiglu

CHUNKS = (256, 64, 16, 8)  # rows per matmul, largest first; the last is the padding granularity


def padded_rows(m: int, n_experts: int) -> int:
    """Upper bound on the rows computed for m routed rows over n_experts: each non-empty expert's rows
    rounded up to CHUNKS[-1], so at most CHUNKS[-1] - 1 extra rows per expert (and at most m non-empty)."""
    return m + (CHUNKS[-1] - 1) * min(n_experts, m)


def computed_rows(group_sizes) -> int:
    """The rows the loop computes for these group sizes (host-side, for tests and benchmarks)."""
    sizes = np.asarray(group_sizes, np.int64)
    return int((-(-sizes // CHUNKS[-1]) * CHUNKS[-1]).sum())


def _over_chunks(start, size, body, carry):
    """carry = body(row, n, carry) for chunks [row, row + n) covering [start, start + size), n from CHUNKS
    (largest first; the last chunk of 8 may run past start + size)."""
    end = start + size
    row = start
    for i, n in enumerate(CHUNKS):
        last = i == len(CHUNKS) - 1

        def more(state, n=n, last=last):
            left = end - state[0]
            return left > 0 if last else left >= n

        def step(state, n=n):
            return state[0] + n, body(state[0], n, state[1])

        row, carry = jax.lax.while_loop(more, step, (row, carry))
    return carry


def _starts(group_sizes):
    return jnp.cumsum(group_sizes) - group_sizes


def _valid_rows(m, group_sizes):
    return (jnp.arange(m) < jnp.sum(group_sizes))[:, None]


def _forward(x, w_gate, w_up, w_down, group_sizes):
    m = x.shape[0]
    padded = jnp.pad(x, ((0, CHUNKS[0]), (0, 0)))  # a chunk never starts past m, so it always fits
    starts = _starts(group_sizes)

    def expert(e, out):
        wg, wu, wd = w_gate[e], w_up[e], w_down[e]

        def chunk(row, n, out):
            xc = jax.lax.dynamic_slice_in_dim(padded, row, n, 0)
            hidden = swiglu(jnp.dot(xc, wg, preferred_element_type=jnp.float32),
                            jnp.dot(xc, wu, preferred_element_type=jnp.float32), x.dtype)
            y = jnp.dot(hidden, wd, preferred_element_type=jnp.float32).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0)

        return _over_chunks(starts[e], group_sizes[e], chunk, out)

    out = jax.lax.fori_loop(0, w_gate.shape[0], expert, jnp.zeros_like(padded))
    return jnp.where(_valid_rows(m, group_sizes), out[:m], jnp.zeros((), x.dtype))


def _backward(x, w_gate, w_up, w_down, group_sizes, dy):
    m = x.shape[0]
    dy = jnp.where(_valid_rows(m, group_sizes), dy, jnp.zeros((), dy.dtype)).astype(x.dtype)
    pad = ((0, CHUNKS[0]), (0, 0))
    padded, dy_padded = jnp.pad(x, pad), jnp.pad(dy, pad)
    starts = _starts(group_sizes)

    def expert(e, grads):
        dx, dwg_all, dwu_all, dwd_all = grads
        wg, wu, wd = w_gate[e], w_up[e], w_down[e]
        end = starts[e] + group_sizes[e]

        def chunk(row, n, acc):
            dx, dwg, dwu, dwd = acc
            xc = jax.lax.dynamic_slice_in_dim(padded, row, n, 0)
            dyc = jax.lax.dynamic_slice_in_dim(dy_padded, row, n, 0)
            dyc = jnp.where((row + jnp.arange(n) < end)[:, None], dyc, jnp.zeros((), dyc.dtype))
            gate = jnp.dot(xc, wg, preferred_element_type=jnp.float32)
            up = jnp.dot(xc, wu, preferred_element_type=jnp.float32)
            sig = jax.nn.sigmoid(gate)
            silu = gate * sig
            hidden = (silu * up).astype(x.dtype)
            dwd = dwd + jnp.dot(hidden.T, dyc, preferred_element_type=jnp.float32)
            dh = jnp.dot(dyc, wd.T, preferred_element_type=jnp.float32).astype(x.dtype).astype(jnp.float32)
            dup = (dh * silu).astype(x.dtype)
            dgate = (dh * up * sig * (1.0 + gate * (1.0 - sig))).astype(x.dtype)
            dwg = dwg + jnp.dot(xc.T, dgate, preferred_element_type=jnp.float32)
            dwu = dwu + jnp.dot(xc.T, dup, preferred_element_type=jnp.float32)
            dxc = (jnp.dot(dgate, wg.T, preferred_element_type=jnp.float32)
                   + jnp.dot(dup, wu.T, preferred_element_type=jnp.float32)).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(dx, dxc, row, 0), dwg, dwu, dwd

        zeros = [jnp.zeros(w.shape[1:], jnp.float32) for w in (w_gate, w_up, w_down)]
        dx, dwg, dwu, dwd = _over_chunks(starts[e], group_sizes[e], chunk, (dx, *zeros))
        return (dx, dwg_all.at[e].set(dwg.astype(w_gate.dtype)), dwu_all.at[e].set(dwu.astype(w_up.dtype)),
                dwd_all.at[e].set(dwd.astype(w_down.dtype)))

    init = (jnp.zeros_like(padded), jnp.zeros_like(w_gate), jnp.zeros_like(w_up), jnp.zeros_like(w_down))
    dx, dwg, dwu, dwd = jax.lax.fori_loop(0, w_gate.shape[0], expert, init)
    dx = jnp.where(_valid_rows(m, group_sizes), dx[:m], jnp.zeros((), x.dtype))
    return dx, dwg, dwu, dwd


@jax.custom_vjp
def _tiled(x, w_gate, w_up, w_down, group_sizes):
    return _forward(x, w_gate, w_up, w_down, group_sizes)


def _tiled_fwd(x, w_gate, w_up, w_down, group_sizes):
    return _forward(x, w_gate, w_up, w_down, group_sizes), (x, w_gate, w_up, w_down, group_sizes)


def _tiled_bwd(saved, dy):
    return (*_backward(*saved, dy), None)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_expert_ffn(x, w_gate, w_up, w_down, group_sizes) -> jax.Array:
    """SwiGLU of each sorted row with its expert's weights, over each expert's own rows.

    x [m, d]; w_gate, w_up [E, d, f]; w_down [E, f, d] (x's dtype); group_sizes [E] int32 (rows past
    their sum are padding). Returns [m, d], padding rows 0.
    """
    return _tiled(x, w_gate, w_up, w_down, group_sizes.astype(jnp.int32))

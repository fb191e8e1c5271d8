"""The `tiled` expert backend (the CPU default): a dropless grouped matmul in plain XLA whose work follows
the routed rows, at any expert count.

    tiled_expert_ffn(x_sorted [m, d], w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d],
                     group_sizes [E]) -> [m, d]

Rows are sorted by expert, so expert e owns rows [start_e, start_e + g_e). A loop over the experts reads
each expert's weights once (no per-tile weight copies) and walks its rows in chunks: chunks of
LOOP_CHUNK = 256 rows while more than 248 are left (`lax.while_loop`), then the rest rounded up to
ROW_MULTIPLE = 8 as one chunk per set bit of that count (128, 64, 32, 16, 8; `lax.cond`), so an expert of
g rows runs at most ceil(g / 256) + 5 chunks, and an empty expert none. Each chunk is a dynamic slice of
rows and two 2-D matmuls: x @ [Wg | Wu] (gate and up as one product against the expert's weights
concatenated once per expert) and the SwiGLU hidden @ Wd. Each expert computes its g_e rows rounded up to
8: at most `padded_rows(m, E)` = m + 7 * min(E, m) rows in all (<= 1.25 m at every micro and nano shape:
tests/test_experts.py). A last chunk that runs past its group writes rows of the next group, which that
group's own chunks overwrite later (groups run in order); rows past sum(g) are zeroed at the end.

Why chunks by bits: at the nano and micro shapes (tens to a few hundred rows per expert, d 16-256) the
earlier walk (chunks of 256 / 64 / 16 / 8 in four while loops, gate and up as two products) was bound by
XLA:CPU's cost per executed thunk: at the nano-d96 SMELT shape (74 experts, d 66, f 122, 8,192 rows) one
layer's forward + backward ran 8,272 thunks for 1.2 GFLOP, and 4,985 with this walk (docs/performance.md,
"The `tiled` walk by bits"). What is left there is the small products' own speed, not their number
(docs/performance.md, "What is left at the nano pairs").

The backward is a `custom_vjp` with the same loop (while loops have no reverse-mode autodiff): per chunk
the gate|up product is recomputed, the chunk's output cotangent is masked to its group, and the expert's
weight gradients are accumulated in float32 over its chunks (gate and up as one [d, 2f] block).

Precision as every backend (kernels/experts.py): float32 accumulation, the SwiGLU product in float32 cast
to x's dtype before the down projection; in the backward the hidden cotangent is rounded to x's dtype
where autodiff of the dense reference rounds it, and the gate/up cotangents are cast to x's dtype for
their matmuls (dx = [dgate | dup] @ [Wg | Wu]^T, one float32-accumulated product over 2f).

Measured against the previous design (each expert padded to a 64/128-row tile, a static tile count
floor((m + E(tile - 1)) / tile), per-tile weights gathered [n_tiles, d, f]: 1.73-3.08x the routed rows at
the micro shapes) in benchmarks/bench_tiles.py and docs/kernels.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from smelt_jax.kernels.rows import swiglu

LOOP_CHUNK = 256  # rows per matmul while more than LOOP_CHUNK - ROW_MULTIPLE rows of an expert are left
TAIL_CHUNKS = (128, 64, 32, 16, 8)  # then one chunk per set bit of the rest rounded up to ROW_MULTIPLE
ROW_MULTIPLE = TAIL_CHUNKS[-1]  # the padding granularity: each expert computes its rows rounded up to it


def padded_rows(m: int, n_experts: int) -> int:
    """Upper bound on the rows computed for m routed rows over n_experts: each non-empty expert's rows
    rounded up to ROW_MULTIPLE, so at most ROW_MULTIPLE - 1 extra rows per expert (and at most m non-empty)."""
    return m + (ROW_MULTIPLE - 1) * min(n_experts, m)


def computed_rows(group_sizes) -> int:
    """The rows the loop computes for these group sizes (host-side, for tests and benchmarks)."""
    sizes = np.asarray(group_sizes, np.int64)
    return int((-(-sizes // ROW_MULTIPLE) * ROW_MULTIPLE).sum())


def _over_chunks(start, size, body, carry):
    """carry = body(row, n, carry) for chunks [row, row + n) covering [start, start + size): n = LOOP_CHUNK
    while more than LOOP_CHUNK - ROW_MULTIPLE rows are left, then one n from TAIL_CHUNKS per set bit of
    the rest rounded up to ROW_MULTIPLE (the last chunk may run up to ROW_MULTIPLE - 1 rows past the end).
    Every chunk starts before start + size."""
    end = start + size

    def more(state):
        return end - state[0] > LOOP_CHUNK - ROW_MULTIPLE

    def step(state):
        return state[0] + LOOP_CHUNK, body(state[0], LOOP_CHUNK, state[1])

    row, carry = jax.lax.while_loop(more, step, (start, carry))
    rest = (end - row + ROW_MULTIPLE - 1) // ROW_MULTIPLE * ROW_MULTIPLE  # <= sum(TAIL_CHUNKS)
    for n in TAIL_CHUNKS:
        def take(state, n=n):
            return state[0] + n, body(state[0], n, state[1])

        row, carry = jax.lax.cond((rest & n) != 0, take, lambda state: state, (row, carry))
    return carry


def _starts(group_sizes):
    return jnp.cumsum(group_sizes) - group_sizes


def _valid_rows(m, group_sizes):
    return (jnp.arange(m) < jnp.sum(group_sizes))[:, None]


def _gate_up(w_gate, w_up, e):
    """[Wg[e] | Wu[e]], [d, 2f]: the gate and up projections as one matmul operand."""
    return jnp.concatenate([w_gate[e], w_up[e]], axis=1)


def _forward(x, w_gate, w_up, w_down, group_sizes):
    m = x.shape[0]
    f = w_gate.shape[2]
    padded = jnp.pad(x, ((0, LOOP_CHUNK), (0, 0)))  # a chunk never starts past m, so it always fits
    starts = _starts(group_sizes)

    def expert(e, out):
        wgu, wd = _gate_up(w_gate, w_up, e), w_down[e]

        def chunk(row, n, out):
            xc = jax.lax.dynamic_slice_in_dim(padded, row, n, 0)
            gate_up = jnp.dot(xc, wgu, preferred_element_type=jnp.float32)
            hidden = swiglu(gate_up[:, :f], gate_up[:, f:], x.dtype)
            y = jnp.dot(hidden, wd, preferred_element_type=jnp.float32).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0)

        return _over_chunks(starts[e], group_sizes[e], chunk, out)

    out = jax.lax.fori_loop(0, w_gate.shape[0], expert, jnp.zeros_like(padded))
    return jnp.where(_valid_rows(m, group_sizes), out[:m], jnp.zeros((), x.dtype))


def _backward(x, w_gate, w_up, w_down, group_sizes, dy):
    m, f = x.shape[0], w_gate.shape[2]
    dy = jnp.where(_valid_rows(m, group_sizes), dy, jnp.zeros((), dy.dtype)).astype(x.dtype)
    pad = ((0, LOOP_CHUNK), (0, 0))
    padded, dy_padded = jnp.pad(x, pad), jnp.pad(dy, pad)
    starts = _starts(group_sizes)

    def expert(e, grads):
        dx, dwg_all, dwu_all, dwd_all = grads
        wgu, wd = _gate_up(w_gate, w_up, e), w_down[e]
        end = starts[e] + group_sizes[e]

        def chunk(row, n, acc):
            dx, dwgu, dwd = acc
            xc = jax.lax.dynamic_slice_in_dim(padded, row, n, 0)
            dyc = jax.lax.dynamic_slice_in_dim(dy_padded, row, n, 0)
            dyc = jnp.where((row + jnp.arange(n) < end)[:, None], dyc, jnp.zeros((), dyc.dtype))
            gate_up = jnp.dot(xc, wgu, preferred_element_type=jnp.float32)
            gate, up = gate_up[:, :f], gate_up[:, f:]
            sig = jax.nn.sigmoid(gate)
            silu = gate * sig
            hidden = (silu * up).astype(x.dtype)
            dwd = dwd + jnp.dot(hidden.T, dyc, preferred_element_type=jnp.float32)
            dh = jnp.dot(dyc, wd.T, preferred_element_type=jnp.float32).astype(x.dtype).astype(jnp.float32)
            d_gate_up = jnp.concatenate([dh * up * sig * (1.0 + gate * (1.0 - sig)), dh * silu],
                                        axis=1).astype(x.dtype)
            dwgu = dwgu + jnp.dot(xc.T, d_gate_up, preferred_element_type=jnp.float32)
            dxc = jnp.dot(d_gate_up, wgu.T, preferred_element_type=jnp.float32).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(dx, dxc, row, 0), dwgu, dwd

        zeros = (jnp.zeros(wgu.shape, jnp.float32), jnp.zeros(wd.shape, jnp.float32))
        dx, dwgu, dwd = _over_chunks(starts[e], group_sizes[e], chunk, (dx, *zeros))
        return (dx, dwg_all.at[e].set(dwgu[:, :f].astype(w_gate.dtype)),
                dwu_all.at[e].set(dwgu[:, f:].astype(w_up.dtype)), dwd_all.at[e].set(dwd.astype(w_down.dtype)))

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

"""Every expert backend against the dense reference: forward and gradients, edge-case group sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels.backend import EXPERT_BACKENDS, EXPERT_IMPLS, choose_expert_backend
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.kernels.tiled import computed_rows, padded_rows, tiled_expert_ffn

N_EXPERTS, D_MODEL, FFN = 5, 24, 40
ROWS = 37  # not a multiple of any tile (megablox pads to 8 / 128, tiled's chunks run to 40)
BACKENDS = [b for b in EXPERT_BACKENDS if b != "dense"]  # every backend, against the reference

GROUPS = {
    "random_with_empty_expert_and_padding": [9, 0, 11, 4, 8],  # sum 32 < 37: 5 padding rows
    "all_on_one_expert": [0, 0, ROWS, 0, 0],
    "no_padding": [7, 8, 6, 9, 7],
    "all_padding": [0, 0, 0, 0, 0],
}
TOLERANCE = {jnp.float32: {"rtol": 1e-5, "atol": 1e-5}, jnp.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


def _inputs(dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (ROWS, D_MODEL), jnp.float32)
    w_gate = jax.random.normal(keys[1], (N_EXPERTS, D_MODEL, FFN)) / np.sqrt(D_MODEL)
    w_up = jax.random.normal(keys[2], (N_EXPERTS, D_MODEL, FFN)) / np.sqrt(D_MODEL)
    w_down = jax.random.normal(keys[3], (N_EXPERTS, FFN, D_MODEL)) / np.sqrt(FFN)
    cotangent = jax.random.normal(keys[4], (ROWS, D_MODEL))
    return [a.astype(dtype) for a in (x, w_gate, w_up, w_down)], cotangent


@functools.cache
def _jitted_value_and_grads(impl):
    """One compilation per backend and dtype: group sizes are a traced argument."""
    def loss(x, wg, wu, wd, group_sizes, cotangent):
        out = expert_ffn(x, wg, wu, wd, group_sizes, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _value_and_grads(impl, arrays, group_sizes, cotangent):
    (_, out), grads = _jitted_value_and_grads(impl)(*arrays, group_sizes, cotangent)
    return out, grads


def _naive(x, w_gate, w_up, w_down, group_sizes):
    """Row-by-row loop in float64: the definition of the semantics."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    row = 0
    for expert, size in enumerate(group_sizes):
        for i in range(row, row + size):
            gate, up = x[i] @ w_gate[expert], x[i] @ w_up[expert]
            out[i] = (gate / (1 + np.exp(-gate)) * up) @ w_down[expert]
        row += size
    return out


@pytest.mark.parametrize("groups", list(GROUPS))
def test_dense_reference_matches_row_by_row_definition(groups):
    arrays, _ = _inputs(jnp.float32)
    sizes = GROUPS[groups]
    out = expert_ffn(*arrays, jnp.array(sizes, jnp.int32), impl="dense")
    np.testing.assert_allclose(np.asarray(out), _naive(*arrays, sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sum(sizes):] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", BACKENDS)
def test_backend_matches_dense_forward_and_gradients(impl, dtype):
    tol = TOLERANCE[dtype]
    for seed, (case, sizes) in enumerate(GROUPS.items()):
        arrays, cotangent = _inputs(dtype, seed=seed)
        group_sizes = jnp.array(sizes, jnp.int32)
        want_out, want_grads = _value_and_grads("dense", arrays, group_sizes, cotangent)
        got_out, got_grads = _value_and_grads(impl, arrays, group_sizes, cotangent)
        assert got_out.dtype == dtype and got_out.shape == (ROWS, D_MODEL)
        np.testing.assert_allclose(np.asarray(got_out, np.float32),
                                   np.asarray(want_out, np.float32), err_msg=case, **tol)
        assert np.all(np.asarray(got_out, np.float32)[sum(sizes):] == 0), case
        for name, got, want in zip(("x", "w_gate", "w_up", "w_down"), got_grads, want_grads):
            assert np.all(np.isfinite(np.asarray(got, np.float32))), (case, name)
            scale = max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
            np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                                       np.asarray(want, np.float32) / scale,
                                       err_msg=f"{case}: d{name}", **tol)


def test_capacity_backend_with_tight_bound_matches_dense():
    """A caller-given capacity equal to the largest group is exact (the MoE layer's bound)."""
    arrays, _ = _inputs(jnp.float32)
    sizes = jnp.array(GROUPS["random_with_empty_expert_and_padding"], jnp.int32)
    got = expert_ffn(*arrays, sizes, impl="capacity", capacity=11)
    want = expert_ffn(*arrays, sizes, impl="dense")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# Odd group sizes around every chunk size (every group ends in a partial chunk of 8), rests that need
# every tail chunk (247 -> 248 = 128 + 64 + 32 + 16 + 8) or round up to a whole loop chunk (249, 255),
# groups past one and two loop chunks, empty groups, one hot expert, padding rows, and m below a chunk.
TILED_CASES = {
    "around_every_chunk": ([1, 7, 9, 15, 17, 31, 33, 63, 65, 127, 129, 247, 249, 255, 257, 505, 0], 2020),
    "one_hot_expert_past_the_largest_chunk": ([0, 0, 301, 0], 305),
    "m_below_a_chunk": ([2, 0, 3], 6),
    "all_padding": ([0, 0, 0], 5),
}


@pytest.mark.parametrize("case", list(TILED_CASES))
def test_tiled_backend_chunk_edges_match_float64_and_dense(case):
    """Forward against the float64 row-by-row definition and the dense backend, gradients against dense."""
    sizes, m = TILED_CASES[case]
    keys = jax.random.split(jax.random.key(7), 5)
    n, d, f = len(sizes), 12, 20
    x = jax.random.normal(keys[0], (m, d))
    w = [jax.random.normal(keys[1], (n, d, f)) / np.sqrt(d), jax.random.normal(keys[2], (n, d, f)) / np.sqrt(d),
         jax.random.normal(keys[3], (n, f, d)) / np.sqrt(f)]
    cotangent = jax.random.normal(keys[4], (m, d))
    group_sizes = jnp.array(sizes, jnp.int32)
    out = jax.jit(tiled_expert_ffn)(x, *w, group_sizes)
    np.testing.assert_allclose(np.asarray(out), _naive(x, *w, sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sum(sizes):] == 0)

    def loss(impl, *a):
        out = expert_ffn(*a, group_sizes, impl=impl)
        return jnp.sum(out * cotangent)

    want = jax.jit(jax.grad(functools.partial(loss, "dense"), argnums=(0, 1, 2, 3)))(x, *w)
    got = jax.jit(jax.grad(functools.partial(loss, "tiled"), argnums=(0, 1, 2, 3)))(x, *w)
    for name, g, wt in zip(("x", "w_gate", "w_up", "w_down"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wt), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def _suite_shapes():
    from experiments import load_suite

    shapes = set()
    for run in load_suite("micro"):
        m = run.schedule.batch_size * run.schedule.seq_len * run.model.top_k
        shapes.add((m, run.model.n_experts))
    return sorted(shapes)


def test_tiled_computes_at_most_1_25x_the_routed_rows_at_micro_and_nano_shapes():
    """The bound holds at every micro run (m = 8 x 256 x top-2) and over the nano range (m = 16 x 256 x 2,
    2-120 experts; the suite has 2-106), and really bounds the rows computed for adversarial and random
    splits."""
    shapes = _suite_shapes() + [(8192, e) for e in range(2, 121)]  # nano: 2 (control) to 106 experts
    assert len(shapes) > 30
    for m, n_experts in shapes:
        assert padded_rows(m, n_experts) <= 1.25 * m, (m, n_experts)
    rng = np.random.default_rng(0)
    for m, n_experts in ((4096, 136), (8192, 120), (37, 5), (6, 3)):
        worst = [1] * (n_experts - 1) + [m - n_experts + 1]  # every group one row past a multiple of 8
        splits = [worst] + [rng.multinomial(m, rng.dirichlet(np.ones(n_experts))) for _ in range(20)]
        for sizes in splits:
            assert sum(sizes) == m and computed_rows(sizes) <= padded_rows(m, n_experts)
        if (m - n_experts) % 8 == 0:  # then every group of `worst` is one row past a multiple of 8
            assert computed_rows(worst) == padded_rows(m, n_experts)  # the bound is tight
    assert computed_rows([0, 0, 301, 0]) == 304 and computed_rows([8, 16, 0]) == 24


class _Mesh:
    """The attributes of a (abstract) mesh that the backend decision reads."""

    def __init__(self, **shape):
        self.shape, self.empty = shape, not shape
        self.size = int(np.prod(list(shape.values()))) if shape else 0


def test_auto_picks_by_platform():
    assert choose_expert_backend("auto", "cpu") == "tiled"
    assert choose_expert_backend("auto", "gpu") == "ragged_dot"
    assert choose_expert_backend("auto", "cuda") == "ragged_dot"
    assert choose_expert_backend("auto", "tpu") == "pallas"
    assert choose_expert_backend("dense", "tpu") == "dense"
    assert set(EXPERT_IMPLS) == {"auto", *EXPERT_BACKENDS}
    with pytest.raises(ValueError, match="expert impl"):
        choose_expert_backend("nope")


def test_mosaic_backends_leave_gspmd_meshes_to_ragged_dot():
    """Mosaic kernels cannot be partitioned by GSPMD: on a multi-device mesh without an `expert` axis
    they become ragged_dot; with an expert axis they run per device inside the shard_map."""
    gspmd, expert_parallel = _Mesh(data=2, fsdp=4, expert=1), _Mesh(data=2, expert=4)
    one_device = _Mesh(data=1, fsdp=1, expert=1)
    for requested in ("auto", "pallas", "megablox"):
        assert choose_expert_backend(requested, "tpu", gspmd) == "ragged_dot"
        assert choose_expert_backend(requested, "tpu", expert_parallel) != "ragged_dot"
        assert choose_expert_backend(requested, "tpu", one_device) != "ragged_dot"
        assert choose_expert_backend(requested, "tpu", None) != "ragged_dot"
    assert choose_expert_backend("auto", "tpu", expert_parallel) == "pallas"
    assert choose_expert_backend("auto", "cpu", gspmd) == "tiled"  # XLA backends partition
    assert choose_expert_backend("capacity", "tpu", gspmd) == "capacity"


def test_bad_shapes_are_rejected():
    (x, wg, wu, wd), _ = _inputs(jnp.float32)
    sizes = jnp.array(GROUPS["no_padding"], jnp.int32)
    with pytest.raises(ValueError, match="d_model"):
        expert_ffn(x[:, :5], wg, wu, wd, sizes, impl="dense")
    with pytest.raises(ValueError, match="disagree"):
        expert_ffn(x, wg, wu, wd[:, :3], sizes, impl="dense")
    with pytest.raises(ValueError, match="group_sizes"):
        expert_ffn(x, wg, wu, wd, sizes[:3], impl="dense")

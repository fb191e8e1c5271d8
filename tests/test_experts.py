"""Every expert backend against the dense reference: forward and gradients, edge-case group sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels.backend import EXPERT_BACKENDS, EXPERT_IMPLS, choose_expert_backend
from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.kernels.tiled import tile_count, tiled_expert_ffn

N_EXPERTS, D_MODEL, FFN = 5, 24, 40
ROWS = 37  # not a multiple of any tile (megablox pads to 8 / 128, tiled to 40 / its tile)
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


@pytest.mark.parametrize("tile,capacity", [(8, None), (16, 11), (32, None), (8, 37)])
def test_tiled_backend_at_other_tiles_and_bounds_matches_dense(tile, capacity):
    """Tiles smaller than, near and above the groups, with and without the caller's bound; the
    static tile count really bounds the tiles used (odd sizes: every group needs a partial tile)."""
    arrays, cotangent = _inputs(jnp.float32, seed=3)
    for case, sizes in GROUPS.items():
        if capacity is not None and max(sizes) > capacity:
            continue  # the bound is a promise of the caller's
        group_sizes = jnp.array(sizes, jnp.int32)
        assert sum(-(-g // tile) for g in sizes) <= tile_count(ROWS, N_EXPERTS, tile, capacity), case

        def loss(impl, *a, group_sizes=group_sizes):
            if impl == "dense":
                out = expert_ffn(*a, group_sizes, impl="dense")
            else:
                out = tiled_expert_ffn(*a, group_sizes, tile=tile, capacity=capacity)
            return jnp.sum(out * cotangent)

        want = jax.grad(functools.partial(loss, "dense"), argnums=(0, 1, 2, 3))(*arrays)
        got = jax.grad(functools.partial(loss, "tiled"), argnums=(0, 1, 2, 3))(*arrays)
        for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{case}: d{name}")
        out = tiled_expert_ffn(*arrays, group_sizes, tile=tile, capacity=capacity)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expert_ffn(*arrays, group_sizes,
                                                                          impl="dense")),
                                   rtol=1e-5, atol=1e-5, err_msg=case)


def test_tile_count_bound_is_tight_for_the_worst_split():
    # 5 experts, tile 8, 37 rows: sizes 1, 1, 1, 1, 33 need 1 + 1 + 1 + 1 + 5 = 9 tiles
    assert tile_count(37, 5, 8) == 9 and sum(-(-g // 8) for g in (1, 1, 1, 1, 33)) == 9
    assert tile_count(37, 5, 8, capacity=4) == 5  # every group fits one tile


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

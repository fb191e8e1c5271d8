"""Pallas expert kernels in interpret mode on CPU, against jax.lax.ragged_dot and a dense per-row reference.

Tolerances (max abs error on O(1) outputs; inputs ~N(0, 1/sqrt(k))):
  float32: 1e-4 (only the summation order differs);
  bfloat16: 5e-2 on values and 1e-1 on gradients relative to max|ref| (the kernels round operands and the
  stored output to bf16, the reference computes in float32 from the same bf16 inputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels.gmm import gmm, make_group_metadata, tgmm
from smelt_jax.kernels.pallas_ffn import pallas_expert_ffn
from smelt_jax.kernels.swiglu import grouped_swiglu



@pytest.fixture(autouse=True)
def _highest_matmul_precision():
    """References in full float32 for these tests only: a global config update would leak into other
    test modules (pytest imports them all), and Mosaic rejects bf16 dots at HIGHEST precision."""
    with jax.default_matmul_precision("highest"):
        yield

TILING = (32, 128, 128)  # small row tile -> many tile-sharing groups; k, n tiles exercise padding at 160
ABS_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 5e-2}
GRAD_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-1}

GROUP_CASES = {
    "random_with_empty": [13, 0, 29, 7, 0, 31],     # sum 80 < m: trailing rows must be 0
    "single_full_group": [0, 0, 100, 0, 0, 0],     # one group owns every row
    "all_empty": [0, 0, 0, 0, 0, 0],
    "tile_multiples": [32, 0, 0, 64, 0, 4],        # boundaries on tile edges
}


def _rng_arrays(seed, shapes, dtype):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [(jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-2] if len(shape) == 3 else shape[-1]))
            .astype(dtype) for key, shape in zip(keys, shapes)]


def _row_groups(group_sizes, m):
    """Group id per row, -1 past the groups."""
    ids = np.repeat(np.arange(len(group_sizes)), group_sizes)
    return np.concatenate([ids, -np.ones(m - ids.size, int)])


def dense_gmm(lhs, rhs, group_sizes):
    """out[r] = lhs[r] @ rhs[group(r)], 0 for rows past the groups: one-hot mask over all groups, f32."""
    group_ids = jnp.asarray(_row_groups(np.asarray(group_sizes), lhs.shape[0]))
    one_hot = (group_ids[:, None] == jnp.arange(rhs.shape[0])[None, :]).astype(jnp.float32)
    per_group = jnp.einsum("mk,gkn->gmn", lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    return jnp.einsum("mg,gmn->mn", one_hot, per_group)


def dense_swiglu(x, w_gate, w_up, group_sizes):
    return jax.nn.silu(dense_gmm(x, w_gate, group_sizes)) * dense_gmm(x, w_up, group_sizes)


def _max_err(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)), initial=0.0))


def _max_abs(a):
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32)), initial=0.0))


def _scale(ref):
    return max(1.0, float(jnp.max(jnp.abs(ref))))


# ------------------------------------------------------------------------------------------------ metadata


@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_metadata_visits_cover_each_row_once(case):
    sizes = np.array(GROUP_CASES[case])
    m, tm = 128, 32
    meta = make_group_metadata(jnp.asarray(sizes, jnp.int32), m, tm, visit_empty_groups=False, cover_tail=True)
    n = int(meta.num_visits)
    covered = np.zeros(m, int)
    tiles = np.asarray(meta.visit_tile[:n])
    assert np.all(np.diff(tiles) >= 0), "row tiles must be visited in order (revisits consecutive)"
    for g, t in zip(np.asarray(meta.visit_group[:n]), tiles):
        lo, hi = int(meta.group_starts[g]), int(meta.group_ends[g])
        rows = np.arange(t * tm, (t + 1) * tm)
        assert np.any((rows >= lo) & (rows < hi)), "a visit must touch its group"
        covered[rows[(rows >= lo) & (rows < hi)]] += 1
    np.testing.assert_array_equal(covered, 1)
    assert n <= meta.visit_group.shape[0]


def test_metadata_visits_empty_groups_for_tgmm():
    sizes = jnp.asarray([0, 40, 0, 0, 24], jnp.int32)
    meta = make_group_metadata(sizes, 64, 32, visit_empty_groups=True, cover_tail=False)
    visited = set(np.asarray(meta.visit_group[: int(meta.num_visits)]).tolist())
    assert visited == {0, 1, 2, 3, 4}


# ------------------------------------------------------------------------------------------- gmm / tgmm


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_gmm_forward_matches_references(case, dtype):
    m, k, n = 100, 96, 160  # m, n not tile multiples; k smaller than its tile
    sizes = jnp.asarray(GROUP_CASES[case], jnp.int32)
    lhs, rhs = _rng_arrays(0, [(m, k), (len(GROUP_CASES[case]), k, n)], dtype)
    out = gmm(lhs, rhs, sizes, tiling=TILING, interpret=True)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = dense_gmm(lhs, rhs, sizes)
    assert _max_err(out, ref) <= ABS_TOL[dtype] * _scale(ref)
    used = int(sizes.sum())
    ragged = jax.lax.ragged_dot(lhs[:used], rhs, sizes, preferred_element_type=jnp.float32)
    assert _max_err(out[:used], ragged) <= ABS_TOL[dtype] * _scale(ref)
    assert _max_abs(out[used:]) == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_gradients_match_ragged_dot(dtype):
    m, k, n = 100, 160, 96
    sizes_list = GROUP_CASES["random_with_empty"]
    sizes = jnp.asarray(sizes_list, jnp.int32)
    lhs, rhs, probe = _rng_arrays(1, [(m, k), (len(sizes_list), k, n), (m, n)], dtype)
    used = int(sizes.sum())

    def loss_kernel(lhs, rhs):
        return jnp.sum(gmm(lhs, rhs, sizes, tiling=TILING, interpret=True).astype(jnp.float32) * probe)

    def loss_ragged(lhs, rhs):
        out = jax.lax.ragged_dot(lhs[:used].astype(jnp.float32), rhs.astype(jnp.float32), sizes)
        return jnp.sum(out * probe[:used].astype(jnp.float32))

    grads = jax.grad(loss_kernel, (0, 1))(lhs, rhs)
    refs = jax.grad(loss_ragged, (0, 1))(lhs, rhs)
    for grad, ref in zip(grads, refs):
        assert grad.dtype == dtype
        assert _max_err(grad, ref) <= GRAD_TOL[dtype] * _scale(ref)
    assert _max_abs(grads[0][used:]) == 0.0
    assert _max_abs(grads[1][1]) == 0.0  # empty group: zero weight grad


@pytest.mark.parametrize("case", ["random_with_empty", "single_full_group", "all_empty"])
def test_tgmm_matches_dense(case):
    m, k, n = 100, 96, 160
    sizes_list = GROUP_CASES[case]
    sizes = jnp.asarray(sizes_list, jnp.int32)
    lhs, grad = _rng_arrays(2, [(m, k), (m, n)], jnp.float32)
    grad = grad.at[int(sizes.sum()):].set(jnp.nan)  # rows past the groups must be ignored, even NaN
    out = tgmm(lhs, grad, sizes, tiling=TILING, interpret=True)
    group_ids = _row_groups(sizes_list, m)
    ref = np.zeros((len(sizes_list), k, n), np.float32)
    for g in range(len(sizes_list)):
        rows = group_ids == g
        ref[g] = np.asarray(lhs)[rows].T @ np.asarray(grad)[rows]
    assert _max_err(out, ref) <= ABS_TOL[jnp.float32] * _scale(ref)


def test_padding_and_tiling_do_not_change_results():
    m, k, n = 70, 256, 256
    sizes = jnp.asarray([20, 0, 35, 15], jnp.int32)
    lhs, rhs = _rng_arrays(3, [(m, k), (4, k, n)], jnp.float32)
    small = gmm(lhs, rhs, sizes, tiling=(16, 128, 128), interpret=True)
    large = gmm(lhs, rhs, sizes, tiling=(512, 512, 512), interpret=True)
    padded = gmm(jnp.pad(lhs, ((0, 26), (0, 0))), rhs, sizes, tiling=(32, 128, 128), interpret=True)[:m]
    assert _max_err(small, large) <= 1e-5
    assert _max_err(small, padded) <= 1e-5


def test_lane_tiles_are_chosen_to_pad_least():
    from smelt_jax.kernels.gmm_tiles import effective_tiling, fit_lane_tile

    assert fit_lane_tile(300, 512) == 300  # fits one tile: the whole dimension
    assert fit_lane_tile(1024, 512) == 512
    assert fit_lane_tile(672, 512) == 384  # 768, not 1024 with 512-wide tiles
    assert fit_lane_tile(544, 512) == 128  # 640
    assert fit_lane_tile(1848, 512) == 384  # 1920 (2048 with 512)
    assert fit_lane_tile(2304, 512) == 384  # 2304 exactly
    assert effective_tiling(70, 672, 544, (512, 512, 512)) == (80, 384, 128)


def test_a_tile_smaller_than_requested_gives_the_same_result():
    m, k, n = 50, 384, 384  # with tk = tn = 256 requested, 128-wide tiles pad nothing (256 would pad to 512)
    sizes = jnp.asarray([20, 0, 30], jnp.int32)
    lhs, rhs = _rng_arrays(5, [(m, k), (3, k, n)], jnp.float32)
    out = gmm(lhs, rhs, sizes, tiling=(16, 256, 256), interpret=True)
    ref = jax.lax.ragged_dot(lhs, rhs, sizes)
    assert _max_err(out[:50], ref[:50]) <= ABS_TOL[jnp.float32] * _scale(ref)


def test_bad_inputs_raise_clear_errors():
    lhs = jnp.zeros((8, 16), jnp.float32)
    rhs = jnp.zeros((2, 16, 32), jnp.float32)
    with pytest.raises(ValueError, match="int32"):
        gmm(lhs, rhs, jnp.asarray([4, 4], jnp.int64 if jax.config.x64_enabled else jnp.int16), interpret=True)
    with pytest.raises(ValueError, match="shape"):
        gmm(lhs, rhs, jnp.asarray([8], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        gmm(lhs, rhs, jnp.asarray([4, 4], jnp.int32), tiling=(20, 128, 128), interpret=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        gmm(lhs.astype(jnp.float16), rhs, jnp.asarray([4, 4], jnp.int32), interpret=True)


# --------------------------------------------------------------------------------------- fused SwiGLU / FFN


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_swiglu_equals_unfused_and_dense(dtype):
    m, d, f = 100, 96, 160
    sizes = jnp.asarray(GROUP_CASES["random_with_empty"], jnp.int32)
    x, w_gate, w_up = _rng_arrays(4, [(m, d), (6, d, f), (6, d, f)], dtype)
    fused = grouped_swiglu(x, w_gate, w_up, sizes, tiling=TILING, interpret=True)
    gate = gmm(x, w_gate, sizes, tiling=TILING, interpret=True).astype(jnp.float32)
    up = gmm(x, w_up, sizes, tiling=TILING, interpret=True).astype(jnp.float32)
    unfused = jax.nn.silu(gate) * up
    ref = dense_swiglu(x, w_gate, w_up, sizes)
    assert fused.dtype == dtype
    assert _max_err(fused, ref) <= ABS_TOL[dtype] * _scale(ref)
    assert _max_err(fused, unfused) <= ABS_TOL[dtype] * _scale(ref)
    assert _max_abs(fused[int(sizes.sum()):]) == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_swiglu_gradients_match_dense(dtype):
    m, d, f = 100, 96, 160
    sizes = jnp.asarray(GROUP_CASES["random_with_empty"], jnp.int32)
    x, w_gate, w_up, probe = _rng_arrays(5, [(m, d), (6, d, f), (6, d, f), (m, f)], dtype)

    def loss_kernel(x, w_gate, w_up):
        h = grouped_swiglu(x, w_gate, w_up, sizes, tiling=TILING, interpret=True)
        return jnp.sum(h.astype(jnp.float32) * probe)

    def loss_dense(x, w_gate, w_up):
        return jnp.sum(dense_swiglu(x, w_gate, w_up, sizes) * probe.astype(jnp.float32))

    grads = jax.grad(loss_kernel, (0, 1, 2))(x, w_gate, w_up)
    refs = jax.grad(loss_dense, (0, 1, 2))(x, w_gate, w_up)
    for grad, ref in zip(grads, refs):
        assert grad.shape == ref.shape and grad.dtype == dtype
        assert _max_err(grad, ref) <= GRAD_TOL[dtype] * _scale(ref)


@pytest.mark.parametrize("case", ["random_with_empty", "single_full_group"])
def test_pallas_expert_ffn_forward_and_gradients(case):
    m, d, f = 100, 96, 160
    sizes = jnp.asarray(GROUP_CASES[case], jnp.int32)
    x, w_gate, w_up, w_down, probe = _rng_arrays(6, [(m, d), (6, d, f), (6, d, f), (6, f, d), (m, d)],
                                                  jnp.float32)

    def ffn_dense(x, w_gate, w_up, w_down):
        return dense_gmm(dense_swiglu(x, w_gate, w_up, sizes), w_down, sizes)

    def ffn_ragged(x, w_gate, w_up, w_down):
        used = int(sizes.sum())
        hidden = jax.nn.silu(jax.lax.ragged_dot(x[:used], w_gate, sizes)) * jax.lax.ragged_dot(x[:used], w_up, sizes)
        return jnp.pad(jax.lax.ragged_dot(hidden, w_down, sizes), ((0, m - used), (0, 0)))

    def ffn_kernel(x, w_gate, w_up, w_down):
        return pallas_expert_ffn(x, w_gate, w_up, w_down, sizes, interpret=True, tiling=TILING)

    out = ffn_kernel(x, w_gate, w_up, w_down)
    ref = ffn_dense(x, w_gate, w_up, w_down)
    assert _max_err(out, ref) <= 1e-4 * _scale(ref)
    assert _max_err(out, ffn_ragged(x, w_gate, w_up, w_down)) <= 1e-4 * _scale(ref)
    grads = jax.grad(lambda *w: jnp.sum(ffn_kernel(*w) * probe), (0, 1, 2, 3))(x, w_gate, w_up, w_down)
    refs = jax.grad(lambda *w: jnp.sum(ffn_dense(*w) * probe), (0, 1, 2, 3))(x, w_gate, w_up, w_down)
    for grad, ref_grad in zip(grads, refs):
        assert _max_err(grad, ref_grad) <= 1e-4 * _scale(ref_grad)


def test_pallas_expert_ffn_under_jit_with_traced_group_sizes():
    m, d, f = 64, 128, 128
    x, w_gate, w_up, w_down = _rng_arrays(7, [(m, d), (4, d, f), (4, d, f), (4, f, d)], jnp.float32)
    run = jax.jit(lambda sizes: pallas_expert_ffn(x, w_gate, w_up, w_down, sizes, interpret=True,
                                                  tiling=(32, 128, 128)))
    for sizes_list in ([16, 16, 16, 16], [0, 64, 0, 0], [5, 0, 50, 1]):
        sizes = jnp.asarray(sizes_list, jnp.int32)
        ref = dense_gmm(dense_swiglu(x, w_gate, w_up, sizes), w_down, sizes)
        assert _max_err(run(sizes), ref) <= 1e-4 * _scale(ref)


# ------------------------------------------------------------------------ row weights (the MoE combine)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_weighted_gmm_forward_and_gradients_match_dense(case, dtype):
    """gmm(row_weight=w) = w[:, None] * (lhs @ rhs[g]), and its three gradients (the weight's taken in the
    d lhs kernel's epilogue, split over two k tiles here: k = 160 > tk = 128), against the dense reference
    in float32; rows past the groups give 0 and a 0 weight gradient."""
    m, k, n = 100, 160, 96
    sizes_list = GROUP_CASES[case]
    sizes = jnp.asarray(sizes_list, jnp.int32)
    lhs, rhs, probe = _rng_arrays(8, [(m, k), (len(sizes_list), k, n), (m, n)], dtype)
    weight = jax.random.uniform(jax.random.key(9), (m,), jnp.float32, 0.1, 1.0)

    def kernel(lhs, rhs, weight):
        return gmm(lhs, rhs, sizes, row_weight=weight, tiling=TILING, interpret=True)

    def dense(lhs, rhs, weight):
        return dense_gmm(lhs, rhs, sizes) * weight[:, None]

    out, ref = kernel(lhs, rhs, weight), dense(lhs, rhs, weight)
    assert out.shape == (m, n) and out.dtype == dtype
    assert _max_err(out, ref) <= ABS_TOL[dtype] * _scale(ref)
    used = int(sizes.sum())
    assert _max_abs(out[used:]) == 0.0
    grads = jax.grad(lambda *a: jnp.sum(kernel(*a).astype(jnp.float32) * probe), (0, 1, 2))(lhs, rhs, weight)
    refs = jax.grad(lambda *a: jnp.sum(dense(*a) * probe.astype(jnp.float32)), (0, 1, 2))(lhs, rhs, weight)
    for name, grad, ref_grad in zip(("lhs", "rhs", "row_weight"), grads, refs):
        assert grad.shape == ref_grad.shape, name
        assert _max_err(grad, ref_grad) <= GRAD_TOL[dtype] * _scale(ref_grad), name
    assert grads[2].dtype == jnp.float32
    assert _max_abs(grads[2][used:]) == 0.0 and _max_abs(grads[0][used:]) == 0.0


def test_weighted_gmm_with_unit_weights_is_gmm():
    m, k, n = 100, 96, 160
    sizes = jnp.asarray(GROUP_CASES["random_with_empty"], jnp.int32)
    lhs, rhs = _rng_arrays(10, [(m, k), (6, k, n)], jnp.float32)
    plain = gmm(lhs, rhs, sizes, tiling=TILING, interpret=True)
    weighted = gmm(lhs, rhs, sizes, row_weight=jnp.ones((m,), jnp.float32), tiling=TILING, interpret=True)
    assert _max_err(plain, weighted) == 0.0
    with pytest.raises(ValueError, match="row_weight"):
        gmm(lhs, rhs, sizes, row_weight=jnp.ones((m, 1), jnp.float32), interpret=True)


@pytest.mark.parametrize("case", ["random_with_empty", "single_full_group"])
def test_pallas_expert_ffn_with_row_weights_matches_the_weighted_dense_ffn(case):
    m, d, f = 100, 96, 160
    sizes = jnp.asarray(GROUP_CASES[case], jnp.int32)
    x, w_gate, w_up, w_down, probe = _rng_arrays(11, [(m, d), (6, d, f), (6, d, f), (6, f, d), (m, d)],
                                                  jnp.float32)
    weight = jax.random.uniform(jax.random.key(12), (m,), jnp.float32, 0.1, 1.0)

    def kernel(x, w_gate, w_up, w_down, weight):
        return pallas_expert_ffn(x, w_gate, w_up, w_down, sizes, row_weight=weight, interpret=True, tiling=TILING)

    def dense(x, w_gate, w_up, w_down, weight):
        return dense_gmm(dense_swiglu(x, w_gate, w_up, sizes), w_down, sizes) * weight[:, None]

    args = (x, w_gate, w_up, w_down, weight)
    ref = dense(*args)
    assert _max_err(kernel(*args), ref) <= 1e-4 * _scale(ref)
    grads = jax.grad(lambda *a: jnp.sum(kernel(*a) * probe), tuple(range(5)))(*args)
    refs = jax.grad(lambda *a: jnp.sum(dense(*a) * probe), tuple(range(5)))(*args)
    for name, grad, ref_grad in zip(("x", "w_gate", "w_up", "w_down", "row_weight"), grads, refs):
        assert _max_err(grad, ref_grad) <= 1e-4 * _scale(ref_grad), name


def test_row_weights_need_lane_wide_row_tiles_for_mosaic():
    """A per-row array's 1-D blocks must be 128-lane multiples or the whole array for Mosaic: a 32-row
    tile of 100 rows is refused before Mosaic sees it (interpret mode takes any tile)."""
    m, k, n = 100, 96, 160
    sizes = jnp.asarray(GROUP_CASES["random_with_empty"], jnp.int32)
    lhs, rhs = _rng_arrays(13, [(m, k), (6, k, n)], jnp.float32)
    weight = jnp.ones((m,), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        gmm(lhs, rhs, sizes, row_weight=weight, tiling=TILING, interpret=False)
    # (128-row tiles pass the check and compile: tests/test_kernels_tpu_aot.py, with row weights)

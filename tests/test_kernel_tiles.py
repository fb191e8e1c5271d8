"""Expert kernel tiles that fit the model (kernels/gmm.py `effective_tiling`, ONE_BLOCK_LANES): for every
smelt16 width the model width d and the expert width f are one block each on TPU (no zero-pad / slice
copies around the kernels, the weight block constant over a group's row tiles); the kernels agree with the
reference at such tiles, d not a multiple of 128 included (interpret mode); and they compile to Mosaic for
v5p ahead of time at smelt16's narrowest and widest shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels.experts import expert_ffn
from smelt_jax.kernels.gmm_tiles import (
    DEFAULT_TILING,
    ONE_BLOCK_LANES,
    effective_tiling,
    one_block_vmem_bytes,
)
from smelt_jax.kernels.pallas_ffn import pallas_expert_ffn


def _smelt16_widths():
    import experiments

    return sorted({(r.model.d_model, r.model.expert_ffn) for r in experiments.load_suite("smelt16")})


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e"])
def test_every_smelt16_width_is_one_block_on_tpu(generation):
    tm = DEFAULT_TILING[generation][0]
    for d, f in _smelt16_widths():
        assert effective_tiling(4096, d, f, None, generation)[1:] == (d, f)  # up-projection: k = d, n = f
        assert effective_tiling(4096, f, d, None, generation)[1:] == (f, d)  # down-projection: k = f, n = d
        assert one_block_vmem_bytes(tm, d, f) <= 3 * 2**30 // 4 // 32  # <= 24 MiB: far below 3/4 of VMEM
    assert effective_tiling(4096, 576, 424, None, generation) == (512, 576, 424)
    # past the one-block width the padding-least 128-multiple tile as before
    wide = ONE_BLOCK_LANES[generation] + 128
    assert effective_tiling(4096, wide, 424, None, generation)[1] <= DEFAULT_TILING[generation][1]


def test_an_explicit_tiling_is_fitted_as_before():
    assert effective_tiling(70, 672, 544, (512, 512, 512)) == (80, 384, 128)
    assert effective_tiling(70, 672, 544, None, "other") == (80, 672, 544)  # 'other' one-block up to 1024


def _problem(m, d, f, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, d)), dtype)
    w = [jnp.asarray(0.2 * rng.normal(size=shape), dtype) for shape in
         ((len(sizes), d, f), (len(sizes), d, f), (len(sizes), f, d))]
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("d,f,sizes", [
    (576, 424, [40, 0, 24]),   # 100M S95's widths; d and f not multiples of 128; an empty expert
    (200, 136, [5, 27, 0]),    # narrow, rows past the groups (m 48 > 32)
])
def test_the_kernels_at_one_block_tiles_match_the_reference(d, f, sizes):
    m = 48 if sum(sizes) < 48 else sum(sizes)
    x, w, group_sizes = _problem(m, d, f, sizes, jnp.float32)
    assert effective_tiling(m, d, f, None)[1:] == (d, f)  # off TPU: 'other', one block up to 1024

    def loss(fn, x, *w):
        return jnp.sum(fn(x, *w, group_sizes) ** 2)

    def pallas(x, wg, wu, wd, sizes):
        return pallas_expert_ffn(x, wg, wu, wd, sizes, interpret=True)

    def dense(x, wg, wu, wd, sizes):
        return expert_ffn(x, wg, wu, wd, sizes, impl="dense")

    def close(a, b, name):  # float32 sums in another order: error relative to the largest entry
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(b)) > 0 and np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), name

    close(pallas(x, *w, group_sizes), dense(x, *w, group_sizes), "forward")
    grads = jax.grad(lambda *a: loss(pallas, *a), (0, 1, 2, 3))(x, *w)
    ref = jax.grad(lambda *a: loss(dense, *a), (0, 1, 2, 3))(x, *w)
    for name, g, r in zip(("x", "w_gate", "w_up", "w_down"), grads, ref):
        close(g, r, name)
    assert not np.any(np.asarray(grads[1])[np.asarray(group_sizes) == 0])  # an empty expert: no gradient
    # no zero padding of d or f around the kernels: the only pads are none at all
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: loss(pallas, *a), (0, 1, 2, 3)))(x, *w)
    if m % 16 == 0:
        assert "pad" not in {e.primitive.name for e in jaxpr.jaxpr.eqns}


@pytest.mark.tpu
@pytest.mark.integration
@pytest.mark.parametrize("m,d,f,e", [(1024, 576, 424, 4), (1024, 2520, 336, 2), (1024, 2304, 768, 2)])
def test_one_block_tiles_compile_to_mosaic_for_v5p(m, d, f, e):
    """Forward + backward of the expert FFN with the v5p default tiles (d, f one block each) at the
    narrowest (100M S95) and widest (1.6B) smelt16 widths: real Mosaic compiles, VMEM included, and no
    pad / slice of the width around the kernels in the compiled program."""
    from smelt_jax.compile import aot

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    mesh = jax.sharding.Mesh(np.array(aot.tpu_topology("v5p:2x2x1").devices[:1]), ("x",))
    args = [jax.ShapeDtypeStruct((m, d), jnp.bfloat16), jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16), jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((e,), jnp.int32)]

    def backward(x, w_gate, w_up, w_down, sizes):
        loss = lambda *a: jnp.sum(pallas_expert_ffn(*a, sizes).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.grad(loss, (0, 1, 2, 3))(x, w_gate, w_up, w_down)

    with jax.set_mesh(mesh):
        assert effective_tiling(m, d, f, None) == (512, d, f)  # traced for v5p: its defaults
    compiled, _ = aot.compile_for_tpu(backward, args, mesh)
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 7
    padded = (f"[{m},{-(-d // 128) * 128}]", f"[{m},{-(-f // 128) * 128}]")
    assert not any(shape in text for shape in padded if shape not in (f"[{m},{d}]", f"[{m},{f}]"))

"""The fused linear cross-entropy (kernels/fused_ce.py, `unembed_cross_entropy(impl='fused')`) against plain
references on random inputs: the kernels' statistics and gradients, the loss and its gradients (hidden,
unembedding, mask) with masked tokens, an all-masked row, odd lengths, vocabularies that no tile divides,
targets outside a vocabulary shard, z-loss, bf16; the shard_map over a fake 8-device mesh; the platform
choice; and a real Mosaic compile for TPU whose program holds no [tokens, vocab] float32 buffer.

On CPU the kernels run in Pallas interpret mode.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels import fused_ce
from smelt_jax.kernels.backend import LOSS_IMPLS, choose_loss_impl
from smelt_jax.model.loss import unembed_cross_entropy
from smelt_jax.parallel.sharding import MESH_AXES
from tests.platform_fakes import FakeMesh
from tests.test_loss import assert_bf16_loss_matches

# Small tiles so that the small inputs span several token and vocabulary tiles (and a padded last one), the
# backward's vocabulary blocks two sub-tiles each.
TILES = fused_ce.Tiles(fwd_tokens=32, fwd_vocab=128, bwd_tokens=16, bwd_vocab=256, splits=2, bwd_sub=128)


def _inputs(b, s, d, v, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k[0], (b, s, d)).astype(dtype)
    unembedding = jax.random.normal(k[1], (d, v)) * (2.0 / np.sqrt(d))
    targets = jax.random.randint(k[2], (b, s), 0, v)
    mask = (jax.random.uniform(k[3], (b, s)) > 0.3).astype(jnp.float32)
    return hidden, unembedding, targets, mask


def _reference(hidden, unembedding, targets, mask, z_loss=0.0):
    """Full float32 logits: sum over masked tokens of -log_softmax[target] + z * logsumexp**2."""
    logits = jnp.einsum("bsd,dv->bsv", hidden, unembedding.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    return jnp.sum((nll + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))) * mask)


def _value_and_grads(fn, hidden, unembedding, mask):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(hidden, unembedding, mask)


@pytest.mark.parametrize("n, v, splits, block", [(111, 300, 2, 128), (64, 1000, 2, 256), (8, 130, 1, 256),
                                                 (200, 1000, 3, 128)])
def test_kernels_match_plain_statistics_and_gradients(n, v, splits, block):
    d = 24
    k = jax.random.split(jax.random.key(n + v), 5)
    h = jax.random.normal(k[0], (n, d))
    w = jax.random.normal(k[1], (d, v)) / 3
    targets = jax.random.randint(k[2], (n,), -5, v + 5)  # some outside [0, v): a shard's foreign targets
    a, c = jax.random.uniform(k[3], (n,)), jax.random.uniform(k[4], (n,))
    tiles = fused_ce.Tiles(32, 128, 16, block, splits, bwd_sub=128)
    lse, picked = fused_ce.token_stats(h, w, targets, tiles=tiles)
    logits = h @ w
    inside = (targets >= 0) & (targets < v)
    want_pick = jnp.where(inside, jnp.take_along_axis(logits, jnp.clip(targets, 0, v - 1)[:, None], 1)[:, 0], 0)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(picked, want_pick, rtol=1e-5, atol=1e-5)
    assert not np.any(np.isnan(picked))
    dh, dw = fused_ce.token_grads(h, w, targets, lse, a, c, tiles=tiles)
    dlogits = a[:, None] * jax.nn.softmax(logits, -1) - c[:, None] * jax.nn.one_hot(targets, v)
    assert dh.shape == (n, d) and dw.shape == (d, v) and dh.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(dh, dlogits @ w.T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, h.T @ dlogits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("shape", [(3, 37, 16, 300), (2, 8, 8, 130), (1, 5, 16, 50)])
def test_fused_loss_and_gradients_match_the_reference(shape, z_loss):
    hidden, unembedding, targets, mask = _inputs(*shape, seed=sum(shape))
    mask = mask.at[0].set(0.0)  # a whole row without a counted token
    fused = lambda h, u, m: unembed_cross_entropy(h, u, targets, m, impl="fused", tiles=TILES,  # noqa: E731
                                                  z_loss=z_loss)[0]
    ref = lambda h, u, m: _reference(h, u, targets, m, z_loss)  # noqa: E731
    got, want = (_value_and_grads(f, hidden, unembedding, mask) for f in (fused, ref))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for name, g, w in zip(("hidden", "unembedding", "mask"), got[1], want[1]):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[1][0][0]), 0.0)  # the all-masked row has no gradient


def test_all_masked_gives_zero_loss_and_gradients_and_the_chunked_path_agrees_on_z_loss():
    hidden, unembedding, targets, mask = _inputs(2, 9, 8, 200, seed=5)
    zero = jnp.zeros_like(mask)
    fused = lambda h, u: unembed_cross_entropy(h, u, targets, zero, impl="fused", tiles=TILES)[0]  # noqa: E731
    loss, (dh, du) = jax.value_and_grad(fused, argnums=(0, 1))(hidden, unembedding)
    assert float(loss) == 0.0 and not np.any(np.asarray(dh)) and not np.any(np.asarray(du))
    chunked = lambda h, u: unembed_cross_entropy(h, u, targets, mask, impl="chunked", chunk=4,  # noqa: E731
                                                 z_loss=0.05)[0]
    ref = lambda h, u: _reference(h, u, targets, mask, 0.05)  # noqa: E731
    (got, got_g), (want, want_g) = (jax.value_and_grad(f, argnums=(0, 1))(hidden, unembedding) for f in (chunked, ref))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_bf16_hidden_with_float32_unembedding_matches_within_bf16_tolerance():
    hidden, unembedding, targets, mask = _inputs(2, 40, 32, 257, seed=7, dtype=jnp.bfloat16)
    fused = lambda h, u: unembed_cross_entropy(h, u, targets, mask, impl="fused", tiles=TILES)[0]  # noqa: E731
    assert_bf16_loss_matches(fused, lambda h, u: _reference(h, u, targets, mask), hidden, unembedding)


@pytest.mark.parametrize("sizes", [(1, 2, 2, 2), (2, 2, 2, 1)])
def test_fused_loss_under_a_mesh_equals_one_device(sizes):
    """The shard_map path (batch over data x fsdp x expert, vocabulary over tensor, d(unembedding)
    reduce-scattered over fsdp) gives the one-device numbers."""
    mesh = jax.make_mesh(sizes, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    hidden, unembedding, targets, mask = _inputs(8, 11, 16, 300, seed=11)
    fn = lambda h, u, m: unembed_cross_entropy(h, u, targets, m, impl="fused", tiles=TILES, z_loss=1e-3)[0]  # noqa: E731
    want = _value_and_grads(fn, hidden, unembedding, mask)
    with jax.set_mesh(mesh):
        got = _value_and_grads(fn, hidden, unembedding, mask)
        program = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(hidden, unembedding, mask).as_text()
    assert "shard_map" in program or "custom_call" in program or "sdy.manual_computation" in program
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_the_platform_chooses_the_fused_kernel_on_tpu_only():
    assert choose_loss_impl("auto", "tpu") == "fused"
    assert choose_loss_impl("auto", "cpu") == choose_loss_impl("auto", "gpu") == "chunked"
    assert choose_loss_impl(mesh=FakeMesh("tpu")) == "fused" and choose_loss_impl(mesh=FakeMesh("cpu")) == "chunked"
    assert choose_loss_impl("fused", "cpu") == "fused" and set(LOSS_IMPLS) == {"auto", "chunked", "fused"}
    with pytest.raises(ValueError):
        choose_loss_impl("flash")


def test_default_tiles_fit_the_vmem_budget_and_shrink_to_the_input():
    limit = fused_ce.V5P_VMEM * 3 // 4
    blocks = []
    for d in (576, 672, 1280, 1792, 2304, 2520):
        t = fused_ce.default_tiles(d)  # bf16 on v5p
        resident = d * t.bwd_vocab * 6 + t.bwd_tokens * d * 32 + t.bwd_tokens * t.bwd_sub * 24
        assert resident <= limit and t.bwd_vocab >= 2048 and t.bwd_vocab % t.bwd_sub == 0
        blocks.append(t.bwd_vocab)
    assert blocks == sorted(blocks, reverse=True) and blocks[1] == 8192  # d 672: 8 blocks of 65,536
    assert fused_ce.default_tiles(672, vmem_bytes=128 * 2**20).bwd_vocab == 16384  # v5e, v6e
    t = fused_ce.fit_tiles(37, 50, 16)
    assert (t.fwd_tokens, t.fwd_vocab, t.bwd_tokens, t.bwd_vocab, t.bwd_sub) == (40, 128, 40, 128, 128)
    t = fused_ce.fit_tiles(1000, 300, 16, fused_ce.Tiles(bwd_vocab=1024, bwd_sub=256))
    assert (t.bwd_vocab, t.bwd_sub) == (512, 256)  # shrunk to the rounded vocabulary, whole sub-tiles
    traffic = fused_ce.traffic_bytes(16384, 672, 65536, 2)
    assert traffic["forward"] < 0.8e9 and traffic["backward"] < 1.2e9  # vs 4.3 GB of f32 logits


# ---- real TPU compilation (ahead of time, on this CPU) -------------------------------------------------

@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v5e:2x2"])
def test_fused_loss_compiles_for_tpu_without_a_logits_buffer(topology):
    from smelt_jax.compile import aot

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(f"TPU compilation unavailable: {reason}")
    b, s, d, v = 2, 1000, 256, 5000  # tokens and vocabulary divide no tile
    mesh = jax.sharding.Mesh(np.array(aot.tpu_topology(topology).devices[:1]), ("x",))

    def loss_and_grads(hidden, unembedding, targets, mask):
        fn = lambda h, u: unembed_cross_entropy(h, u, targets, mask, z_loss=1e-4,  # noqa: E731  (auto)
                                                tiles=fused_ce.Tiles(bwd_vocab=1024))[0]
        return jax.value_and_grad(fn, argnums=(0, 1))(hidden, unembedding)

    args = [jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.float32)]
    compiled, summary = aot.compile_for_tpu(loss_and_grads, args, mesh)
    text = compiled.as_text()
    # forward, the backward's first vocabulary group and the loop's body (the other 4 of 5 tiles)
    assert text.count('custom_call_target="tpu_custom_call"') == 3
    logits_like = [m for m in re.findall(r"f32\[([\d,]+)\]", text)
                   if np.prod([int(x) for x in m.split(",")]) >= b * s * v // 4]
    assert not logits_like, logits_like  # no float32 buffer of even a quarter of the logits
    assert summary.temp_bytes < b * s * v * 4 // 2  # the f32 logits alone would be twice the temporaries


@pytest.mark.tpu
def test_fused_loss_compiles_in_its_shard_map_on_a_four_chip_mesh():
    """Mosaic kernels are not partitioned by GSPMD: under a mesh the loss runs them in a shard_map
    (batch over fsdp x expert here; d(unembedding) reduce-scattered over fsdp)."""
    from smelt_jax.compile import aot

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(f"TPU compilation unavailable: {reason}")
    devices = np.array(aot.tpu_topology("v5p:2x2x1").devices).reshape(1, 2, 2, 1)
    mesh = jax.sharding.Mesh(devices, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    P = jax.sharding.PartitionSpec
    b, s, d, v = 8, 512, 128, 3000
    sharding = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
    args = [jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16, sharding=sharding(("fsdp", "expert"))),
            jax.ShapeDtypeStruct((d, v), jnp.float32, sharding=sharding("fsdp")),
            jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sharding(("fsdp", "expert"))),
            jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=sharding(("fsdp", "expert")))]

    def loss_and_grads(hidden, unembedding, targets, mask):
        fn = lambda h, u: unembed_cross_entropy(h, u, targets, mask)[0]  # noqa: E731
        return jax.value_and_grad(fn, argnums=(0, 1))(hidden, unembedding)

    compiled, _ = aot.compile_for_tpu(loss_and_grads, args, mesh)
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 2  # one vocabulary group: no loop
    assert "reduce-scatter" in text  # d(unembedding) over fsdp


@pytest.mark.tpu
@pytest.mark.integration
def test_at_the_100m_shapes_the_fused_loss_walks_a_tenth_of_the_chunked_loss_bytes():
    """docs/kernels.md's numbers: loss forward+backward alone, one v5p chip, smelt16 100M per-device
    shapes (4 x 4096 tokens, d 672, vocabulary 65,536); HBM bytes walked from the compiled HLO."""
    from smelt_jax.compile import aot
    from smelt_jax.compile.hbm_traffic import hbm_bytes

    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(f"TPU compilation unavailable: {reason}")
    b, s, d, v = 4, 4096, 672, 65536
    devices = np.array(aot.tpu_topology("v5p:2x2x1").devices[:1]).reshape(1, 1, 1, 1)
    mesh = jax.sharding.Mesh(devices, MESH_AXES)
    args = [jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.float32)]
    walked = {}
    for impl in ("chunked", "fused"):
        def loss_and_grads(hidden, unembedding, targets, mask, impl=impl):
            fn = lambda h, u: unembed_cross_entropy(h, u, targets, mask, impl=impl)[0]  # noqa: E731
            return jax.value_and_grad(fn, argnums=(0, 1))(hidden, unembedding)

        compiled, summary = aot.compile_for_tpu(loss_and_grads, args, mesh)
        walked[impl] = hbm_bytes(compiled.as_text()).total
        print(f"{impl}: walked {walked[impl] / 1e9:.2f} GB, temporaries {summary.temp_bytes / 2**20:.0f} MiB")
    assert walked["chunked"] > 20e9  # its f32 logit chunks written and re-read (issue 50: 26 GB)
    assert walked["fused"] < walked["chunked"] / 10 and walked["fused"] < 3e9

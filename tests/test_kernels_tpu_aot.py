"""Real Mosaic compilation of the Pallas expert kernels for TPU topologies, ahead of time on this CPU.

Each test traces inside `jax.set_mesh` over one compile-only TPU device and compiles with the TPU compiler
(interpret=False), forward and backward. Skips only when libtpu cannot be loaded (the reason is printed).
Fast set: forward+backward of the whole expert FFN (all five kernels) per generation in bf16; the f32 and
per-kernel variants are marked slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.compile import aot
from smelt_jax.kernels import splash
from smelt_jax.kernels.backend import pallas_interpret
from smelt_jax.kernels.gmm import gmm, tgmm
from smelt_jax.kernels.pallas_ffn import pallas_expert_ffn

pytestmark = pytest.mark.tpu  # every test here compiles for TPU; all but the splash one in the integration tier

TOPOLOGIES = ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"]
M, D, F, E = 512, 256, 384, 4
TILING = (128, 128, 128)


@pytest.fixture(scope="module", autouse=True)
def _need_libtpu():
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(f"TPU compilation unavailable: {reason}")


def _one_device_mesh(topology):
    # Mosaic kernels are not auto-partitioned: compile for one chip (the model wraps them in shard_map).
    return jax.sharding.Mesh(np.array(aot.tpu_topology(topology).devices[:1]), ("x",))


def _ffn_args(dtype):
    return [jax.ShapeDtypeStruct((M, D), dtype), jax.ShapeDtypeStruct((E, D, F), dtype),
            jax.ShapeDtypeStruct((E, D, F), dtype), jax.ShapeDtypeStruct((E, F, D), dtype),
            jax.ShapeDtypeStruct((E,), jnp.int32)]


def _ffn_forward(x, w_gate, w_up, w_down, sizes):
    return pallas_expert_ffn(x, w_gate, w_up, w_down, sizes, tiling=TILING)  # interpret=None -> Mosaic


def _ffn_backward(x, w_gate, w_up, w_down, sizes):
    def loss(x, w_gate, w_up, w_down):
        return jnp.sum(_ffn_forward(x, w_gate, w_up, w_down, sizes).astype(jnp.float32) ** 2)

    return jax.grad(loss, (0, 1, 2, 3))(x, w_gate, w_up, w_down)


def _num_mosaic_kernels(compiled):
    return compiled.as_text().count('custom_call_target="tpu_custom_call"')


def _compile_ffn(topology, dtype):
    mesh = _one_device_mesh(topology)
    forward, forward_summary = aot.compile_for_tpu(_ffn_forward, _ffn_args(dtype), mesh)
    backward, backward_summary = aot.compile_for_tpu(_ffn_backward, _ffn_args(dtype), mesh)
    # forward: fused SwiGLU + down gmm; backward adds swiglu-grad, dx, dW (x2 kernels each side) on top.
    assert _num_mosaic_kernels(forward) == 2
    assert _num_mosaic_kernels(backward) == 7  # forward 2 + swiglu grads 3 + gmm grads 2
    expected_flops = 2 * M * D * F * 3  # gate, up, down
    assert forward_summary.flops >= expected_flops
    assert backward_summary.flops >= 3 * expected_flops
    print(f"{topology} {jnp.dtype(dtype).name}: forward {forward_summary.compile_seconds:.2f}s, "
          f"backward {backward_summary.compile_seconds:.2f}s")


@pytest.mark.integration
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_expert_ffn_compiles_forward_and_backward_bf16(topology):
    _compile_ffn(topology, jnp.bfloat16)


@pytest.mark.integration
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_expert_ffn_with_row_weights_compiles_with_lane_dense_weights(topology):
    """The router weight applied in the down kernel's epilogue and its gradient taken in the backward
    compile to the same seven Mosaic kernels, the weights and their gradient passing as lane-dense [M]
    rows (an [M, 1] array would be laid out with its one lane padded to 128: 128x its bytes; a [tiles, M]
    block of one row breaks Mosaic's 8-sublane rule)."""
    mesh = _one_device_mesh(topology)
    args = _ffn_args(jnp.bfloat16) + [jax.ShapeDtypeStruct((M,), jnp.float32)]

    def backward(x, w_gate, w_up, w_down, sizes, weight):
        def loss(x, w_gate, w_up, w_down, weight):
            out = pallas_expert_ffn(x, w_gate, w_up, w_down, sizes, row_weight=weight, tiling=TILING)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, (0, 1, 2, 3, 4))(x, w_gate, w_up, w_down, weight)

    compiled, _ = aot.compile_for_tpu(backward, args, mesh)
    text = compiled.as_text()
    assert _num_mosaic_kernels(compiled) == 7
    # the weight gradient: one lane-dense f32 row of M per n tile of the d-lhs kernel (F / 128 of them)
    assert f"f32[{M},1]" not in text and f"f32[{F // TILING[2] * M}]" in text


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_expert_ffn_compiles_forward_and_backward_f32(topology):
    _compile_ffn(topology, jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_gmm_and_tgmm_compile(topology, dtype):
    mesh = _one_device_mesh(topology)
    args = [jax.ShapeDtypeStruct((M, D), dtype), jax.ShapeDtypeStruct((E, D, F), dtype),
            jax.ShapeDtypeStruct((E,), jnp.int32)]

    def gmm_grads(lhs, rhs, sizes):
        return jax.grad(lambda a, b: jnp.sum(gmm(a, b, sizes, tiling=TILING).astype(jnp.float32)), (0, 1))(lhs, rhs)

    compiled, _ = aot.compile_for_tpu(gmm_grads, args, mesh)
    assert _num_mosaic_kernels(compiled) == 2
    tgmm_args = [jax.ShapeDtypeStruct((M, D), dtype), jax.ShapeDtypeStruct((M, F), dtype),
                 jax.ShapeDtypeStruct((E,), jnp.int32)]
    compiled, _ = aot.compile_for_tpu(lambda a, g, s: tgmm(a, g, s, tiling=TILING), tgmm_args, mesh)
    assert _num_mosaic_kernels(compiled) == 1


@pytest.mark.slow  # about 13 s
def test_default_tiling_compiles_on_v6e():
    # The per-generation default tiles (large ones on v6e) must fit VMEM; shapes big enough to use them.
    mesh = _one_device_mesh("v6e:2x2")
    args = [jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((E, 1024, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((E, 1024, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((E, 2048, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((E,), jnp.int32)]

    def backward(x, w_gate, w_up, w_down, sizes):
        loss = lambda *w: jnp.sum(pallas_expert_ffn(*w, sizes).astype(jnp.float32))
        return jax.grad(loss, (0, 1, 2, 3))(x, w_gate, w_up, w_down)

    compiled, _ = aot.compile_for_tpu(backward, args, mesh)
    assert _num_mosaic_kernels(compiled) >= 6


@pytest.mark.integration
def test_interpret_none_means_mosaic_only_inside_a_tpu_mesh():
    assert jax.default_backend() == "cpu"  # the host of an ahead-of-time compile
    assert pallas_interpret(None) is True
    mesh = _one_device_mesh("v5e:2x2")
    with jax.set_mesh(mesh):
        assert pallas_interpret(None) is False
        assert pallas_interpret(True) is True  # an explicit choice stands
    assert pallas_interpret(None) is True


def test_splash_compiles_to_mosaic_ahead_of_time_for_v5p():  # the fast tier's one TPU compile (~5 s)
    """Splash forward + backward compiled for a v5p chip from this CPU: two Mosaic custom calls (the
    forward and the fused backward) and no Pallas interpret-mode loop (interpret mode lowers the kernel's
    grid to `while` loops; this program has no other loop). Names such as "splash_mha_fwd" are in the
    HLO metadata either way, so the test counts custom calls."""
    b, s, heads, kv_heads, hd = 1, 512, 2, 1, 128
    q = jax.ShapeDtypeStruct((b, s, heads, hd), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, kv_heads, hd), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def loss_grads(q, k, v, seg):
        loss = lambda q, k, v: jnp.sum(splash.splash_attention(q, k, v, seg).astype(jnp.float32) ** 2)
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    compiled, _ = aot.compile_for_tpu(loss_grads, [q, kv, kv, segments], _one_device_mesh("v5p:2x2x1"))
    text = compiled.as_text()
    assert _num_mosaic_kernels(compiled) == 2
    assert " while(" not in text


@pytest.mark.slow  # about 45 s: Mosaic lowers the whole 2048^3 block matmul before running out of VMEM
def test_oversized_tiles_are_reported_as_out_of_memory():
    mesh = _one_device_mesh("v5e:2x2")
    big = 2048  # f32 blocks of 16 MiB, double buffered, plus the accumulator: ~112 MiB > the 96 MiB limit
    args = [jax.ShapeDtypeStruct((big, big), jnp.float32), jax.ShapeDtypeStruct((1, big, big), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.int32)]
    with pytest.raises(aot.TpuOutOfMemory):
        aot.compile_for_tpu(lambda a, b, s: gmm(a, b, s, tiling=(big, big, big)), args, mesh)

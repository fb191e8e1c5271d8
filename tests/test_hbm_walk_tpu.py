"""The HBM walk against XLA's own `cost_analysis()["bytes accessed"]` on loop-free programs compiled ahead of
time for one v5p chip (skips, saying why, when libtpu cannot be loaded).

XLA:TPU's count charges every instruction's operands and results, padded to whole tiles, in every
memory space. Where no buffer lands in on-chip memory the walk equals it exactly; where the compiler
prefetches an operand into VMEM (`copy-start` / `copy-done` to `S(1)`), XLA counts the copy pair's operand
and result at both the start and the done, and the consumer's read of the VMEM copy (4 x the prefetched
bytes, plus ~4 KiB for the pair's context buffer); the walk charges the HBM read once. Gathers: XLA charges
the whole table, the walk the rows gathered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from smelt_jax.compile import aot
from smelt_jax.compile.hbm_traffic import hbm_bytes, walk
from smelt_jax.compile.hlo_layout import hbm_shape_bytes

pytestmark = [pytest.mark.tpu, pytest.mark.integration]
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


@pytest.fixture(scope="module")
def mesh():
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(f"TPU compilation unavailable: {reason}")
    return jax.sharding.Mesh(np.array(aot.tpu_topology("v5p:2x2x1").devices[:1]), ("x",))


def _compiled(mesh, fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P())) for shape, dtype in shapes]
    compiled, summary = aot.compile_for_tpu(fn, args, mesh)
    return compiled.as_text(), summary.bytes_accessed


@pytest.mark.parametrize("fn, shapes", [
    (lambda a, b: a + b, [((1024, 512), f32), ((1024, 512), f32)]),
    (lambda a, b: a * b, [((1000, 500), f32), ((1000, 500), f32)]),  # padded to 1000 x 512: both agree
    (lambda a: jnp.sum(jnp.exp(a), axis=1), [((1024, 512), f32)]),
    (lambda x: (x.T + 1).astype(bf16), [((1024, 768), f32)]),
], ids=["add", "odd-shapes-padded", "reduce", "transpose-convert"])
def test_walk_equals_xla_bytes_without_on_chip_buffers(mesh, fn, shapes):
    text, xla = _compiled(mesh, fn, *shapes)
    assert "S(1)" not in text
    assert hbm_bytes(text).total == pytest.approx(xla, rel=1e-6)


@pytest.mark.parametrize("fn, shapes", [
    (lambda a, b: a @ b, [((1024, 1024), f32), ((1024, 1024), f32)]),
    (lambda a, b: a @ b, [((2048, 2048), bf16), ((2048, 2048), bf16)]),
    (lambda a, b: a @ b, [((128, 128), f32), ((128, 128), f32)]),
], ids=["f32-1024", "bf16-2048", "f32-128"])
def test_walk_is_xla_bytes_less_the_vmem_side_of_a_prefetch(mesh, fn, shapes):
    text, xla = _compiled(mesh, fn, *shapes)
    charges = walk(text)
    prefetched = sum(c.bytes for c in charges if c.op == "copy-start")
    assert prefetched > 0  # the compiler prefetched an operand into VMEM
    assert all(hbm_shape_bytes(c.shape) > 0 for c in charges if c.op == "fusion")
    walked = hbm_bytes(text).total
    # XLA also counts the pair's context buffer (u32 in S(2)) and a few tiles of bookkeeping: ~4 KiB
    assert xla - walked == pytest.approx(4 * prefetched, abs=8192)


def test_a_gather_is_charged_its_rows_not_the_table(mesh):
    text, xla = _compiled(mesh, lambda t, i: jnp.take(t, i, axis=0), ((4096, 256), f32), ((512,), i32))
    gathers = [c for c in walk(text) if "gather" in c.name]
    assert gathers and all(c.bytes <= 2 * 512 * 256 * 4 + 512 * 4 for c in gathers)
    assert hbm_bytes(text).total < xla

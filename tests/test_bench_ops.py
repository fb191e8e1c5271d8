"""The op-kind profile of benchmarks/bench_ops.py reads the compiled program: each traced thunk of a small
jitted function lands in the kind and named scope its HLO says (a matmul, a sort, a gather, elementwise)."""

import jax
import jax.numpy as jnp

from benchmarks import bench_ops


def _f(a, b, idx):
    with jax.named_scope("attention"):
        m = a @ b
    with jax.named_scope("moe"):
        s = jnp.sort(m, axis=-1)
    g = jnp.take(s, idx, axis=0)
    return jnp.tanh(g) * 3.0


def test_profile_splits_a_small_program_by_kind_and_scope():
    args = (jnp.ones((256, 256)), jnp.ones((256, 256)), jnp.arange(0, 256, 3))
    prof = bench_ops.profile(jax.jit(_f), *args, calls=2)
    assert prof.wall_ms > 0
    kinds = {(kind, part) for _, kind, part, ms in prof.top if ms > 0}
    assert ("matmul", "attention") in kinds
    assert ("sort", "MoE dispatch / combine") in kinds
    assert prof.by_kind["matmul"] > 0 and prof.by_kind["sort"] > 0
    total = sum(prof.by_kind.values())
    assert abs(sum(sum(k.values()) for k in prof.by_part.values()) - total) < 1e-6


def test_kind_of_reads_fusion_bodies():
    text = jax.jit(_f).lower(jnp.ones((8, 8)), jnp.ones((8, 8)), jnp.arange(3)).compile().as_text()
    instructions, computations = bench_ops.parse_hlo(text)
    kinds = {bench_ops.kind_of(i, computations) for i in instructions.values()
             if i.opcode not in bench_ops.CONTAINERS}
    assert {"matmul", "sort"} <= kinds
    assert bench_ops.part_of("jit(f)/transpose(jvp(moe))/experts/dot_general") == "expert FFN"
    assert bench_ops.part_of("jit(f)/add") == "other"

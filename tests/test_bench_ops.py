"""The op-kind profile of benchmarks/bench_ops.py reads the compiled program: each traced thunk of a small
jitted function lands in the kind and named scope its HLO says (a matmul, a sort, a gather, elementwise)."""

import functools

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


def _looped(x, n):
    with jax.named_scope("router"):
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ x) + i, x)


def test_thunks_count_each_trip_of_a_loop_body():
    """A loop body's thunks are counted once per trip, under its scope: twice the trips, more thunks."""
    x = jnp.eye(64) * 0.5
    counts = {}
    for n in (4, 8):
        prof = bench_ops.profile(jax.jit(functools.partial(_looped, n=n)), x, calls=2)
        counts[n] = prof.thunks.get("router", 0)
        assert f"{sum(prof.thunks.values()):,.0f} thunks executed a call" in bench_ops.table(prof, "t")
    assert counts[4] >= 4  # at least one thunk a trip
    assert counts[8] - counts[4] >= 4  # four more trips, at least four more thunks

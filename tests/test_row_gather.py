"""The expert exchange's row movements (model/row_gather.py, model/exchange_pass.py): the custom VJPs
(gathers both ways) equal JAX's own differentiation of the same gathers; the receiver's arithmetic
inverse equals the inverse of its positions; the send layout's counts equal a bincount."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.model.exchange_pass import (pass_cell, pass_source, receiver_positions, receiver_sources,
                                           send_layout)
from smelt_jax.model.row_gather import combine_rows, gather_sent_rows, permute_rows


def _plain(x, index):
    """The same gather without a custom VJP (JAX differentiates it into a scatter-add)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _placement(seed, tokens=13, top_k=3, n=4, width=6, experts_local=2):
    """A random routing's first pass: (source [n * width], cell [T, k]) from the real layout code."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, n * experts_local)), axis=1)[:, :top_k]
    kept = rng.random((tokens, top_k)) < 0.8  # some copies dropped
    lay = send_layout(jnp.asarray(ids), jnp.asarray(kept), experts_local, n)
    expected = np.bincount(ids[kept], minlength=n * experts_local).reshape(n, experts_local)
    np.testing.assert_array_equal(np.asarray(lay.counts), expected)  # the searchsorted counts
    return lay, pass_source(lay, 0, width), pass_cell(lay, 0, width, top_k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_send_and_combine_gathers_equal_autodiff_of_plain_gathers(seed):
    tokens, top_k, d = 13, 3, 5
    lay, source, cell = _placement(seed, tokens, top_k)
    rng = np.random.default_rng(seed + 10)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    m = source.shape[0]
    cot = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    # every sent row's copy sits in that row, and the layout's counts are a bincount of the kept ids
    filled = np.asarray(source) < tokens * top_k
    np.testing.assert_array_equal(np.asarray(cell).reshape(-1)[np.asarray(source)[filled]],
                                  np.arange(m)[filled])
    assert filled.sum() == int(jnp.sum(jnp.minimum(lay.fill, 6)))  # each block's first `width` rows

    def custom(x, weights):
        rows = gather_sent_rows(x, source, cell, top_k) * 1.5  # stand-in for the experts
        return jnp.sum(combine_rows(rows, weights, cell, source) * cot)

    def plain(x, weights):
        rows = _plain(x, source // top_k) * 1.5
        picked = _plain(rows, cell.reshape(-1)).reshape(tokens, top_k, d)
        return jnp.sum(jnp.einsum("tkd,tk->td", picked, weights) * cot)

    got = jax.value_and_grad(custom, (0, 1))(x, weights)
    want = jax.value_and_grad(plain, (0, 1))(x, weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_combine_keeps_bf16_rows_and_accumulates_in_float32():
    y = jnp.full((4, 2), 1 + 2**-7, jnp.bfloat16)  # bf16 can hold it; a bf16 sum of 3 of them cannot
    cell = jnp.array([[0, 1, 2], [3, 4, 4]], jnp.int32)  # row 4: not in the buffer (0)
    source = jnp.array([0, 1, 2, 3], jnp.int32)
    out = combine_rows(y, jnp.ones((2, 3), jnp.float32), cell, source)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), [[3 * (1 + 2**-7)] * 2, [1 + 2**-7] * 2])
    dy = jax.grad(lambda y: jnp.sum(combine_rows(y, jnp.ones((2, 3)), cell, source)))(y)
    assert dy.dtype == jnp.bfloat16


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_receiver_sources_invert_the_positions(seed):
    rng = np.random.default_rng(seed)
    n, experts_local, width = 4, 3, 7
    counts = rng.multinomial(rng.integers(0, width + 1), np.ones(experts_local) / experts_local, size=n)
    counts[rng.integers(n)] = 0  # an empty block
    recv = jnp.asarray(counts, jnp.int32)
    position, group_sizes = receiver_positions(recv, width)
    source = receiver_sources(recv, width)
    m, total = n * width, int(counts.sum())
    filled = np.asarray(position) < m
    assert filled.sum() == total
    np.testing.assert_array_equal(np.asarray(source)[np.asarray(position)[filled]], np.arange(m)[filled])
    assert (np.asarray(source)[total:] == m).all()
    # permute_rows there and back is the identity on the filled rows, and its VJP a gather too
    x = jnp.asarray(rng.normal(size=(m, 2)), jnp.float32)
    there = permute_rows(x, source, position)
    back = permute_rows(there, position, source)
    np.testing.assert_array_equal(np.asarray(back)[filled], np.asarray(x)[filled])
    cot = jnp.asarray(rng.normal(size=(m, 2)), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(permute_rows(x, source, position) * cot))(x)
    g_plain = jax.grad(lambda x: jnp.sum(_plain(x, source) * cot))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_plain))

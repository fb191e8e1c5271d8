"""The fused chunked unembedding + cross-entropy against the unfused definition: loss and gradients (hidden,
unembedding, mask), both matmul forms, chunks that do and do not divide the sequence, float32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.kernels.backend import UNEMBEDDING_FORMS, choose_unembedding_form
from smelt_jax.model.loss import LOGITS_PER_ROW_CHUNK, cross_entropy, seq_chunk, unembed_cross_entropy
from tests.platform_fakes import FakeMesh

B, S, D, V = 3, 37, 16, 50  # S = 37: no chunk below divides it


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k[0], (B, S, D))
    unembedding = jax.random.normal(k[1], (D, V)) / np.sqrt(D)
    targets = jax.random.randint(k[2], (B, S), 0, V)
    mask = (jax.random.uniform(k[3], (B, S)) > 0.2).astype(jnp.float32)
    return hidden, unembedding, targets, mask


def _reference(hidden, unembedding, targets, mask):
    logits = jnp.einsum("bsd,dv->bsv", hidden, unembedding.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    return cross_entropy(logits, targets, mask)[0]


def _naive(hidden, unembedding, targets, mask):
    """float64 numpy: sum over masked tokens of logsumexp(logits) - logits[target]."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(unembedding, np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    target = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    return float(((log_z - target) * np.asarray(mask)).sum())


@pytest.mark.parametrize("form", UNEMBEDDING_FORMS)
@pytest.mark.parametrize("chunk", [8, 16, 37, None])
def test_chunked_loss_and_gradients_match_the_unfused_reference(form, chunk):
    hidden, unembedding, targets, mask = _inputs()
    got_loss, count = unembed_cross_entropy(hidden, unembedding, targets, mask, chunk=chunk, form=form)
    assert float(count) == float(mask.sum())
    np.testing.assert_allclose(float(got_loss), _naive(hidden, unembedding, targets, mask), rtol=1e-5)
    fused = lambda h, u, m: unembed_cross_entropy(h, u, targets, m, chunk=chunk, form=form)[0]  # noqa: E731
    ref = lambda h, u, m: _reference(h, u, targets, m)  # noqa: E731
    got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(hidden, unembedding, mask)
    want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2)))(hidden, unembedding, mask)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for name, g, w in zip(("hidden", "unembedding", "mask"), got[1], want[1]):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)


def test_bf16_hidden_with_float32_unembedding_matches_within_bf16_tolerance():
    hidden, unembedding, targets, mask = _inputs(seed=1)
    hidden = hidden.astype(jnp.bfloat16)
    fused = lambda h, u: unembed_cross_entropy(h, u, targets, mask, chunk=16)[0]  # noqa: E731
    assert_bf16_loss_matches(fused, lambda h, u: _reference(h, u, targets, mask), hidden, unembedding)


def assert_bf16_loss_matches(loss, reference, hidden, unembedding):
    """`loss` and its gradients at bf16 hidden states against the f32 `reference`, within bf16 tolerance
    (shared with tests/test_fused_ce.py)."""
    (got_loss, got), (want_loss, want) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, unembedding)
                                          for f in (loss, reference))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-3)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for g, w in zip(got, want):
        scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w, np.float32) / scale,
                                   atol=2e-2)


def test_the_two_forms_agree_on_cpu_and_cpu_chooses_the_2d_form():
    hidden, unembedding, targets, mask = _inputs(seed=2)
    grads = {form: jax.grad(lambda h, u, f=form: unembed_cross_entropy(h, u, targets, mask, form=f)[0],
                            argnums=(0, 1))(hidden, unembedding) for form in UNEMBEDDING_FORMS}
    for a, b in zip(grads["einsum"], grads["matmul"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert choose_unembedding_form("cpu") == "matmul"
    assert choose_unembedding_form("tpu") == choose_unembedding_form("gpu") == "einsum"


def test_the_form_follows_the_traced_mesh_platform_not_this_machine():
    assert choose_unembedding_form(mesh=FakeMesh("tpu")) == "einsum"
    assert choose_unembedding_form(mesh=FakeMesh("cpu")) == "matmul"
    assert choose_unembedding_form("cpu", mesh=FakeMesh("tpu")) == "matmul"  # an explicit platform wins


def test_seq_chunk_bounds_the_logits_per_row():
    assert seq_chunk(4096, 65536) == 256 and 256 * 65536 <= LOGITS_PER_ROW_CHUNK
    assert seq_chunk(256, 512) == 256  # the CPU suites: one chunk, the whole row
    assert seq_chunk(4096, 512) == 4096
    assert seq_chunk(4096, 2**24) == 8  # never below 8 positions
    for seq, vocab in ((4096, 50257), (2048, 32000), (300, 200_000)):
        chunk = seq_chunk(seq, vocab)
        assert chunk <= seq and (chunk * vocab <= LOGITS_PER_ROW_CHUNK or chunk == 8)
        assert chunk == seq or 2 * chunk * vocab > LOGITS_PER_ROW_CHUNK


def test_evaluation_path_without_gradients_gives_the_same_loss():
    hidden, unembedding, targets, mask = _inputs(seed=3)
    plain = jax.jit(lambda h, u: unembed_cross_entropy(h, u, targets, mask, chunk=8)[0])(hidden, unembedding)
    np.testing.assert_allclose(float(plain), _naive(hidden, unembedding, targets, mask), rtol=1e-5)

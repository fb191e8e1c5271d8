"""The decoder: parameter count, loop semantics, document isolation, captures, remat."""

import itertools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.design import budget
from smelt_jax.design.config import ModelConfig
from smelt_jax.model import Decoder, Layer

TINY = ModelConfig(vocab=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                   n_experts=8, top_k=2, expert_ffn=32, loop_start=1, loop_length=2,
                   loop_repeats=2, seq_len=64)
BASELINE_200M = ModelConfig(vocab=65536, d_model=1280, n_layers=12, n_heads=10, n_kv_heads=2,
                            head_dim=128, n_experts=64, top_k=8, expert_ffn=432)
SMELT_200M = BASELINE_200M.replace(d_model=1056, n_heads=12, n_kv_heads=2, head_dim=88,
                                   n_experts=96, expert_ffn=352, loop_start=3, loop_length=6,
                                   loop_repeats=2)


SEQ = 32


@pytest.fixture(scope="module")
def tiny_model():
    return Decoder(TINY, rngs=nnx.Rngs(0))


def _batch(batch=2, seq=SEQ, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (batch, seq), 0, TINY.vocab, jnp.int32)
    segments = jnp.ones((batch, seq), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return tokens, segments, positions


@nnx.jit(static_argnames="capture")
def _forward(model, tokens, segments, positions, capture=False):
    return model(tokens, segments, positions, capture=capture)


def _param_count(model) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(loop_length=0, loop_repeats=1, loop_start=0),
                                 BASELINE_200M, SMELT_200M], ids=["tiny", "tiny_unlooped",
                                                                  "baseline200m", "smelt200m"])
def test_parameter_count_equals_budget(cfg):
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # nothing allocated
    assert _param_count(abstract) == budget.params_total(cfg) + budget.params_embedding(cfg)


def test_every_parameter_has_logical_names():
    model = nnx.eval_shape(lambda: Decoder(TINY, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    flat = nnx.to_flat_state(specs)
    assert len(flat) > 0
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, spec in flat:
        names = tuple(spec.get_value() if hasattr(spec, "get_value") else spec.value)
        assert len(names) == params[path].ndim and all(isinstance(n, str) for n in names), path
        stacked = path[0] in ("prefix", "loop", "suffix")
        assert (names[0] == "layers") == stacked, (path, names)


def _copy_layers(source_stack, lo, hi):
    return jax.tree.map(lambda a: a[lo:hi], nnx.state(source_stack))


def test_loop_repeats_one_equals_the_unlooped_network():
    plain = Decoder(TINY.replace(loop_start=0, loop_length=0, loop_repeats=1), rngs=nnx.Rngs(0))
    looped_once = Decoder(TINY.replace(loop_repeats=1), rngs=nnx.Rngs(7))
    assert plain.prefix is None and plain.loop is None  # all four layers sit in one stack
    nnx.update(looped_once.prefix, _copy_layers(plain.suffix, 0, 1))
    nnx.update(looped_once.loop, _copy_layers(plain.suffix, 1, 3))
    nnx.update(looped_once.suffix, _copy_layers(plain.suffix, 3, 4))
    nnx.update(looped_once.final_norm, nnx.state(plain.final_norm))
    for name in ("embedding", "unembedding"):
        getattr(looped_once, name).set_value(getattr(plain, name).get_value())
    batch = _batch()
    want, _ = _forward(plain, *batch)
    got, _ = _forward(looped_once, *batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _physical_layer(model, layer_index: int) -> Layer:
    for name in ("prefix", "loop", "suffix"):
        stack = getattr(model, name)
        layers = range(*{"prefix": (0, TINY.loop_start), "loop": (TINY.loop_start, TINY.loop_end),
                         "suffix": (TINY.loop_end, TINY.n_layers)}[name])
        if layer_index in layers:
            graphdef, state = nnx.split(stack)
            j = layer_index - layers.start
            return nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state))
    raise IndexError(layer_index)


@nnx.jit
def _manual_unrolling(model, tokens, segments, positions):
    """Python loop over the execution order, one physical Layer at a time, explicit 1/r."""
    from smelt_jax.model.norm import rms_norm
    from smelt_jax.model.rope import rope_angles
    cos, sin = rope_angles(positions, TINY.head_dim, TINY.rope_theta)
    context = {"cos": cos, "sin": sin, "segment_ids": segments, "token_mask": segments > 0}
    x = model.embedding[...][tokens]
    for layer_index in (0, 1, 2, 1, 2, 3):
        scale = 0.5 if layer_index in (1, 2) else 1.0
        x, *_ = _physical_layer(model, layer_index)(x, context, scale)
    return rms_norm(x, model.final_norm.scale[...], TINY.norm_eps) @ model.unembedding[...]


def test_looped_model_equals_manual_unrolling_with_shared_weights(tiny_model):
    assert TINY.execution_order() == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (3, 0)]
    batch = _batch()
    logits, _ = _forward(tiny_model, *batch)
    manual = _manual_unrolling(tiny_model, *batch)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(manual), rtol=1e-5, atol=1e-5)


def test_documents_in_a_packed_row_do_not_see_each_other(tiny_model):
    model = tiny_model
    tokens, _, _ = _batch()
    lengths = [8, 12, 8, 4]  # three documents, then 4 padding tokens (segment 0)
    segments = jnp.array(np.repeat([1, 2, 3, 0], lengths), jnp.int32)[None].repeat(2, 0)
    positions = jnp.array(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)[None]
    positions = positions.repeat(2, 0)
    before, _ = _forward(model, tokens, segments, positions)
    changed = tokens.at[0, 12].set((tokens[0, 12] + 1) % TINY.vocab)  # inside document 2, row 0
    after, _ = _forward(model, changed, segments, positions)
    before, after = np.asarray(before), np.asarray(after)
    outside = np.r_[0:8, 20:32]
    np.testing.assert_allclose(after[0, outside], before[0, outside], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after[1], before[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after[0, 8:12], before[0, 8:12], rtol=1e-5, atol=1e-5)  # causal
    assert np.max(np.abs(after[0, 12:20] - before[0, 12:20])) > 1e-3  # the edit does matter


def test_captures_are_keyed_by_layer_and_visit_and_add_up(tiny_model):
    model = tiny_model
    batch = _batch()
    logits_plain, aux_plain = _forward(model, *batch)
    logits, aux = _forward(model, *batch, capture=True)
    assert "captures" not in aux_plain
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_plain), rtol=1e-6, atol=1e-6)
    captures = aux["captures"]
    order = TINY.execution_order()
    assert sorted(captures) == sorted(order)
    for this, following in itertools.pairwise(order):
        c = captures[this]
        assert c["topk_ids"].shape == (2, SEQ, TINY.top_k)
        assert c["attn_probs"].shape == (2, TINY.n_heads, SEQ, SEQ)
        np.testing.assert_allclose(np.asarray(c["attn_probs"].sum(-1)), 1.0, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(c["residual"] + c["dx_attn"] + c["dx_moe"]),
                                   np.asarray(captures[following]["residual"]), atol=1e-5)
    # The two visits of a looped layer route independently (different residual streams).
    assert not np.array_equal(np.asarray(captures[(1, 0)]["residual"]),
                              np.asarray(captures[(1, 1)]["residual"]))


def test_aux_losses_and_load_stats(tiny_model):
    _, aux = _forward(tiny_model, *_batch())
    assert aux["load_balance_loss"].shape == () and float(aux["load_balance_loss"]) >= 1.0 - 1e-5
    assert aux["router_z_loss"].shape == () and float(aux["router_z_loss"]) > 0
    load = aux["expert_load"]
    assert load["counts"].shape == (TINY.executed_layers, TINY.n_experts)
    np.testing.assert_allclose(np.asarray(load["counts"].sum(-1)), 2 * SEQ * TINY.top_k)
    assert np.all(np.asarray(load["dropped_fraction"]) == 0)  # dropless by default
    assert np.all(np.asarray(load["max_over_mean"]) >= 1.0)


def _loss_and_grads(model, batch):
    def loss_fn(m):
        logits, aux = m(*batch)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + aux["load_balance_loss"]
    return nnx.jit(nnx.value_and_grad(loss_fn))(model)


def test_remat_does_not_change_gradients_and_the_loop_weights_learn():
    batch = _batch()
    plain = Decoder(TINY, rngs=nnx.Rngs(0))
    remat = Decoder(TINY, rngs=nnx.Rngs(0), remat="full")
    loss_plain, grads_plain = _loss_and_grads(plain, batch)
    loss_remat, grads_remat = _loss_and_grads(remat, batch)
    np.testing.assert_allclose(float(loss_remat), float(loss_plain), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_plain), jax.tree.leaves(grads_remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    assert float(jnp.max(jnp.abs(grads_plain["loop"]["moe"]["w_down"][...]))) > 0


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_and_unrolled_layers_give_the_same_numbers(remat):
    """The two layer loops of kernels/backend.py (scan on TPU/GPU, a Python loop on CPU): same loss,
    aux, gradients and captures, with the loop's shared weights visited twice."""
    batch = _batch()
    models = {}
    for loop in ("scan", "unrolled"):
        models[loop] = Decoder(TINY, rngs=nnx.Rngs(0), remat=remat)
        models[loop].layer_loop = loop
    (loss_s, grads_s), (loss_u, grads_u) = (_loss_and_grads(models[k], batch) for k in ("scan", "unrolled"))
    np.testing.assert_allclose(float(loss_u), float(loss_s), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_u), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    (_, aux_s), (_, aux_u) = (_forward(models[k], *batch, capture=True) for k in ("scan", "unrolled"))
    assert jax.tree.structure(aux_s) == jax.tree.structure(aux_u)
    for a, b in zip(jax.tree.leaves(aux_s), jax.tree.leaves(aux_u), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="layer loop"):
        models["scan"].layer_loop = "while"
        _forward(models["scan"], *batch)


def test_the_layer_loop_is_chosen_by_platform():
    from smelt_jax.kernels.backend import choose_layer_loop
    assert choose_layer_loop("auto", "cpu") == "unrolled"
    assert choose_layer_loop("auto", "tpu") == choose_layer_loop("auto", "cuda") == "scan"
    assert choose_layer_loop("scan", "cpu") == "scan" and choose_layer_loop("unrolled", "tpu") == "unrolled"


def test_bfloat16_compute_tracks_float32(tiny_model):
    batch = _batch()
    bf16 = Decoder(TINY.replace(compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    want, _ = _forward(tiny_model, *batch)
    got, _ = _forward(bf16, *batch)
    assert got.dtype == jnp.float32
    assert bf16.embedding[...].dtype == jnp.float32  # parameters stay float32
    assert float(jnp.max(jnp.abs(got - want))) < 0.05 * float(jnp.max(jnp.abs(want))) + 1e-3


def test_bad_inputs_are_rejected(tiny_model):
    model = tiny_model
    tokens, segments, positions = _batch(seq=8)
    with pytest.raises(ValueError, match="positions shape"):
        model(tokens, segments, positions[:, :4])
    with pytest.raises(ValueError, match="batch, seq"):
        model(tokens[0], segments[0], positions[0])


def _scanned_loss(cfg):
    """(loss of the model's state, that state, the tokens) for `cfg` with scanned layers (TPU's loop)."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    model.layer_loop = "scan"
    graphdef, state = nnx.split(model)
    tokens, segments, positions = _batch()

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, segments, positions)
        return jnp.mean(logits.astype(jnp.float32) ** 2)

    return loss, state, tokens


def test_the_loop_visits_do_not_stack_saved_activations_twice():
    """With scanned layers (TPU's choice) the compiled gradient of a looped model holds each visit's own
    layer scan: no array shaped [visits, looped layers, ...] (a residual stack filled from a per-visit
    stack, every saved activation written and read twice), while each [layers, ...] stack is there."""
    cfg = TINY.replace(loop_start=1, loop_length=3, loop_repeats=2, n_layers=5)
    loss, state, tokens = _scanned_loss(cfg)
    hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    t, d = tokens.size, cfg.d_model
    stacked_twice = re.findall(rf"\[{cfg.loop_repeats},{cfg.loop_length},[0-9,]*\]", hlo)
    assert not [s for s in stacked_twice if s.count(",") >= 3], sorted(set(stacked_twice))[:5]
    per_visit = re.findall(rf"\[{cfg.loop_length},(?:{t},{d}|2,{SEQ},{d})\]", hlo)
    assert per_visit  # the layer scan's own residual stacks


def test_scan_peels_make_every_scan_length_distinct():
    from smelt_jax.model.layer import distinct_scan_lengths
    # smelt16's SMELT stacks (prefix, visit, visit, suffix): 100M, 200M, 600M, 1.6B
    assert distinct_scan_lengths([2, 5, 5, 3]) == [0, 0, 1, 0]
    assert distinct_scan_lengths([3, 6, 6, 3]) == [0, 0, 1, 1]
    assert distinct_scan_lengths([5, 10, 10, 5]) == [0, 0, 1, 1]
    assert distinct_scan_lengths([7, 15, 15, 8]) == [0, 0, 1, 0]
    assert distinct_scan_lengths([12]) == [0]  # a Baseline: one scan, nothing peeled
    assert distinct_scan_lengths([4, 4, 4, 4]) == [0, 1, 2, 3]
    assert distinct_scan_lengths([2, 2, 2]) == [0, 1, 1]  # stops at a length-1 remainder


def _layer_scan_lengths(jaxpr, carry_shape) -> list[int]:
    """Lengths of the scans in a jaxpr (at any depth) that carry an array of `carry_shape`: the layer
    stacks, which carry the residual stream [b, s, d], not the scans inside a layer."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            first = eqn.params["num_consts"]
            carries = eqn.invars[first:first + eqn.params["num_carry"]]
            if any(tuple(v.aval.shape) == carry_shape for v in carries):
                found.append(eqn.params["length"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _layer_scan_lengths(sub, carry_shape)
    return found


def test_the_training_step_of_a_looped_model_has_no_two_scans_of_one_length():
    """XLA:TPU zero-fills the stacked outputs of scans of equal length (their fills merge; the
    integration tier reads the TPU program), so a looped model's visits get distinct scan lengths by
    running leading layers outside the scan, with the same numbers (the scanned/unrolled test above)."""
    cfg = TINY.replace(loop_start=2, loop_length=3, loop_repeats=3, n_layers=7)  # scans 2, 3, 3, 3, 2
    loss, state, tokens = _scanned_loss(cfg)

    stream = (tokens.shape[0], tokens.shape[1], cfg.d_model)
    forward = [n for n in _layer_scan_lengths(jax.make_jaxpr(loss)(state).jaxpr, stream) if n > 1]
    # prefix 2 and the first visit 3 scanned; the later visits and the suffix peeled down to length 1
    assert sorted(forward) == [2, 3]
    backward = [n for n in _layer_scan_lengths(jax.make_jaxpr(jax.grad(loss))(state).jaxpr, stream) if n > 1]
    assert sorted(backward) == [2, 2, 3, 3], backward  # each scan and its transpose

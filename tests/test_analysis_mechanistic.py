"""Cross-visit analyses on constructed captures: routing overlap, residual writes, attention-stage cosines."""

import numpy as np
import pytest

from smelt_jax.analysis import mechanistic as mech


def random_topk(rng, shape, k, n_experts):
    """Distinct uniform top-k index sets: [*shape, k]."""
    return np.argsort(rng.random((*shape, n_experts)), axis=-1)[..., :k]


def test_topk_intersection_matches_a_set_reference():
    rng = np.random.default_rng(0)
    for k, n in ((1, 3), (8, 16), (8, 8), (4, 200)):
        a, b = random_topk(rng, (5, 7), k, n), random_topk(rng, (5, 7), k, n)
        sizes = mech.topk_intersection_sizes(a, b)
        expected = [[len(set(a[i, j]) & set(b[i, j])) for j in range(7)] for i in range(5)]
        np.testing.assert_array_equal(sizes, expected)
    with pytest.raises(ValueError, match="repeats"):
        mech.topk_intersection_sizes(np.array([[1, 1]]), np.array([[1, 2]]))


def test_routing_overlap_identical_visits_give_k_and_random_routing_gives_k2_over_n():
    rng = np.random.default_rng(1)
    same = random_topk(rng, (2, 16), 8, 16)
    independent = (random_topk(rng, (4, 5000), 8, 64), random_topk(rng, (4, 5000), 8, 64))
    captures = {
        (3, 1): {"topk_ids": same},
        (3, 2): {"topk_ids": same},
        (4, 1): {"topk_ids": independent[0]},
        (4, 2): {"topk_ids": independent[1]},
        (0, 1): {"topk_ids": same},  # outside the loop: visit 1 only, ignored
    }
    table = mech.routing_overlap(captures, n_experts=64).set_index("layer")
    assert list(table.index) == [3, 4]
    assert table.loc[3, "mean_overlap"] == 8.0 and table.loc[3, "overlap_fraction"] == 1.0
    assert table.loc[4, "random_reference"] == pytest.approx(1.0)  # 8^2 / 64
    # hypergeometric sd ~0.88 per token; 20000 tokens -> sd of the mean ~0.006
    assert table.loc[4, "mean_overlap"] == pytest.approx(1.0, abs=0.03)
    assert table.loc[4, "n_tokens"] == 20000
    with pytest.raises(ValueError, match="outside"):
        mech.routing_overlap(captures, n_experts=8)
    with pytest.raises(ValueError, match="looped"):
        mech.routing_overlap({(0, 1): {"topk_ids": same}}, n_experts=16)


def test_residual_write_ratios_and_same_layer_vs_unrelated_cosines():
    rng = np.random.default_rng(2)
    # layer 3 writes in dims 0..3, layer 4 in dims 4..7: unrelated pairs are orthogonal
    base3 = np.concatenate([rng.normal(size=(2, 10, 4)), np.zeros((2, 10, 4))], axis=-1)
    base4 = np.concatenate([np.zeros((2, 10, 4)), rng.normal(size=(2, 10, 4))], axis=-1)
    captures = {}
    for layer, base in ((3, base3), (4, base4)):
        captures[(layer, 1)] = {"dx_attn": base, "dx_moe": base}
        captures[(layer, 2)] = {"dx_attn": 2 * base, "dx_moe": 3 * base}  # dx: 2*base -> 5*base
    ratios = mech.residual_write_ratios(captures).set_index(["layer", "write"])["ratio"]
    for layer in (3, 4):
        assert ratios[(layer, "dx_attn")] == pytest.approx(2.0)
        assert ratios[(layer, "dx_moe")] == pytest.approx(3.0)
        assert ratios[(layer, "dx")] == pytest.approx(2.5)
    cosines = mech.residual_write_cosines(captures)
    assert len(cosines) == 4
    summary = mech.summarize_pairs(cosines).set_index("pair")
    assert summary.loc["same_layer", "mean"] == pytest.approx(1.0)
    assert summary.loc["unrelated", "mean"] == pytest.approx(0.0, abs=1e-12)
    assert summary.loc["unrelated", "count"] == 2
    # a reversed second write gives cosine -1
    captures[(4, 2)] = {"dx_attn": -base4, "dx_moe": -base4}
    same4 = mech.residual_write_cosines(captures).query("layer_visit1 == 4 and layer_visit2 == 4")
    assert same4["mean_cosine"].item() == pytest.approx(-1.0)


def test_rowwise_cosine_matches_a_loop_and_handles_zero_vectors():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
    a[2] = 0.0
    expected = [
        0.0 if not a[i].any() else a[i] @ b[i] / np.linalg.norm(a[i]) / np.linalg.norm(b[i]) for i in range(6)
    ]
    np.testing.assert_allclose(mech.rowwise_cosine(a, b), expected, rtol=1e-12, atol=1e-15)


def test_attention_stage_cosines_identical_visits_and_per_head_definition():
    rng = np.random.default_rng(4)
    shapes = {
        "normed_input": (2, 6, 16),
        "q": (2, 6, 4, 4),
        "k": (2, 6, 2, 4),
        "v": (2, 6, 2, 4),
        "pv": (2, 6, 4, 4),
        "attn_out": (2, 6, 16),
    }
    visit1 = {stage: rng.normal(size=shape) for stage, shape in shapes.items()}
    visit2 = {stage: array.copy() for stage, array in visit1.items()}
    visit2["q"][:, :, 0] *= -1.0  # one of four heads reversed: mean per-head cosine (3 - 1) / 4
    table = mech.attention_stage_cosines({(5, 1): visit1, (5, 2): visit2}).set_index("stage")
    assert list(table.index) == list(mech.ATTENTION_STAGES)
    for stage in ("normed_input", "k", "v", "pv", "attn_out"):
        assert table.loc[stage, "mean_cosine"] == pytest.approx(1.0)
    assert table.loc["q", "mean_cosine"] == pytest.approx(0.5)
    assert table.loc["q", "n_vectors"] == 2 * 6 * 4
    with pytest.raises(ValueError, match="unknown stage"):
        mech.attention_stage_cosines({(5, 1): visit1, (5, 2): visit2}, stages=("logits",))
    with pytest.raises(KeyError, match="lacks 'q'"):
        mech.attention_stage_cosines({(5, 1): {}, (5, 2): visit2}, stages=("q",))

"""Attention analyses on constructed patterns: attended-key overlap, sinks, Gu et al.'s sink rate, the Dyck head."""

import numpy as np
import pytest

from smelt_jax.analysis import attention as attn


def causal_document_uniform(segment_ids):
    """Uniform attention over each query's own document up to itself: [batch, 1, seq, seq]."""
    seq = segment_ids.shape[-1]
    starts = attn.document_starts(segment_ids)
    keys = np.arange(seq)
    allowed = (keys[None, None, :] >= starts[:, :, None]) & (keys[None, None, :] <= keys[None, :, None])
    return (allowed / allowed.sum(-1, keepdims=True))[:, None]


def random_causal_probs(rng, batch, heads, seq):
    logits = rng.normal(size=(batch, heads, seq, seq)) * 3
    logits = np.where(np.tril(np.ones((seq, seq), dtype=bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def test_document_starts_and_positions():
    segments = np.array([[1, 1, 2, 2, 2, 1], [0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(attn.document_starts(segments), [[0, 0, 2, 2, 2, 5], [0] * 6])
    np.testing.assert_array_equal(attn.document_positions(segments), [[1, 2, 1, 2, 3, 1], [1, 2, 3, 4, 5, 6]])


def test_uniform_attention_gives_sink_mass_one_over_position():
    segments = np.array([[5, 5, 5, 5, 7, 7, 7], [3, 3, 3, 3, 3, 3, 3]])
    probs = np.repeat(causal_document_uniform(segments), 2, axis=1)  # 2 identical heads
    mass = attn.first_token_mass(probs, segments)
    np.testing.assert_allclose(
        mass, np.broadcast_to(1.0 / attn.document_positions(segments)[:, None], mass.shape)
    )
    table = attn.attention_sink_mass({(2, 1): {"attn_probs": probs}, (2, 2): {"attn_probs": probs}}, segments)
    expected = np.mean([1 / 2, 1 / 3, 1 / 4, 1 / 2, 1 / 3] + [1 / p for p in range(2, 8)])
    assert len(table) == 4 and set(table["visit"]) == {1, 2}
    np.testing.assert_allclose(table["sink_mass"], expected)
    assert table["n_queries"].iloc[0] == 11
    with_first = attn.attention_sink_mass({(2, 1): {"attn_probs": probs}}, segments, skip_first=False)
    np.testing.assert_allclose(with_first["sink_mass"], np.mean(1.0 / attn.document_positions(segments)))


def test_attended_overlap_matches_a_set_reference_on_random_attention():
    rng = np.random.default_rng(0)
    a, b = random_causal_probs(rng, 1, 3, 20)[0], random_causal_probs(rng, 1, 3, 20)[0]
    overlap, valid = attn.attended_key_overlap(a, b, top=8)
    for h in range(3):
        for q in range(20):
            assert valid[h, q] == (q + 1 >= 8)
            if valid[h, q]:
                top_a, top_b = set(np.argsort(-a[h, q])[:8]), set(np.argsort(-b[h, q])[:8])
                assert overlap[h, q] == len(top_a & top_b) / 8


def test_attended_token_overlap_same_head_vs_control():
    rng = np.random.default_rng(1)
    heads, seq = 4, 40
    probs = np.full((2, heads, seq, seq), 1e-4)
    for h in range(heads):  # head h attends to its own 8 keys, disjoint from the other heads'
        probs[:, h, :, 8 * h : 8 * h + 8] = rng.uniform(1, 2, size=(2, seq, 8))
    probs /= probs.sum(-1, keepdims=True)
    second = probs.copy()
    second[:, 1, :, 8:12] = 1e-5  # head 1 of visit 2 swaps 4 of its 8 keys for head 0's keys 0..3
    second[:, 1, :, 0:4] = 0.2
    table = attn.attended_token_overlap({(3, 1): {"attn_probs": probs}, (3, 2): {"attn_probs": second}})
    same = table[table["pair"] == "same_head"].set_index("head")["mean_overlap"]
    control = table[table["pair"] == "control_head"].set_index("head")
    np.testing.assert_allclose(same.to_numpy(), [1.0, 0.5, 1.0, 1.0])
    assert control["partner_head"].tolist() == [1, 2, 3, 0]
    np.testing.assert_allclose(control["mean_overlap"], [0.5, 0.0, 0.0, 0.0])  # head 0 vs visit-2 head 1
    assert (table["n_queries"] == 2 * seq).all()
    identical = attn.attended_token_overlap({(3, 1): {"attn_probs": probs}, (3, 2): {"attn_probs": probs}})
    assert (identical.query("pair == 'same_head'")["mean_overlap"] == 1.0).all()
    with pytest.raises(ValueError, match="control pairing"):
        attn.attended_token_overlap(
            {(3, 1): {"attn_probs": probs[:, :1]}, (3, 2): {"attn_probs": probs[:, :1]}}
        )


def test_gu_sink_rate_counts_heads_above_threshold():
    seq = 64
    causal = np.tril(np.ones((seq, seq)))

    def head_with_first_token_share(share):
        """`share` on token 1, the rest uniform over keys 2..q; query 1 can only attend to itself."""
        rest = np.where(np.arange(seq) >= 1, causal, 0)
        rest = rest / np.maximum(rest.sum(-1, keepdims=True), 1)
        probs = share * np.eye(seq)[0][None, :] + (1 - share) * rest
        probs[0] = np.eye(seq)[0]
        return probs

    uniform = causal / causal.sum(-1, keepdims=True)
    sinky = np.stack(
        [
            head_with_first_token_share(1.0),
            uniform,
            head_with_first_token_share(0.31),
            head_with_first_token_share(0.25),
        ]
    )
    captures = {(3, 1): {"attn_probs": sinky[None]}, (3, 2): {"attn_probs": np.stack([uniform] * 4)[None]}}
    heads = attn.first_token_attention(captures).query("visit == 1")["first_token_attention"].to_numpy()
    np.testing.assert_allclose(
        heads, [1.0, np.mean(1 / np.arange(1, 65)), (1 + 63 * 0.31) / 64, (1 + 63 * 0.25) / 64]
    )
    rates = attn.gu_sink_rate(captures).set_index("scope")
    assert rates.loc["all", "sink_rate"] == 2 / 8 and rates.loc["all", "n_heads"] == 8
    assert rates.loc["visit 1", "sink_rate"] == 0.5 and rates.loc["visit 2", "sink_rate"] == 0.0
    with pytest.raises(ValueError, match="64-token"):
        attn.gu_sink_rate({(0, 1): {"attn_probs": uniform[None, None, :32, :32]}})


def test_dyck_head_ranking_and_bos_vs_demo_answer_mass():
    ranked = attn.rank_ablated_heads({(3, 0): 2.0, (3, 1): 2.5, (4, 0): 1.9}, baseline_loss=1.8)
    assert ranked.loc[0, ["layer", "head"]].tolist() == [3, 1]
    assert ranked["loss_increase"].tolist() == pytest.approx([0.7, 0.2, 0.1])
    seq = 6
    visit1, visit2 = np.zeros((1, 2, seq, seq)), np.zeros((1, 2, seq, seq))
    visit1[0, 1, :, 0], visit1[0, 1, :, 2], visit1[0, 1, :, 5] = 0.6, 0.3, 0.1  # head 1: BOS-heavy
    visit2[0, 1, :, 0], visit2[0, 1, :, 3], visit2[0, 1, :, 2] = 0.1, 0.5, 0.4  # head 1: reads demo answers
    visit1[0, 0], visit2[0, 0] = np.eye(seq), np.eye(seq)  # head 0: irrelevant
    query = np.zeros((1, seq), bool)
    query[0, 4:] = True
    bos = np.eye(seq, dtype=bool)[None, 0]
    answers = np.zeros((1, seq), bool)
    answers[0, 2:4] = True
    table = attn.dyck_head_attention(
        {(3, 1): {"attn_probs": visit1}, (3, 2): {"attn_probs": visit2}}, 3, 1, query, bos, answers
    )
    table = table.set_index("visit")
    assert table.loc[1, "bos_mass"] == pytest.approx(0.6) and table.loc[
        1, "demo_answer_mass"
    ] == pytest.approx(0.3)
    assert table.loc[2, "bos_mass"] == pytest.approx(0.1) and table.loc[
        2, "demo_answer_mass"
    ] == pytest.approx(0.9)
    assert table.loc[1, "other_mass"] == pytest.approx(0.1) and table.loc[2, "n_queries"] == 2
    with pytest.raises(ValueError, match="overlap"):
        attn.dyck_head_attention({(3, 1): {"attn_probs": visit1}}, 3, 1, query, bos, bos)

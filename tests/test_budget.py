import pytest

from smelt_jax.design import budget as B
from smelt_jax.design.config import ModelConfig

# d=8, 2 heads of 4 (q width 8), 1 KV head of 4, 4 experts of width 6, top-2, 3 layers.
SMALL = ModelConfig(vocab=10, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=4,
                    n_experts=4, top_k=2, expert_ffn=6)


def test_small_case_by_hand():
    attention = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8  # Q, K, V, O
    assert B.attention_params(SMALL) == attention == 192
    expert = 3 * 8 * 6  # gate, up, down
    layer_total = attention + 2 * 8 + 8 * 4 + 4 * expert  # + norms + router + experts
    assert B.params_total(SMALL) == 3 * layer_total + 8  # + final norm
    layer_active = attention + 2 * 8 + 8 * 4 + 2 * expert
    assert B.params_active(SMALL) == 3 * layer_active + 8
    assert B.params_executed(SMALL) == B.params_active(SMALL)
    assert B.params_embedding(SMALL) == 2 * 10 * 8
    # 6 N_exec + 12 L q_width keys
    assert B.train_flops_per_token(SMALL, attended_keys=5) == 6 * (3 * layer_active + 8) + 12 * 3 * 8 * 5
    assert B.forward_flops_per_token(SMALL, attended_keys=5) == 2 * (3 * layer_active + 8) + 4 * 3 * 8 * 5
    assert B.kv_per_token(SMALL) == 2 * 3 * 4


def test_looped_counts_every_executed_layer_once_per_visit():
    looped = SMALL.replace(loop_start=1, loop_length=2, loop_repeats=3)  # executes 3 + 2*2 = 7
    layer_active = (B.params_active(SMALL) - 8) // 3
    assert B.params_total(looped) == B.params_total(SMALL)
    assert B.params_active(looped) == B.params_active(SMALL)
    assert B.params_executed(looped) == 7 * layer_active + 8
    assert B.kv_per_token(looped) == 2 * 7 * 4
    assert B.train_flops_per_token(looped, attended_keys=0) == 6 * (7 * layer_active + 8)


def test_sparsity_definition():
    assert B.compute_equivalent_sparsity(2.0, 10.0, 2.0, 10.0) == 0.0
    # N_act_eq = (F/F0) N0 = 1.1 * 10 = 11 of N = 100
    assert B.compute_equivalent_sparsity(2.2, 100.0, 2.0, 10.0) == pytest.approx(0.89)
    with pytest.raises(ValueError):
        B.compute_equivalent_sparsity(0.0, 1.0, 1.0, 1.0)


def test_paper_worked_example_200m_s95():
    """Spec §3: Baseline F = 1.33e9, SMELT F = 1.37e9 (+2.9%) at 200M, S~95%."""
    base = ModelConfig(vocab=65536, d_model=1280, n_layers=12, n_heads=10, n_kv_heads=2,
                       head_dim=128, n_experts=192, top_k=8, expert_ffn=432)
    smelt = base.replace(d_model=1056, n_heads=12, head_dim=88, n_experts=288, expert_ffn=352,
                         loop_start=3, loop_length=6, loop_repeats=2)
    f_base, f_smelt = B.train_flops_per_token(base), B.train_flops_per_token(smelt)
    assert f_base == pytest.approx(1.33e9, rel=0.005)
    assert f_smelt == pytest.approx(1.37e9, rel=0.005)
    assert f_smelt / f_base == pytest.approx(1.029, abs=0.002)
    assert B.kv_per_token(smelt) / B.kv_per_token(base) == pytest.approx(18 * 176 / (12 * 256))


def test_budget_works_on_arrays():
    """The matcher evaluates these formulas on numpy arrays of candidates."""
    import numpy as np
    from types import SimpleNamespace
    ns = SimpleNamespace(**{k: getattr(SMALL, k) for k in ("vocab", "n_layers", "top_k", "n_heads",
                                                             "head_dim", "n_kv_heads", "n_experts")},
                         d_model=np.array([8, 16]), expert_ffn=np.array([6, 6]),
                         executed_layers=3, q_width=8, kv_width=4)
    totals = B.params_total(ns)
    assert totals[0] == B.params_total(SMALL)
    assert totals[1] == B.params_total(SMALL.replace(d_model=16))

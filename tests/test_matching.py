import time

import pytest

from smelt_jax.design import budget as B
from smelt_jax.design.config import ModelConfig, smelt_loop
from smelt_jax.design.matching import MatchError, Tolerances, match, mismatch

BASE_200M_S85 = ModelConfig(vocab=65536, d_model=1280, n_layers=12, n_heads=10, n_kv_heads=2,
                            head_dim=128, n_experts=64, top_k=8, expert_ffn=432)


def test_pinned_match_recovers_the_papers_smelt_geometry():
    target = BASE_200M_S85.replace(**smelt_loop(12))
    result = match(BASE_200M_S85, target, fixed={"d_model": 1056, "n_experts": 96})
    cfg = result.config
    assert (cfg.n_heads, cfg.head_dim, cfg.n_kv_heads) == (12, 88, 2)
    assert cfg.expert_ffn == 352
    assert cfg.n_heads * cfg.head_dim == cfg.d_model
    assert result.mismatch == pytest.approx(mismatch(BASE_200M_S85, cfg))
    assert abs(result.mismatch["kv"]) <= 0.04 and abs(result.mismatch["params"]) <= 0.01


def test_free_search_meets_every_tolerance_and_is_deterministic():
    target = BASE_200M_S85.replace(**smelt_loop(12, loop_repeats=3))
    first = match(BASE_200M_S85, target)
    second = match(BASE_200M_S85, target)
    assert first == second
    tol = Tolerances()
    assert abs(first.mismatch["flops"]) <= tol.flops
    assert abs(first.mismatch["params"]) <= tol.params
    assert abs(first.mismatch["kv"]) <= tol.kv
    # the loop recipe and depth are kept; only the geometry changes
    assert (first.config.loop_repeats, first.config.loop_length, first.config.n_layers) == (3, 6, 12)
    assert first.config.d_model < BASE_200M_S85.d_model  # narrowed to pay for the extra layers
    assert B.params_total(first.config) == pytest.approx(B.params_total(BASE_200M_S85), rel=0.01)


def test_impossible_match_names_the_budget_and_the_closest_solution():
    # Loop everything 4 times at the Baseline's own width: FLOPs cannot be held.
    target = BASE_200M_S85.replace(loop_start=0, loop_length=12, loop_repeats=4)
    with pytest.raises(MatchError, match=r"flops budget.*closest: d_model=1280"):
        match(BASE_200M_S85, target, fixed={"d_model": 1280})


def test_bad_pin_is_rejected():
    with pytest.raises(ValueError, match="cannot pin"):
        match(BASE_200M_S85, BASE_200M_S85, fixed={"vocab": 3})


def test_matching_is_fast():
    target = BASE_200M_S85.replace(**smelt_loop(12))
    start = time.perf_counter()
    for _ in range(4):
        match(BASE_200M_S85, target)
    assert time.perf_counter() - start < 10.0

import pytest

from smelt_jax.design.config import ConfigError, ModelConfig, Schedule, middle_loop, smelt_loop

TINY = dict(vocab=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
            top_k=2, expert_ffn=32)


@pytest.mark.parametrize("change, message", [
    (dict(loop_start=3, loop_length=2, loop_repeats=2), "outside the 4 layers"),
    (dict(n_heads=3), "multiple of n_kv_heads"),
    (dict(top_k=9), "cannot exceed n_experts"),
    (dict(d_model=0), "positive integer"),
    (dict(head_dim=15), "even"),
    (dict(loop_repeats=2), "needs loop_length"),
    (dict(expert_impl="fast"), "expert_impl"),
])
def test_model_config_rejects_bad_input(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**TINY, **change})


def test_smelt_loop_positions_match_the_paper():
    # 1-based looped layers 3-7 (L=10), 4-9 (L=12), 6-15 (L=20), 8-22 (L=30).
    for n_layers, first, last in [(10, 3, 7), (12, 4, 9), (20, 6, 15), (30, 8, 22)]:
        loop = smelt_loop(n_layers)
        assert loop["loop_start"] + 1 == first
        assert loop["loop_start"] + loop["loop_length"] == last
    assert middle_loop(12, 0) == 6


def test_execution_order_and_effective_depth():
    cfg = ModelConfig(**TINY, loop_start=1, loop_length=2, loop_repeats=3)
    assert cfg.executed_layers == 4 + 2 * 2
    assert cfg.execution_order() == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2), (3, 0)]


def test_round_trip_through_dict():
    cfg = ModelConfig(**TINY, capacity_factor=1.5)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown field"):
        ModelConfig.from_dict({**cfg.to_dict(), "width": 3})
    sched = Schedule(batch_size=2, seq_len=8, stable_steps=10, fork_steps=(5, 10), decay_steps=3,
                     warmup_steps=2, peak_lr=1e-3)
    assert Schedule.from_dict(sched.to_dict()) == sched


def test_schedule_validation_and_tokens():
    kwargs = dict(batch_size=256, seq_len=4096, stable_steps=196_075,
                  fork_steps=(10_000, 196_075), decay_steps=9537, warmup_steps=2000, peak_lr=1e-3)
    sched = Schedule(**kwargs)
    # The paper's horizons: 20.5B tokens for the first fork, 215.6B for the last.
    assert sched.branch_tokens(0) / 1e9 == pytest.approx(20.5, abs=0.05)
    assert sched.branch_tokens(1) / 1e9 == pytest.approx(215.6, abs=0.05)
    assert Schedule.decay_steps_for_tokens(10e9, 256, 4096) == 9537
    with pytest.raises(ConfigError, match="strictly increasing"):
        Schedule(**{**kwargs, "fork_steps": (20, 10)})
    with pytest.raises(ConfigError, match="warmup"):
        Schedule(**{**kwargs, "fork_steps": (1000,)})

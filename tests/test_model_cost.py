"""XLA's FLOP count of the compiled forward against the budget, and the compiled program's size vs depth."""

import jax
import jax.numpy as jnp
from flax import nnx

from smelt_jax.design import budget
from smelt_jax.design.config import ModelConfig
from smelt_jax.model import Decoder

# top_k == n_experts: the capacity backend's worst-case buffer (E * T rows) is then exactly the
# T * top_k rows the budget counts, so XLA's count is comparable. Wide heads keep the softmax and
# masking (not in the budget) small next to the matmuls.
COST_CFG = ModelConfig(vocab=512, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64,
                       n_experts=2, top_k=2, expert_ffn=256, loop_start=1, loop_length=1,
                       loop_repeats=2, seq_len=128, expert_impl="capacity", attention_impl="reference")
TINY = ModelConfig(vocab=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                   n_experts=8, top_k=2, expert_ffn=32, loop_start=1, loop_length=2,
                   loop_repeats=2, seq_len=64)


def _lowered_forward(model, batch, seq):
    graphdef, state = nnx.split(model)

    def forward(state, tokens, segments, positions):
        return nnx.merge(graphdef, state)(tokens, segments, positions)[0]

    tokens = jnp.zeros((batch, seq), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return jax.jit(forward).lower(state, tokens, tokens + 1, positions)


def test_xla_flops_match_the_budget_within_ten_percent():
    model = Decoder(COST_CFG, rngs=nnx.Rngs(0))
    model.layer_loop = "unrolled"  # XLA's cost analysis counts a while-loop body only once
    batch, seq = 2, COST_CFG.seq_len
    cost = _lowered_forward(model, batch, seq).compile().cost_analysis()
    xla_flops = cost["flops"]
    # The full [seq, seq] score matrix is computed and masked: attended keys = seq_len.
    expected = batch * seq * budget.forward_flops_per_token(
        COST_CFG, attended_keys=seq, include_unembedding=True)
    assert abs(xla_flops / expected - 1) < 0.10, (xla_flops, expected)


def _compiled_lines(cfg, layer_loop: str = "scan") -> int:
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    model.layer_loop = layer_loop
    return _lowered_forward(model, 2, 16).compile().as_text().count("\n")


def test_compiled_program_does_not_grow_with_depth():
    """With the scan (TPU's and GPU's layer loop) the layers of each stretch are one body: 24 layers
    compile to the program of 4 (measured 7,128 and 7,240 lines of optimised HLO; the loop's visits
    are one scan each in training, so 4 bodies either way), so compile time does not grow with depth.
    Counting the compiled program, not timing its compile, keeps the check independent of the
    machine's load and of the test run's compilation cache."""
    shallow, deep = _compiled_lines(TINY), _compiled_lines(TINY.replace(n_layers=24))
    assert deep < 1.1 * shallow, (shallow, deep)
    # the check can fail: unrolled (the CPU's loop), the same two depths are 9,624 and 39,150 lines
    unrolled_shallow = _compiled_lines(TINY, "unrolled")
    unrolled_deep = _compiled_lines(TINY.replace(n_layers=24), "unrolled")
    assert unrolled_deep > 1.5 * unrolled_shallow, (unrolled_shallow, unrolled_deep)

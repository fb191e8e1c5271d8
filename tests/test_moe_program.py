"""What the compiled expert-parallel MoE program holds (8 fake CPU devices, compute dtype bfloat16):
- the MoE layer's forward + backward scatters no floating-point data (every row permutation is a gather
  both ways) and scatter-adds nothing inside the exchange; what is left are int32 index bookkeeping
  scatters (inverse permutations, expert counts);
- the train step of the smoke model holds no float32 [..., k, d] array in the MoE (the weighted top-k sum
  is taken inside the exchange's shard_map, in float32 over the compute-dtype rows).
Both fail on the code before issue 41 (combine outside the shard_map; gathers that differentiate into
scatter-adds)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from smelt_jax.parallel import sharding
from smelt_jax.design.config import ModelConfig
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.model.moe import MoE

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (\S+)\(")
OP_NAME = re.compile(r'op_name="([^"]*)"')


def instructions(hlo: str):
    """(name, dtype, shape tuple, opcode, op_name) of every instruction of the HLO text with an array
    result (the name carries JAX's primitive: scatter-add.12)."""
    for line in hlo.splitlines():
        match = INSTRUCTION.match(line)
        if match:
            name, dtype, dims, opcode = match.groups()
            op_name = OP_NAME.search(line)
            yield (name, dtype, tuple(int(v) for v in dims.split(",") if v), opcode,
                   op_name.group(1) if op_name else "")


def scatters(hlo: str) -> list[tuple]:
    return [i for i in instructions(hlo) if i[3] == "scatter"]


def _layer_program(cfg: ModelConfig, layout: dict, tokens: tuple[int, int]) -> str:
    """The compiled HLO text of value_and_grad of one MoE layer (tokens and all weights) under `layout`."""
    graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    b, s = tokens
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(b, s, cfg.d_model)), jnp.bfloat16)
    mask = jnp.ones((b, s), bool)

    def objective(state, x):
        y, stats = nnx.merge(graphdef, state)(x, mask)
        return jnp.sum(y.astype(jnp.float32) ** 2) + stats["load_balance_loss"] + stats["router_z_loss"]

    with jax.set_mesh(sharding.make_mesh(Parallelism(**layout))):
        return jax.jit(jax.value_and_grad(objective, (0, 1))).lower(state, x).compile().as_text()


@pytest.mark.parametrize("slack,exchange_layout", [
    (0.5, {"data": 2, "expert": 4}),  # overflow passes compiled in (they run on imbalanced routing)
    (None, {"data": 1, "expert": 8}),  # worst-case buffers: no overflow loop
])
def test_the_moe_backward_gathers_rows_and_scatters_none(slack, exchange_layout):
    cfg = ModelConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=8,
                      top_k=2, expert_ffn=24, seq_len=16, expert_impl="tiled", compute_dtype="bfloat16",
                      expert_buffer_slack=slack)
    hlo = _layer_program(cfg, exchange_layout, (4, 16))
    found = scatters(hlo)
    assert "all-to-all" in hlo  # the expert-parallel exchange was compiled
    rows = [s for s in found if s[1] != "s32" or len(s[2]) != 1]
    assert not rows, rows  # left: int32 index bookkeeping (inverse permutations, expert counts)
    adds_in_exchange = [s for s in found if "experts" in s[4] and "scatter-add" in s[0] + s[4]]
    assert not adds_in_exchange, adds_in_exchange


@pytest.mark.integration
def test_the_smoke_train_step_holds_no_float32_copy_outputs():
    """The smoke model (smelt, the xs scale) in bfloat16 on data 2 x expert 4: no float32 array shaped
    [..., k, d] in any MoE instruction of the compiled train step (forward, remat, backward)."""
    import experiments
    from smelt_jax.train import state as train_state
    from smelt_jax.train.step import make_train_step, optimizer

    run = next(r for r in experiments.load_suite("smoke") if r.arch == "smelt")
    cfg = run.model.replace(compute_dtype="bfloat16", top_k=3)  # k = 3: no attention shape ends in 3, d
    mesh = sharding.make_mesh(Parallelism(data=2, expert=4))
    tx = optimizer(run.schedule)
    plan = train_state.plan_training(cfg, tx, mesh, remat="full")
    params, opt_state = plan.abstract_state()
    b, s = 8, 32
    lr = jax.ShapeDtypeStruct((), "float32", sharding=sharding.replicated(mesh))
    in_shardings, out_shardings = plan.step_shardings(b, s)
    with jax.set_mesh(mesh):
        hlo = jax.jit(make_train_step(plan.graphdef, cfg, tx), in_shardings=in_shardings,
                      out_shardings=out_shardings).lower(params, opt_state, plan.abstract_batch(b, s),
                                                         lr).compile().as_text()
    k, d = cfg.top_k, cfg.d_model
    assert "all-to-all" in hlo  # the expert-parallel exchange was compiled
    moe_ops = [i for i in instructions(hlo) if "moe" in i[4]]
    assert any(i[2][-1:] == (d,) for i in moe_ops)  # the MoE's [..., d] arrays are found by op_name
    copies = [i for i in moe_ops if i[1] == "f32" and i[2][-2:] == (k, d)]
    assert not copies, copies[:5]

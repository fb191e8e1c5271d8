"""Logical axis rules: parameter names resolve to mesh specs; constraints are no-ops without a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from smelt_jax.parallel import sharding
from smelt_jax.design.config import ModelConfig
from smelt_jax.model import Decoder

TINY = ModelConfig(vocab=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                   n_experts=8, top_k=2, expert_ffn=32, loop_start=1, loop_length=2,
                   loop_repeats=2, seq_len=64)


def test_logical_names_resolve_through_the_rules_table():
    assert sharding.logical_to_mesh(("experts", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert sharding.logical_to_mesh(("batch", "seq", None)) == P(("data", "fsdp", "expert"), None, None)
    with pytest.raises(KeyError, match="embd"):
        sharding.logical_to_mesh(("embd",))


def test_model_parameters_resolve_to_mesh_specs():
    model = nnx.eval_shape(lambda: Decoder(TINY, rngs=nnx.Rngs(0)))
    specs = sharding.parameter_mesh_specs(model)
    assert specs["loop"]["moe"]["w_gate"].get_value() == P(None, "expert", "fsdp", "tensor")
    assert specs["embedding"].get_value() == P("tensor", "fsdp")
    assert specs["prefix"]["attention"]["wk"].get_value() == P(None, "fsdp", "tensor", None)


def test_constrain_is_a_no_op_without_a_mesh_and_applies_with_one():
    x = jnp.ones((8, 4, 16))
    assert sharding.constrain(x, ("batch", "seq", "act_embed")) is x
    mesh = jax.make_mesh((2, 2, 2, 1), sharding.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: sharding.constrain(a * 2, ("batch", "seq", "act_embed")))(x)
    assert y.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert"), None, None)), 3)
    assert next(iter(y.sharding.spec)) == ("data", "fsdp", "expert")
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
    with pytest.raises(ValueError, match="rank"), jax.set_mesh(mesh):
        sharding.constrain(x, ("batch",))

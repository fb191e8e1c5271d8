"""`smelt train --override`: model and schedule fields, fields left out of `to_dict` at their
default, and clear errors for keys that do not exist."""

import pytest

import experiments
from smelt_jax.run_files.overrides import apply_overrides
from smelt_jax.design.config import ConfigError

RUN = next(r for r in experiments.load_suite("smoke") if r.arch == "smelt")


def test_overrides_reach_model_and_schedule_and_change_the_id():
    run = apply_overrides(RUN, ["d_model=128", "schedule.peak_lr=0.002", "model.capacity_factor=null"])
    assert run.model.d_model == 128 and run.schedule.peak_lr == 0.002 and run.model.capacity_factor is None
    assert run.id != RUN.id


def test_an_execution_choice_can_be_overridden_and_keeps_the_id():
    """expert_exchange is how the model runs, not what it computes: overridden, but not in the id."""
    run = apply_overrides(RUN, ["model.expert_exchange=ragged"])
    assert run.model.expert_exchange == "ragged" and run.id == RUN.id
    assert apply_overrides(RUN, ["d_model=" + str(RUN.model.d_model + 8)]).id != RUN.id


@pytest.mark.parametrize("item,message", [
    ("d_model", "not key=value"),
    ("model.no_such_field=1", "no such model or schedule field"),
    ("optimizer.lr=1", "section must be model or schedule"),
    ("model.expert_exchange=sparse", "expert_exchange"),
])
def test_bad_overrides_raise_clear_errors(item, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(RUN, [item])

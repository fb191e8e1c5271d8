"""`key=value` overrides of a run's model and schedule fields (`smelt train --override`), type-checked
against each field's current value; the run id changes with the content."""

from __future__ import annotations

import dataclasses
import json

from smelt_jax.design.config import ConfigError, value_problem
from smelt_jax.design.descriptors import RunSpec

MAX_PARAMS = 10**13  # a model beyond ten trillion parameters is a typo, refused before anything starts


def _check_value(key: str, old, value, annotation: str = ""):
    """`value` converted to the type of the field's current value `old`; ConfigError if it cannot be.
    `null` is accepted for fields whose annotation allows None."""
    def fail(want: str):
        return ConfigError(f"override {key}={json.dumps(value)}: expected {want}")

    if old is None or (value is None and ("None" in annotation or "Optional" in annotation)):
        return value
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(old, types):  # bool before int: a bool is an int too
            problem = value_problem(kind, value)
            if problem:
                raise fail(problem)
            return float(value) if kind == "float" else value
    if isinstance(old, (tuple, list)):
        if not isinstance(value, list):
            raise fail("a JSON list, e.g. [1,2]")
        if old:
            return [_check_value(key, old[0], v) for v in value]
        return value
    return value


def apply_overrides(run: RunSpec, overrides: list[str]) -> RunSpec:
    """`key=value` pairs on the model (`d_model=128` or `model.d_model=128`) or the schedule
    (`schedule.peak_lr=1e-3`; bare schedule keys work when the model has no such field). Values
    are JSON (numbers, lists, null) or plain strings. The run's id changes with its content."""
    model, schedule = run.model.to_dict(), run.schedule.to_dict()
    # to_dict leaves some defaults out; {name: annotation}
    model_fields = {f.name: str(f.type) for f in dataclasses.fields(run.model)}
    schedule_fields = {f.name: str(f.type) for f in dataclasses.fields(run.schedule)}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        section, _, name = key.rpartition(".")
        if section not in ("", "model", "schedule"):
            raise ConfigError(f"override {key!r}: section must be model or schedule")
        if section in ("", "model") and name in model_fields:
            model[name] = _check_value(key, getattr(run.model, name), value, model_fields[name])
        elif section in ("", "schedule") and name in schedule_fields:
            schedule[name] = _check_value(key, getattr(run.schedule, name), value,
                                          schedule_fields[name])
        else:
            raise ConfigError(f"override {key!r}: no such model or schedule field")
    try:
        changed = dataclasses.replace(run, model=type(run.model).from_dict(model),
                                      schedule=type(run.schedule).from_dict(schedule))
        params = changed.budget().params_total
    except (TypeError, ValueError, OverflowError) as err:
        raise ConfigError(f"--override {' '.join(overrides)}: {err}") from err
    if params > MAX_PARAMS:
        raise ConfigError(f"--override {' '.join(overrides)}: the model would have {params:.3g} parameters "
                          f"(more than {MAX_PARAMS:.0e}); a typo?")
    return changed

"""Experiment descriptors: one `RunSpec` per model configuration of a suite.

A run is a model, its warmup-stable-decay schedule (the stable run and its decay branches), the
fully active control that defines its compute-equivalent sparsity, and a parallelism layout. Its id
is derived from that content, so the same run always gets the same id and two different runs
never share one.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from smelt_jax.design import budget as budget_lib
from smelt_jax.design.config import (REMAT_POLICIES, ConfigError, ModelConfig, Schedule, content_hash,
                                     value_problem)
from smelt_jax.platform.errors import UsageError
from smelt_jax.run_files.path_names import check_name
# What a run's data must be tokenized with (`RunSpec.tokenizer`): "" any tokenizer whose ids fit the
# model's vocabulary; "bytes" the embedded byte-level tokenizer; "hf" a Hugging Face tokenizer.json
# (e.g. a byte-level BPE from `smelt data tokenizer train`) of exactly `model.vocab` ids.
TOKENIZER_KINDS = ("", "bytes", "hf")


# `RunSpec.from_dict`: keys derived from the rest (`to_dict`'s id and budget) or added by the trainer
# to run.json (metadata, data), ignored so that a run.json is a config file too; and the defaults of
# the keys a config file may leave out.
DERIVED_KEYS = ("id", "budget", "metadata", "data")
# The RunSpec strings that reach a path (the id, hence the run folder; layout keys), each checked by
# `path_names.check_name`; the other strings never name a file (tests/test_path_names.py holds both lists).
PATH_FIELDS = ("suite", "scale", "sparsity_label", "arch", "variant")
SPEC_DEFAULTS = {"suite": "custom", "scale": "custom", "sparsity_label": "custom", "arch": "custom"}


def _type_problem(annotation: str, value) -> str | None:
    """Why `value` does not fit a config field annotated `annotation` (int, float, str, float | None,
    tuple[int, ...]), or None (`config.value_problem`)."""
    if value is None and "None" in annotation:
        return None
    base = annotation.split("|")[0].strip()
    kind = "int list" if base.startswith("tuple") else base
    return value_problem(kind, value) if kind in ("int", "float", "str", "bool", "int list") else None


def _section(cls, data, where: str):
    """`cls.from_dict(data)` (or `cls(**data)`) with every value type-checked first: ConfigError naming
    `where` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields) - {"remat"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {', '.join(fields)}")
    for name, value in data.items():
        problem = _type_problem(fields[name], value) if name in fields else None
        if problem:
            raise ConfigError(f"{where}.{name}: expected {problem}, got {value!r}")
    try:
        return cls.from_dict(data) if hasattr(cls, "from_dict") else cls(**data)
    except ConfigError as err:  # "Parallelism.remat ..." -> "RunSpec.parallelism.remat ...": the field
        own = f"{cls.__name__}."
        text = str(err)
        raise ConfigError(f"{where}.{text[len(own):]}" if text.startswith(own) else f"{where}: {text}") from None
    except (TypeError, ValueError, ArithmeticError) as err:
        raise ConfigError(f"{where}: {' '.join(str(err).split())}") from None


class DataMismatch(UsageError):
    """The training data was prepared with a tokenizer the run does not expect."""


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Mesh axis sizes (-1 = fill the rest), the TPU slice a layout was chosen for, remat policy, and the
    expert exchange chosen with it (`exchange`: 'auto' = the model's own `expert_exchange`; the compile
    report's layout search may pick 'ring' per configuration: `with_exchange` applies it)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    tpu_type: str = ""  # e.g. "v5p-128"; empty = not chosen yet
    remat: str = "none"
    exchange: str = "auto"  # added later: left out of `to_dict` at 'auto', so ids and cache keys stay
    # How the layer stacks run (kernels.backend.LAYER_LOOPS): 'auto' is the platform's (a scan on TPU);
    # the layout search may pick 'unrolled' per configuration (compile/loop_form.py). Left out of
    # `to_dict` at 'auto' like `exchange`; never part of a run id (`RunSpec.content_hash`).
    layer_loop: str = "auto"
    # The XLA options the step compiles with (platform.xla_options.COLLECTIVE_FORMS): 'auto' = XLA's
    # defaults; the layout search may pick 'async' (collectives overlapped with compute on TPU,
    # compile/collective_form.py). Left out of `to_dict` at 'auto'; never part of a run id.
    collectives: str = "auto"

    def __post_init__(self) -> None:
        from smelt_jax.kernels.backend import EXPERT_EXCHANGES, LAYER_LOOPS
        from smelt_jax.platform.xla_options import COLLECTIVE_FORMS

        if self.collectives not in COLLECTIVE_FORMS:
            raise ConfigError(f"Parallelism.collectives {self.collectives!r} not in {COLLECTIVE_FORMS}")

        if self.exchange not in EXPERT_EXCHANGES:
            raise ConfigError(f"Parallelism.exchange {self.exchange!r} not in {EXPERT_EXCHANGES}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ConfigError(f"Parallelism.layer_loop {self.layer_loop!r} not in {LAYER_LOOPS}")
        # Checked here, where every layout is made (a suite, a config file, run.json, --layout), so a
        # bad one is one line before anything is written (issue 53), not a traceback in the model.
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"Parallelism.remat {self.remat!r} not in {REMAT_POLICIES}")
        for axis in ("data", "fsdp", "expert", "tensor"):
            size = getattr(self, axis)
            whole = isinstance(size, numbers.Integral) and not isinstance(size, bool)
            if not whole or not (size == -1 or size >= 1):
                raise ConfigError(f"Parallelism.{axis} {size!r}: a mesh axis size is a positive integer "
                                  "or -1 (fill the rest)")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for field in ("exchange", "layer_loop", "collectives"):
            if out[field] == "auto":
                del out[field]
        return out

    def with_exchange(self, model: ModelConfig) -> ModelConfig:
        """`model` with this layout's expert exchange (unchanged when 'auto')."""
        return model if self.exchange == "auto" else model.replace(expert_exchange=self.exchange)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    suite: str
    scale: str
    sparsity_label: str
    arch: str  # "baseline" | "smelt" | "looped"
    model: ModelConfig
    schedule: Schedule
    control: ModelConfig  # the S~0 member of the same arch and scale: S is measured against it
    pair_id: str
    variant: str = ""  # ablation coordinate, e.g. "span4", "r3", "l15"
    parallelism: Parallelism = Parallelism()
    # The tokenizer its data must come from (TOKENIZER_KINDS), part of the id with the vocabulary
    # (model.vocab); `check_data` refuses data of another tokenizer.
    tokenizer: str = ""

    def __post_init__(self) -> None:
        # The names that become the run's folder and id (`rundir`): one check (smelt_jax.run_files.path_names).
        for name in PATH_FIELDS:
            check_name(getattr(self, name), f"RunSpec.{name}", empty_ok=name == "variant")
        if self.tokenizer not in TOKENIZER_KINDS:
            raise ConfigError(f"RunSpec.tokenizer {self.tokenizer!r} not in {TOKENIZER_KINDS}")

    def check_data(self, tokenizer, where: str = "the training data") -> None:
        """Raise DataMismatch unless `tokenizer` (of the data this run would read: `.kind`, `.vocab_size`,
        `.sha256`) is one the run can train on: ids below model.vocab, and the kind and exact vocabulary
        this run's suite states (`tokenizer`)."""
        vocab, kind = self.model.vocab, getattr(tokenizer, "kind", "?")
        got = (f"{where} was prepared with a {kind} tokenizer of {tokenizer.vocab_size:,} ids "
               f"(sha256 {str(getattr(tokenizer, 'sha256', '?'))[:16]})")
        if tokenizer.vocab_size > vocab:
            raise DataMismatch(f"{got}, more than run {self.id}'s vocabulary of {vocab:,}; use a model "
                               "of that vocabulary (--override vocab=N) or other data")
        if self.tokenizer and (kind != self.tokenizer or tokenizer.vocab_size != vocab):
            how = ("the embedded corpus (no --data-dir)" if self.tokenizer == "bytes" else
                   f"a token store prepared with a {vocab:,}-id tokenizer.json (`smelt data tokenizer "
                   f"train --vocab-size {vocab}`, then `smelt data prepare --tokenizer`; "
                   "docs/tpu-quickstart.md)")
            raise DataMismatch(f"{got}; run {self.id} ({self.suite}) expects a {self.tokenizer} tokenizer "
                               f"of exactly {vocab:,} ids: train it on {how}")

    @property
    def content_hash(self) -> str:
        """What decides the numbers: model (compute dtype included), schedule (seed included), control
        and the kind of data (`tokenizer`). Not the layout: a mesh or remat change keeps the id."""
        return content_hash({"model": self.model.identity(), "schedule": self.schedule.to_dict(),
                             "control": self.control.identity(), "tokenizer": self.tokenizer})

    @property
    def id(self) -> str:
        parts = [self.suite, self.scale, self.sparsity_label, self.arch]
        if self.variant:
            parts.append(self.variant)
        return "-".join(parts + [self.content_hash])

    def budget(self) -> budget_lib.Budget:
        return budget_lib.budget(self.model, control=self.control)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSpec":
        """The run `to_dict` (or a config file) describes. A config file needs only the model (`model`,
        or `config` as `to_dict` names it) and `schedule`; `control` defaults to the model itself
        (sparsity measured against itself: 0), `pair_id` to SUITE-SCALE-SPARSITY, the names to
        SPEC_DEFAULTS. The derived keys (DERIVED_KEYS) are ignored: the id follows from the content.
        Anything else unknown, or a value of the wrong type, is a ConfigError naming the field."""
        if not isinstance(data, dict):
            raise ConfigError(f"a run spec is a mapping of fields, got {type(data).__name__}")
        if "model" in data and "config" in data:
            raise ConfigError("give the model as `model` or as `config`, not both")
        data = {("model" if k == "config" else k): v for k, v in data.items() if k not in DERIVED_KEYS}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"RunSpec: unknown field(s) {unknown}; known: {', '.join(sorted(fields))}")
        for name in ("model", "schedule"):
            if name not in data:
                raise ConfigError(f"RunSpec: the {name} is missing")
        values = {**SPEC_DEFAULTS, **data}
        for name in ("suite", "scale", "sparsity_label", "arch", "pair_id", "variant", "tokenizer"):
            if name in values and not isinstance(values[name], str):
                raise ConfigError(f"RunSpec.{name}: expected a string, got {values[name]!r}")
        values["model"] = _section(ModelConfig, values["model"], "RunSpec.model")
        values["schedule"] = _section(Schedule, values["schedule"], "RunSpec.schedule")
        values["control"] = (_section(ModelConfig, values["control"], "RunSpec.control")
                             if "control" in values else values["model"])
        values.setdefault("pair_id", f"{values['suite']}-{values['scale']}-{values['sparsity_label']}")
        if "parallelism" in values:
            values["parallelism"] = _section(Parallelism, values["parallelism"], "RunSpec.parallelism")
        try:
            run = cls(**values)
            run.budget()
        except ConfigError:
            raise
        except (TypeError, ValueError, ArithmeticError) as err:
            raise ConfigError(f"RunSpec: {' '.join(str(err).split())}") from None
        return run

    def to_dict(self) -> dict[str, Any]:
        b = self.budget()
        return {
            "id": self.id, "suite": self.suite, "scale": self.scale,
            "sparsity_label": self.sparsity_label, "arch": self.arch, "variant": self.variant,
            "pair_id": self.pair_id, "config": self.model.to_dict(),
            "budget": {"train_flops_per_token": b.train_flops_per_token,
                       "params_total": b.params_total, "params_active": b.params_active,
                       "params_embedding": b.params_embedding, "kv_per_token": b.kv_per_token,
                       "sparsity": b.sparsity},
            "schedule": self.schedule.to_dict(), "control": self.control.to_dict(),
            "parallelism": self.parallelism.to_dict(), "tokenizer": self.tokenizer,
        }

"""Experiment descriptors: one `RunSpec` per model configuration of a suite.

A run is a model, its warmup-stable-decay schedule (the stable run and its decay branches), the
fully active control that defines its compute-equivalent sparsity, and a parallelism layout. Its id
is derived from that content, so the same run always gets the same id and two different runs
never share one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from smelt_jax import budget as budget_lib
from smelt_jax.config import ConfigError, ModelConfig, Schedule, content_hash

_NAME = re.compile(r"^[a-z0-9][a-z0-9.]*$")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Mesh axis sizes (-1 = fill the rest), the TPU slice a layout was chosen for, remat policy."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    tpu_type: str = ""  # e.g. "v5p-128"; empty = not chosen yet
    remat: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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

    def __post_init__(self) -> None:
        for name in ("suite", "scale", "sparsity_label", "arch"):
            if not _NAME.match(getattr(self, name)):
                raise ConfigError(f"RunSpec.{name} {getattr(self, name)!r} must be lower-case "
                                  "letters, digits and dots")

    @property
    def content_hash(self) -> str:
        return content_hash({"model": self.model.identity(), "schedule": self.schedule.to_dict(),
                             "control": self.control.identity(),
                             "parallelism": self.parallelism.to_dict()})

    @property
    def id(self) -> str:
        parts = [self.suite, self.scale, self.sparsity_label, self.arch]
        if self.variant:
            parts.append(self.variant)
        return "-".join(parts + [self.content_hash])

    def budget(self) -> budget_lib.Budget:
        return budget_lib.budget(self.model, control=self.control)

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
            "parallelism": self.parallelism.to_dict(),
        }

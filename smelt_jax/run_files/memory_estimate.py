"""A run's memory per device, estimated before anything is written, and the refusal of a run that cannot
fit the devices present (`check_fits`: one line, exit 2, with the estimate).

The estimate is a lower bound, so that a run it refuses surely cannot train: the training state (the
parameters in `param_dtype`, float32 gradients and AdamW's two float32 moments) spread evenly over every
device (the best any layout does), plus each device's share of the activations one step keeps for the
backward pass (`ACTIVATION_WIDTHS` values per token and executed layer, `remat: full` keeping only the
layer inputs) and of the float32 logits and their gradient. Jax-free: the caller passes what a device
holds (`device_bytes`).
"""

from __future__ import annotations

import dataclasses

from smelt_jax.design import budget as budget_lib
from smelt_jax.design.config import ConfigError, ModelConfig, Schedule

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Values a layer keeps per token for its backward without remat, as multiples of its widths: the norms'
# and attention's inputs and outputs (d_model), Q|K|V and the attention output (q_width), and the SwiGLU
# gate, up and product of each chosen expert (expert_ffn * top_k). Fewer than any implementation keeps.
ACTIVATION_WIDTHS = {"d_model": 4, "q_width": 2, "expert_ffn": 3}


class DoesNotFit(ConfigError):
    """A run whose training state and activations cannot fit the devices present."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    params: int          # bytes, all devices together
    gradients: int
    optimizer: int
    activations: int     # bytes per device
    devices: int

    @property
    def per_device(self) -> int:
        return -(-(self.params + self.gradients + self.optimizer) // self.devices) + self.activations

    def describe(self) -> str:
        return (f"~{self.per_device / GIB:.3g} GiB per device at least (parameters {self.params / GIB:.3g} GiB, "
                f"gradients {self.gradients / GIB:.3g} GiB, optimizer state {self.optimizer / GIB:.3g} GiB, "
                f"spread over {self.devices} device(s); activations {self.activations / GIB:.3g} GiB each)")


def estimate(model: ModelConfig, schedule: Schedule, devices: int, remat: str = "none") -> MemoryEstimate:
    """The lower bound of a training step's memory (module docstring) on `devices` devices."""
    n = budget_lib.params_total(model) + budget_lib.params_embedding(model)
    tokens = -(-schedule.batch_size * schedule.seq_len // devices)  # this device's share of a step
    act = DTYPE_BYTES[model.compute_dtype]
    if remat == "full":
        per_layer = model.d_model
    else:
        per_layer = (ACTIVATION_WIDTHS["d_model"] * model.d_model + ACTIVATION_WIDTHS["q_width"] * model.q_width
                     + ACTIVATION_WIDTHS["expert_ffn"] * model.expert_ffn * model.top_k)
    activations = tokens * model.executed_layers * per_layer * act + tokens * model.vocab * 4 * 2
    return MemoryEstimate(params=n * DTYPE_BYTES[model.param_dtype], gradients=n * 4, optimizer=2 * n * 4,
                          activations=activations, devices=devices)


def check_fits(run, devices: int, device_bytes: int | None, remat: str = "none") -> MemoryEstimate:
    """The estimate of `run` (a RunSpec) on `devices` devices of `device_bytes` each; DoesNotFit (one line,
    naming the estimate) when it exceeds them. `device_bytes` None (unknown): never refused."""
    found = estimate(run.model, run.schedule, devices, remat)
    if device_bytes and found.per_device > device_bytes:
        raise DoesNotFit(f"run {run.id} cannot fit the {devices} device(s) present: it needs {found.describe()}, "
                         f"a device holds {device_bytes / GIB:.3g} GiB; refused before anything was written "
                         "(a smaller model or batch, more devices, or --remat full)")
    return found

"""Frozen, validated configuration dataclasses: the model and the training schedule.

Every number a run uses lives in one of these. They are hashable, serialisable to JSON
(`to_dict` / `from_dict`) and validated at construction, so a bad configuration fails with one
clear `ConfigError` naming the field, never later inside JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from smelt_jax.platform.errors import SmeltError
# The backend names, defined once (jax-free).
from smelt_jax.kernels.backend import ATTENTION_IMPLS, EXPERT_EXCHANGES, EXPERT_IMPLS


class ConfigError(SmeltError, ValueError):
    """A configuration that cannot describe a valid model or schedule."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    _require(not unknown, f"{cls.__name__}: unknown field(s) {unknown}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def content_hash(obj: Any, length: int = 8) -> str:
    """Stable hex digest of a JSON-serialisable object (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
INT_LIMIT = 2**63  # an integer field must fit a signed 64-bit integer (numpy, JAX, orbax)


def value_problem(kind: str, value) -> str | None:
    """What a config value of `kind` ("bool", "int", "float", "str", "int list") must be when `value` is
    not one ("an integer", ...), else None. The one check of config files (`RunSpec.from_dict`) and of
    `--override` values (`smelt_jax.run_files.overrides`)."""
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return "an integer"
        return None if -INT_LIMIT < value < INT_LIMIT else "an integer that fits 64 bits (magnitude below 2**63)"
    if kind == "float":
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        return None if ok else "a finite number"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if kind == "int list":
        ok = isinstance(value, (list, tuple)) and all(value_problem("int", v) is None for v in value)
        return None if ok else "a list of integers"
    raise ValueError(f"unknown kind {kind!r}")
# The expert exchange's first-pass rows over the balanced load (docs/moe-buffers.md "The default": 2.5 was
# tried in issue 41 and compiled slower than 1.5 for the 100M S95 pair, ring and padded alike).
EXPERT_BUFFER_SLACK = 1.5
# Fields added after the first spec files were written: left out of `to_dict` while they hold these
# defaults, so older spec files, layout-cache keys and golden files read the same.
_OMITTED_WHEN_DEFAULT = {"expert_exchange": "auto", "attention_impl": "auto",
                         "expert_buffer_slack": EXPERT_BUFFER_SLACK}
# How a model is executed, not what it computes: every backend is tested equal to the reference
# (kernels/backend.py resolves "auto" by platform), so none of these enters a run id (`identity`).
EXECUTION_FIELDS = ("expert_impl", "expert_exchange", "attention_impl", "expert_buffer_slack")
# Fields moved out of ModelConfig: `from_dict` drops them from old spec files. `remat` is an execution
# choice and lives with the layout (`descriptors.Parallelism.remat`).
_RETIRED_FIELDS = ("remat",)
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """An MoE decoder, optionally looped.

    Layers `[loop_start, loop_start + loop_length)` form one weight-shared block executed
    `loop_repeats` times; `loop_repeats == 1` (or `loop_length == 0`) is an ordinary stack.
    The attention query width is `n_heads * head_dim`; it need not equal `d_model`.
    """

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    loop_start: int = 0
    loop_length: int = 0
    loop_repeats: int = 1
    seq_len: int = 4096
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    # Router auxiliary losses (Switch load balance, ST-MoE z-loss): see docs/training.md.
    load_balance_weight: float = 0.01
    router_z_weight: float = 1e-3
    # None = dropless; otherwise tokens per expert = ceil(capacity_factor * tokens * top_k / n_experts).
    capacity_factor: float | None = None
    expert_impl: str = "auto"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    # How expert parallelism moves tokens (model/expert_exchange.py): "auto" = padded on TPU and CPU,
    # ragged on GPU (XLA:CPU lacks ragged-all-to-all); "ring" = model/ring_exchange.py (all-gather +
    # reduce-scatter); kernels/backend.choose_expert_exchange decides.
    expert_exchange: str = "auto"
    # Expert-parallel buffers: rows per destination = slack x the balanced load (model/moe_buffers.py);
    # None = the worst case. Rows past it take overflow passes, so the numbers do not depend on it.
    expert_buffer_slack: float | None = EXPERT_BUFFER_SLACK
    # "auto" = Pallas splash attention on TPU, the reference elsewhere: choose_attention_backend.
    attention_impl: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "n_experts", "top_k", "expert_ffn", "loop_repeats", "seq_len"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     f"ModelConfig.{name} must be a positive integer, got {value!r}")
        for name in ("loop_start", "loop_length"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0,
                     f"ModelConfig.{name} must be a non-negative integer, got {value!r}")
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        _require(self.top_k <= self.n_experts,
                 f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        _require(self.loop_start + self.loop_length <= self.n_layers,
                 f"loop span [{self.loop_start}, {self.loop_start + self.loop_length}) lies "
                 f"outside the {self.n_layers} layers")
        _require(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for RoPE")
        _require(self.loop_length > 0 or self.loop_repeats == 1,
                 f"loop_repeats={self.loop_repeats} needs loop_length > 0")
        _require(self.rope_theta > 0 and self.norm_eps > 0, "rope_theta and norm_eps must be > 0")
        _require(self.load_balance_weight >= 0 and self.router_z_weight >= 0,
                 "auxiliary loss weights must be >= 0")
        _require(self.capacity_factor is None or self.capacity_factor > 0,
                 f"capacity_factor must be None (dropless) or > 0, got {self.capacity_factor}")
        _require(self.expert_buffer_slack is None or self.expert_buffer_slack > 0,
                 f"expert_buffer_slack must be None (worst case) or > 0, got {self.expert_buffer_slack}")
        _require(self.expert_impl in EXPERT_IMPLS,
                 f"expert_impl {self.expert_impl!r} not in {EXPERT_IMPLS}")
        _require(self.expert_exchange in EXPERT_EXCHANGES,
                 f"expert_exchange {self.expert_exchange!r} not in {EXPERT_EXCHANGES}")
        _require(self.attention_impl in ATTENTION_IMPLS,
                 f"attention_impl {self.attention_impl!r} not in {ATTENTION_IMPLS}")
        _require(self.param_dtype in DTYPES and self.compute_dtype in DTYPES,
                 f"dtypes must be in {DTYPES}")

    # Derived geometry -------------------------------------------------------------------
    @property
    def is_looped(self) -> bool:
        return self.loop_length > 0 and self.loop_repeats > 1

    @property
    def loop_end(self) -> int:
        return self.loop_start + self.loop_length

    @property
    def executed_layers(self) -> int:
        """L_eff = L + (r - 1) * m: layers executed per token."""
        return self.n_layers + (self.loop_repeats - 1) * self.loop_length

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    def execution_order(self) -> list[tuple[int, int]]:
        """(physical layer, visit) for every executed layer, in order; visit counts from 0."""
        order = [(i, 0) for i in range(self.loop_start)]
        for visit in range(self.loop_repeats):
            order += [(i, visit) for i in range(self.loop_start, self.loop_end)]
        order += [(i, 0) for i in range(self.loop_end, self.n_layers)]
        return order

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name, default in _OMITTED_WHEN_DEFAULT.items():
            if out[name] == default:
                del out[name]
        return out

    def identity(self) -> dict[str, Any]:
        """What run ids hash: every field that decides the numbers (all but EXECUTION_FIELDS)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in EXECUTION_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return _from_dict(cls, {k: v for k, v in data.items() if k not in _RETIRED_FIELDS})


def middle_loop(n_layers: int, loop_length: int) -> int:
    """Start of a centred loop span: floor((L - m) / 2) (the paper's placement)."""
    _require(0 <= loop_length <= n_layers, f"loop length {loop_length} outside 0..{n_layers}")
    return (n_layers - loop_length) // 2


def smelt_loop(n_layers: int, loop_repeats: int = 2) -> dict[str, int]:
    """The paper's SMELT recipe: the middle half of the layers, executed `loop_repeats` times."""
    loop_length = n_layers // 2
    return {"loop_start": middle_loop(n_layers, loop_length), "loop_length": loop_length,
            "loop_repeats": loop_repeats}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A warmup-stable-decay run and the cosine-decay branches that fork from it.

    The stable run holds `peak_lr` after `warmup_steps` until `stable_steps`; branch k forks at
    `fork_steps[k]` and decays (cosine, to `peak_lr * final_lr_fraction`) over `decay_steps`, or, when
    `decay_fraction` f > 0, over f of its own horizon: round(fork * f / (1 - f)) steps, at least 1
    (`branch_decay_steps`).
    """

    batch_size: int
    seq_len: int
    stable_steps: int
    fork_steps: tuple[int, ...]
    decay_steps: int
    warmup_steps: int
    peak_lr: float
    final_lr_fraction: float = 0.0
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    decay_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "stable_steps"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0,
                     f"Schedule.{name} must be a positive integer, got {value!r}")
        _require(isinstance(self.decay_steps, int) and self.decay_steps >= 0,
                 f"Schedule.decay_steps must be a non-negative integer, got {self.decay_steps!r}")
        _require((self.decay_steps > 0) != (self.decay_fraction > 0),
                 "Schedule needs exactly one of decay_steps > 0 (a fixed decay) and decay_fraction > 0 "
                 f"(a share of each branch's horizon); got {self.decay_steps} and {self.decay_fraction}")
        _require(isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps <= self.stable_steps,
                 f"warmup_steps ({self.warmup_steps}) must lie in 0..stable_steps")
        _require(len(self.fork_steps) > 0, "Schedule needs at least one fork step")
        _require(list(self.fork_steps) == sorted(set(self.fork_steps)),
                 f"fork_steps must be strictly increasing, got {self.fork_steps}")
        _require(all(self.warmup_steps <= s <= self.stable_steps for s in self.fork_steps),
                 f"fork_steps {self.fork_steps} must lie in warmup..stable_steps")
        _require(self.peak_lr > 0, "peak_lr must be > 0")
        _require(0 <= self.final_lr_fraction <= 1, "final_lr_fraction must lie in [0, 1]")
        _require(0 <= self.adam_b1 < 1 and 0 <= self.adam_b2 < 1, "Adam betas must lie in [0, 1)")
        _require(self.grad_clip > 0 and self.weight_decay >= 0, "bad grad_clip or weight_decay")
        _require(0 <= self.decay_fraction < 1, f"decay_fraction must lie in [0, 1), got {self.decay_fraction}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def executed_steps(self) -> int:
        """Optimizer steps a run executes in all: its stable phase and every decay branch."""
        return self.stable_steps + sum(map(self.branch_decay_steps, range(len(self.fork_steps))))

    def branch_decay_steps(self, branch: int) -> int:
        """Steps of branch `branch`'s decay: `decay_steps`, or `decay_fraction` of its horizon."""
        if not self.decay_fraction:
            return self.decay_steps
        f = self.decay_fraction
        return max(1, round(self.fork_steps[branch] * f / (1 - f)))

    def branch_end_step(self, branch: int) -> int:
        return self.fork_steps[branch] + self.branch_decay_steps(branch)

    def branch_tokens(self, branch: int) -> int:
        """Training tokens D seen by the endpoint of branch `branch`."""
        return self.branch_end_step(branch) * self.tokens_per_step

    @staticmethod
    def decay_steps_for_tokens(tokens: float, batch_size: int, seq_len: int) -> int:
        return math.ceil(tokens / (batch_size * seq_len))

    def replace(self, **changes: Any) -> "Schedule":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fork_steps"] = list(self.fork_steps)
        if not self.decay_fraction:  # added after run ids were published: absent at its default
            del out["decay_fraction"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Schedule":
        return _from_dict(cls, data)

"""A tiny custom run as a config file (`smelt train --config`): trains a few steps on a tiny corpus."""

from __future__ import annotations

import json
from pathlib import Path

from smelt_jax.descriptors import RunSpec

TINY_SPEC = {
    "suite": "custom", "scale": "tiny", "sparsity_label": "s50", "arch": "smelt",
    "model": {"vocab": 512, "d_model": 32, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
              "n_experts": 4, "top_k": 2, "expert_ffn": 32, "loop_start": 1, "loop_length": 1,
              "loop_repeats": 2, "seq_len": 32, "capacity_factor": 2.0},
    "schedule": {"batch_size": 2, "seq_len": 32, "stable_steps": 4, "fork_steps": [2, 4],
                 "decay_steps": 2, "warmup_steps": 1, "peak_lr": 3e-3},
}


def tiny_run(spec: dict = TINY_SPEC) -> RunSpec:
    return RunSpec.from_dict(spec)


def write_spec_file(path: Path, spec: dict) -> Path:
    """The spec as YAML (.yaml/.yml) or JSON (anything else)."""
    if path.suffix in (".yaml", ".yml"):
        import yaml
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
    else:
        path.write_text(json.dumps(spec, indent=1))
    return path

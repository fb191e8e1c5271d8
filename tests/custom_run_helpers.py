"""A tiny custom run as a config file (`smelt train --config`): trains a few steps on a tiny corpus."""

from __future__ import annotations

import json
from pathlib import Path

from smelt_jax.design.descriptors import RunSpec

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


def skip_training(monkeypatch) -> list:
    """`train` runs everything up to the step loop (data choice and checks, lock, run.json) and stops
    there: the phases it would train are appended to the returned list. No compile: milliseconds."""
    from smelt_jax.train import trainer
    phases: list = []

    def train_to_end(phase, ckpt):
        ckpt.close()
        phases.append(phase)
        return {"run_id": phase.run.id, "branch": phase.branch, "step": phase.end, "status": "done"}

    monkeypatch.setattr(trainer, "_train_to_end", train_to_end)
    return phases


def saved_run(root: Path, run: RunSpec, data: dict | None = None) -> Path:
    """A run folder as a trainer leaves it: run.json (with `data` when given)."""
    from smelt_jax.run_files.rundir import run_dir
    rd = run_dir(run.suite, run.id, root)
    rd.root.mkdir(parents=True, exist_ok=True)
    record = {**run.to_dict(), "metadata": {}}
    if data is not None:
        record["data"] = data
    rd.spec_file.write_text(json.dumps(record))
    return rd.spec_file

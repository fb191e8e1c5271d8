"""What a finished phase leaves besides checkpoints: the run's `run.json` metadata and, for a decay
branch, its endpoint (the results store's row, then `endpoint.json`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax

from smelt_jax.platform import storage
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files.rundir import RunDir, results_dir


def write_spec(run: RunSpec, rd: RunDir, data: dict | None = None) -> None:
    """`run.json` (the resolved descriptor, where it ran and the data it trains on:
    `smelt_jax.run_files.run_data`), once: an existing one is kept. It is also the spec by which commands find a
    run no suite defines (`smelt_jax.run_files.run_lookup`)."""
    if not storage.exists(rd.spec_file):
        from smelt_jax.run_files.run_spec_file import spec_digest
        spec = run.to_dict()
        record = {**spec, "metadata": {**run_metadata(), "spec_digest": spec_digest(spec)}}
        if data is not None:
            record["data"] = data
        storage.write_json(rd.spec_file, record)


def write_endpoint(run: RunSpec, branch: int, losses: dict[str, float], *, root: Path | None,
                   rd: RunDir) -> dict:
    """Append the endpoint's row to the suite's results store, then write endpoint.json."""
    from smelt_jax.run_files.results import EndpointResult, append_result, git_commit
    from smelt_jax.run_files.run_lookup import run_origin
    b = run.budget()
    tokens = run.schedule.branch_tokens(branch)
    result = EndpointResult(
        run_id=run.id, branch=branch, pair_id=run.pair_id, suite=run.suite, arch=run.arch,
        scale=run.scale, sparsity_label=run.sparsity_label, sparsity=max(0.0, b.sparsity or 0.0),
        flops_per_token=b.train_flops_per_token, params=b.params_total, tokens=tokens,
        cumulative_flops=b.train_flops_per_token * tokens, val_loss=losses["overall"],
        losses_by_source={k: v for k, v in losses.items() if k != "overall"},
        git_commit=git_commit(), origin=run_origin(run))
    append_result(result, results_dir(run.suite, root))
    row = result.to_row()
    storage.write_json(rd.endpoint(branch), row)
    return row


def run_metadata() -> dict[str, Any]:
    import flax
    import optax

    from smelt_jax.run_files.results import git_commit
    return {"git_commit": git_commit(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind, "processes": jax.process_count(),
            "python": sys.version.split()[0], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                       time.gmtime())}

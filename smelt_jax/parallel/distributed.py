"""Multi-host start-up: `jax.distributed.initialize` from explicit arguments or from the environment.

Every host runs the same program. On Cloud TPU pods and GKE (JobSet) JAX finds the coordinator,
the process count and this process's id itself, so `initialize()` with no arguments is right there;
on one machine (tests, a workstation) nothing is initialised and there is one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from smelt_jax.platform.errors import UsageError

# Environment variables whose presence means "this process is one of several that JAX can find".
_CLUSTER_MARKERS = (
    ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS is set"),
    ("MEGASCALE_COORDINATOR_ADDRESS", "a multislice TPU job (MEGASCALE_COORDINATOR_ADDRESS)"),
    ("JOBSET_NAME", "a GKE JobSet (JOBSET_NAME)"),
)


def cluster_from_environment(env: Mapping[str, str] | None = None) -> str | None:
    """Why the environment looks like a multi-host job JAX can auto-detect, or None if it does not."""
    env = os.environ if env is None else env
    for name, reason in _CLUSTER_MARKERS:
        if env.get(name):
            return reason
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return f"a TPU pod slice with {len(hosts)} workers (TPU_WORKER_HOSTNAMES)"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "a SLURM job with several tasks"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> str:
    """Join the job; returns what was done ('explicit ...', 'auto-detected ...', 'single process').

    Explicit arguments must come together (all three). Call before any JAX computation.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise UsageError("--coordinator, --num-processes and --process-id go together")
    if all(given):
        if not 0 <= process_id < num_processes:
            raise UsageError(f"process id {process_id} outside 0..{num_processes - 1}")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
        return f"explicit: process {process_id} of {num_processes} via {coordinator}"
    reason = cluster_from_environment()
    if reason is None:
        return "single process"
    jax.distributed.initialize()
    return f"auto-detected {reason}: process {jax.process_index()} of {jax.process_count()}"

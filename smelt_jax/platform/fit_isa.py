"""Fits that give the same bits on every x86 CPU: the one place where a fit process's instruction set is pinned.

XLA:CPU, NumPy and OpenBLAS each pick vector kernels for the CPU they run on. AVX-512 and AVX2 kernels
sum in other orders and use other exp/log approximations, so a fit's last bits (and a degenerate fit's
end point, which rides on them) differ between machines. A fit process therefore runs with all three
capped at AVX2 (with FMA), which every x86 CPU since 2015 has:

- XLA_FLAGS --xla_cpu_max_isa=AVX2 (read when JAX starts its CPU backend),
- NPY_DISABLE_CPU_FEATURES: NumPy's AVX-512 dispatch targets (read when NumPy is imported),
- OPENBLAS_CORETYPE=Haswell: OpenBLAS's AVX2 kernels (read when OpenBLAS loads, with NumPy).

The variables act only before NumPy and JAX load, so `pin_this_process` pins only a fresh process (the
`smelt` commands in FIT_COMMANDS call it first thing); a process that already trains or computes runs a
fit in a pinned subprocess (`fit_command`, as the demo does).
"""

from __future__ import annotations

import os
import sys

FIT_ISA = "AVX2"
ISA_FLAG = "--xla_cpu_max_isa"
# numpy 2.x's dispatch targets above AVX2 (X86_V3); naming one the CPU lacks is allowed and does nothing
NUMPY_DISABLED = "X86_V4 AVX512_ICL AVX512_SPR"
OPENBLAS_CORE = "Haswell"
# the `smelt` commands that fit or compute from fits (tables and figures of fitted laws)
FIT_COMMANDS = ("fit", "fit-suite", "fits-all", "gain", "tables")


def with_isa(xla_flags: str, isa: str | None) -> str:
    """XLA_FLAGS with any CPU ISA cap replaced by `isa` (removed when None)."""
    flags = [flag for flag in xla_flags.split() if not flag.startswith(ISA_FLAG + "=")]
    return " ".join(flags + ([f"{ISA_FLAG}={isa}"] if isa else []))


def fit_environment(environ=None) -> dict[str, str]:
    """`environ` (default os.environ) with the fit pins set."""
    env = dict(os.environ if environ is None else environ)
    env["XLA_FLAGS"] = with_isa(env.get("XLA_FLAGS", ""), FIT_ISA)
    env["NPY_DISABLE_CPU_FEATURES"] = NUMPY_DISABLED
    env["OPENBLAS_CORETYPE"] = OPENBLAS_CORE
    return env


def is_pinned(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return all(env.get(key) == value for key, value in fit_environment({}).items() if key != "XLA_FLAGS") \
        and f"{ISA_FLAG}={FIT_ISA}" in env.get("XLA_FLAGS", "").split()


def pin_this_process() -> bool:
    """Set the fit pins in os.environ if NumPy and JAX are not loaded yet; returns whether this process
    is pinned (False: a process that loaded them unpinned fits with its own CPU's kernels)."""
    if is_pinned():
        return True
    if any(name in sys.modules for name in ("numpy", "jax", "jaxlib")):
        return False
    os.environ.update(fit_environment())
    return True


def fit_command(*args: str) -> list[str]:
    """The argv of a `smelt` fit command run in a fresh (so pinned) Python process."""
    return [sys.executable, "-m", "smelt_jax", *args]

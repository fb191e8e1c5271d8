"""One line naming the CPU a benchmark ran on: model, cores, vector extensions, load (issue 28: a timing
means little without the machine's vector width)."""

from __future__ import annotations

import os
from pathlib import Path

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_line() -> str:
    """E.g. 'CPU: AMD EPYC, 2 cores; avx2 fma avx512f ...; 1-minute load 3.1'."""
    model, flags = "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    vector = " ".join(f for f in VECTOR_FLAGS if f in flags) or "no AVX2"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"CPU: {model}, {os.cpu_count()} cores; {vector}; 1-minute load {load:.1f}"

"""Run every benchmark (or those named) and write their tables to benchmarks/README.md.

    python -m benchmarks.run                 # all, README rewritten
    python -m benchmarks.run data kernels    # only bench_data and bench_kernels, printed only

Each `bench_<topic>.py` exposes `run() -> str` (a markdown section). `bench_peer` times our train step
against Hugging Face `transformers`' Mixtral in PyTorch (optional: `pip install -r requirements/bench.txt`;
without it the peer rows are skipped with one line saying so and our side still runs). Timings are medians measured
side by side in one process; the machine is noisy, so compare ratios within one run.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _modules(names: list[str]) -> list[str]:
    found = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if not names:
        return found
    wanted = [f"bench_{n}" if not n.startswith("bench_") else n for n in names]
    unknown = [w for w in wanted if w not in found]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; have {found}")
    return wanted


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sections = []
    for name in _modules(argv):
        started = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        table = importlib.import_module(f"benchmarks.{name}").run()
        print(table, flush=True)
        sections.append(f"{table.rstrip()}\n\n_{name} took {time.perf_counter() - started:.0f} s._\n")
    if not argv:
        header = (
            "# Benchmarks\n\n"
            "Regenerate with `make bench` (`python -m benchmarks.run`; one benchmark: "
            "`python -m benchmarks.run data`). Medians of repeated timings, measured side by side "
            "in one run; the machine is shared and noisy, so read ratios, not absolute numbers.\n\n"
            f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}.\n\n")
        (HERE / "README.md").write_text(header + "\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

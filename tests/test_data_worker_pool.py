"""`smelt data prepare`'s worker processes die with their parent (kill -9 of the parent: gone in ~1 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARENT = """
import sys, time
from smelt_jax.data import worker_pool
pool = worker_pool.pool(2)
pool.map(time.sleep, [0.2, 0.2], chunksize=1)  # both workers started and past their initializer
print(" ".join(str(p.pid) for p in pool._pool), flush=True)
pool.map(time.sleep, [600, 600], chunksize=1)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its entry waits to be reaped


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_die_within_a_second_of_a_killed_parent():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 1.0
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(_alive(p) for p in workers), f"workers {workers} outlived their parent by 1 s"
    finally:
        if parent.poll() is None:
            parent.kill()

"""One compile of the compile report in a child process of its own, so that a bad compile fails alone.

An ahead-of-time TPU compile runs XLA and libtpu inside the calling process. A compile the host cannot
hold (with its layers unrolled, a 200M or 600M SMELT program holds 9-19 GB of host memory while it
compiles, measured here; 1.6B not yet measured)
is ended by the kernel's out-of-memory killer, and a crash inside libtpu ends the process with a signal:
in the report's own process either loses every configuration after it. `Isolated(compile_run)` runs
each compile in a fresh Python process and answers its `CompileReport`, with the child's peak resident
memory (`host_peak_bytes`); a child that dies, or raises, raises `CompileCrashed` in the caller, which
the layout search records as that candidate's outcome ("not compiled (...)") before going on.

The child asks the kernel to pick it first when memory runs out (`oom_score_adj` 1000), so the report's
own process is the one that survives. A crashed compile is not cached: the next report run (on this
machine or a larger one) tries it again.

    Isolated(fn)(*args, **kwargs) -> fn(*args, **kwargs) run in a child; fn and its arguments picklable
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smelt_jax.platform.errors import SmeltError


class CompileCrashed(SmeltError):
    """The child process of one compile died or raised: the message says how, in one line."""


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the report that started it ends (stopped by hand, killed),
    so no compile outlives its report."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(folder: str) -> None:
    """The child: run the call pickled in `folder`/call.pkl, write `folder`/result.json."""
    try:  # the first process the kernel ends when the host runs out of memory
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    _die_with_parent()
    try:
        fn, args, kwargs = pickle.loads(Path(folder, "call.pkl").read_bytes())
        report = fn(*args, **kwargs)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        result = {"report": dataclasses.replace(report, host_peak_bytes=peak).as_dict()}
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller as one line
        traceback.print_exc(file=sys.stderr)
        first = (str(err).strip().splitlines() or [""])[0][:300]
        result = {"failed": f"{type(err).__name__}: {first}" if first else type(err).__name__}
    out = Path(folder, "result.json")
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)


def _death(returncode: int) -> str:
    """How a child that wrote no result ended, in words."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        if -returncode == signal.SIGKILL:
            return f"killed by {name} (most likely the kernel's out-of-memory killer: the host ran out of memory)"
        return f"died of {name}"
    return f"exited with status {returncode} and no result"


@dataclasses.dataclass(frozen=True)
class Isolated:
    """`fn` (a `compile_run`-like function answering a `CompileReport`) run in a fresh Python process per
    call (`python -m smelt_jax.compile.isolated`, this process's `sys.path` and environment): no fork
    of a process that has started XLA, and no re-import of the caller's main script."""

    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any):
        from smelt_jax.compile.results_ledger import report_from_dict

        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="smelt-compile-") as folder:
            Path(folder, "call.pkl").write_bytes(pickle.dumps((self.fn, args, kwargs)))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            child = subprocess.run([sys.executable, "-m", "smelt_jax.compile.isolated", folder], env=env,
                                   check=False)
            seconds = time.perf_counter() - start
            out = Path(folder, "result.json")
            if not out.exists():
                raise CompileCrashed(f"compile {_death(child.returncode)} after {seconds:.0f} s")
            result = json.loads(out.read_text())
        if "failed" in result:
            raise CompileCrashed(f"compile failed after {seconds:.0f} s: {result['failed']}")
        return report_from_dict(result["report"])


if __name__ == "__main__":
    _serve(sys.argv[1])

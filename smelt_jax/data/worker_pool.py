"""The process pool of `smelt data prepare`, whose workers die with their parent.

A spawned pool worker blocks on its task pipe and notices a killed parent (kill -9, OOM) only seconds
later, tokenizing or writing meanwhile. Each worker therefore asks the kernel for SIGKILL when its
parent dies (Linux: prctl PR_SET_PDEATHSIG), then checks that the parent is still the one that started
it (it may have died before the request). Elsewhere a daemon thread polls the parent's pid."""

from __future__ import annotations

import os
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_SECONDS = 0.2  # without prctl: how often a worker checks that its parent lives


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:
                os._exit(1)  # the parent died before the request: nobody is left to wait for us
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _start(parent: int, initializer, initargs: tuple) -> None:
    _die_with(parent)
    if initializer is not None:
        initializer(*initargs)


def pool(workers: int, initializer=None, initargs: tuple = ()):
    """A spawn-context multiprocessing pool of `workers` processes that die when this process dies."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(workers, initializer=_start,
                                                     initargs=(os.getpid(), initializer, initargs))

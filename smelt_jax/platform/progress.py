"""Progress for the trainer and the local sweep: a tqdm bar on a terminal, plain lines otherwise.

tqdm redraws its bar with `\\r`; in a pod's or a nohup job's log (stderr not a terminal) that is one
ever-growing line. `progress_bar` returns tqdm when `file` is a terminal, else a `LineProgress` with
the part of tqdm's interface the callers use (update, n, set_postfix, set_postfix_str, refresh,
close), which writes one whole line each time the postfix is set: the trainer sets it once per log
interval (`--log-every`), the sweep once per change of its running jobs.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def progress_bar(total: int, *, initial: int = 0, desc: str = "", unit: str = "it",
                 file: TextIO | None = None, disable: bool = False):
    """tqdm on a terminal, LineProgress elsewhere (both disabled by `disable`)."""
    file = file if file is not None else sys.stderr
    isatty = getattr(file, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file,
                    dynamic_ncols=True, disable=disable)
    return LineProgress(total, initial=initial, desc=desc, unit=unit, file=file, disable=disable)


def _clock(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class LineProgress:
    """`desc: 20/40 step (50%) elapsed 0:00:12 eta 0:00:12 loss=3.210 tok_s=1234`, one line per
    set_postfix / set_postfix_str / refresh, and at close when something changed since."""

    def __init__(self, total: int, *, initial: int = 0, desc: str = "", unit: str = "it",
                 file: TextIO | None = None, disable: bool = False) -> None:
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.file = file if file is not None else sys.stderr
        self.disable = disable
        self.postfix = ""
        self.start_n, self.started = initial, time.monotonic()
        self.printed: tuple | None = None
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())
        self.refresh()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        if refresh:
            self.refresh()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        done = self.n - self.start_n
        parts = [f"{self.desc}: {self.n}/{self.total} {self.unit}"]
        if self.total:
            parts.append(f"({100 * self.n / self.total:.0f}%)")
        parts.append(f"elapsed {_clock(elapsed)}")
        if done > 0 and self.total and self.n < self.total:
            parts.append(f"eta {_clock(elapsed / done * (self.total - self.n))}")
        if self.postfix:
            parts.append(self.postfix)
        return " ".join(parts)

    def refresh(self) -> None:
        if self.disable or self.closed:
            return
        self.printed = (self.n, self.postfix)
        print(self.line(), file=self.file, flush=True)

    def close(self) -> None:
        if not self.closed and self.printed != (self.n, self.postfix):
            self.refresh()
        self.closed = True

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

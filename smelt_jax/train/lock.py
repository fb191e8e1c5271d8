"""One trainer per run phase: an exclusive lock on the phase folder, with a heartbeat.

    <phase folder>/trainer.lock     {"pid", "host", "token", "started", "command"}; its mtime is the
                                    holder's heartbeat

A trainer takes the lock before it touches the phase's checkpoints or metrics and holds it until it
exits. While it holds it, a daemon thread refreshes the heartbeat every `HEARTBEAT_SECONDS` (also
while the trainer compiles or saves). Another trainer of the same phase finds the lock held and stops
with `LockHeld`, whose one-line message names the holder (pid, host, since when, last heartbeat).

A lock is *stale*, and is taken over, when its holder is gone: at once when the holder ran on this
host and its pid no longer exists, or is this very process's pid without being one of the locks this
process holds (a restarted container runs its trainer as pid 1 again); after
`UNREADABLE_STALE_SECONDS` (30 s) when the file cannot be read as a lock (empty or garbled); else once
its heartbeat is older than `STALE_SECONDS` (default 300 s; `$SMELT_LOCK_STALE_SECONDS`). The refusal
names the rule that applies to the lock it found. A holder whose lock was taken over (it was suspended past the
stale time) notices at its next heartbeat: `lost` becomes true and the trainer stops at the next step.

The interface (`PhaseLock`: acquire / refresh / release / lost) is what the trainer uses; `LocalLock`
implements it on a local or NFS-free shared disk: the lock's content is written to a temporary file
first and hard-linked into place (creation fails if a lock exists; a full disk leaves no lock file,
never an empty one), with `O_CREAT | O_EXCL` where the file system has no hard links, and an atomic
rename for the takeover; `GcsLease` on a `gs://` run root (an object carrying its heartbeat, every write conditional on
its generation: Cloud Storage's `ifGenerationMatch`). `phase_lock` picks the implementation from the
path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from smelt_jax.platform import env
from smelt_jax.platform.env import DEFAULT_LOCK_STALE_SECONDS
from smelt_jax.platform.errors import SmeltError

LOCK_NAME = "trainer.lock"
HEARTBEAT_SECONDS = 15.0
STALE_SECONDS = DEFAULT_LOCK_STALE_SECONDS  # the one default: smelt_jax.platform.env
UNREADABLE_STALE_SECONDS = 30.0  # an empty or garbled lock file (its writer died creating it)
_HELD_TOKENS: set[str] = set()  # the tokens of the locks this process holds now
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


class LockHeld(SmeltError, RuntimeError):
    """Another live trainer holds the phase's lock (a user error: one line, exit 2)."""


class LockLost(RuntimeError):
    """This trainer's lock was taken over (it looked dead); it must stop without saving."""


class PhaseLock(Protocol):
    def acquire(self) -> None: ...
    def refresh(self) -> None: ...
    def release(self) -> None: ...
    @property
    def lost(self) -> bool: ...


def stale_seconds() -> float:
    """SMELT_LOCK_STALE_SECONDS (default STALE_SECONDS), parsed by the one door: `platform.env`."""
    return env.lock_stale_seconds()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalLock:
    """`PhaseLock` on a local filesystem (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, *, description: str = "",
                 stale_after: float | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.description = description or str(self.folder)
        self.stale_after = stale_seconds() if stale_after is None else float(stale_after)
        self.token = uuid.uuid4().hex
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "token": self.token,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "command": " ".join(sys.argv)[:300]}
        self._held = False
        self._lost = False
        self.took_over: dict | None = None  # the stale holder's info, when this lock replaced one

    @property
    def lost(self) -> bool:
        return self._lost

    def _read(self, path: Path | None = None) -> tuple[dict, float] | None:
        """(holder info, heartbeat time) or None if there is no lock file."""
        path = path or self.path
        try:
            text = path.read_text()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            info = json.loads(text)
        except ValueError:
            info = {}  # being written this instant, or garbage: judged by its heartbeat alone
        return (info if isinstance(info, dict) else {}), mtime

    def _stale_after(self, info: dict) -> float:
        """Seconds without heartbeat after which a lock holding `info` is stale (the rule stated in
        refusals): the short grace for a lock that cannot be read, else `stale_after`."""
        return UNREADABLE_STALE_SECONDS if not info.get("token") else self.stale_after

    def _stale(self, info: dict, heartbeat: float) -> bool:
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
            if not _pid_alive(info["pid"]):
                return True
            if info["pid"] == os.getpid() and info.get("token") not in _HELD_TOKENS:
                return True  # our own pid, but not a lock we hold: a previous life of this pid
        return time.time() - heartbeat > self._stale_after(info)

    def holder_line(self, info: dict, heartbeat: float) -> str:
        if not info.get("token"):
            return (f"{self.description}: the lock {self.path} cannot be read as a lock (empty or "
                    f"garbled: its writer may have died creating it; heartbeat "
                    f"{max(0.0, time.time() - heartbeat):.0f} s ago); such a lock is taken over "
                    f"after {UNREADABLE_STALE_SECONDS:.0f} s without heartbeat")
        return (f"{self.description} is being trained by pid {info.get('pid', '?')} on host "
                f"{info.get('host', '?')} (since {info.get('started', '?')}, heartbeat "
                f"{max(0.0, time.time() - heartbeat):.0f} s ago; lock {self.path}); wait for it to "
                f"finish, or stop it; a lock without heartbeat for {self.stale_after:.0f} s is "
                "taken over")

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for _attempt in range(5):
            try:
                self._create()
            except FileExistsError:
                found = self._read()
                if found is None:
                    continue  # released meanwhile: try again
                info, heartbeat = found
                if not self._stale(info, heartbeat):
                    raise LockHeld(self.holder_line(info, heartbeat)) from None
                self._take_over(info)
                continue
            self._held, self._lost = True, False
            _HELD_TOKENS.add(self.token)
            return
        found = self._read()
        raise LockHeld(self.holder_line(*found) if found else
                       f"{self.description}: could not take the lock {self.path}; try again")

    def _create(self) -> None:
        """Create the lock file whole, or raise FileExistsError when one exists. Its content goes to a
        temporary file first, hard-linked into place (atomic and exclusive): a failed write (a full
        disk) leaves no lock file. Without hard links: O_EXCL, the file removed if the write fails."""
        data = json.dumps(self.info).encode()
        temp = self.path.with_name(f"{LOCK_NAME}.new-{self.token}")
        try:
            _write_synced(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, data)
            os.link(temp, self.path)
            return
        except OSError as err:
            if err.errno not in _NO_HARD_LINKS:
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        try:
            _write_synced(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, data)
        except FileExistsError:
            raise
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # ours: created by the O_EXCL open that just succeeded
            raise

    def _take_over(self, stale_info: dict) -> None:
        """Move a stale lock aside; if what was moved is not the stale lock (another process took it
        over between our read and our rename), put it back."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = self._read(aside)
        if moved is not None and moved[0].get("token") != stale_info.get("token"):
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # fails if a third process holds it now: then it wins
        else:
            self.took_over = stale_info
        with contextlib.suppress(OSError):
            os.unlink(aside)

    def _still_ours(self) -> bool:
        """True while this process holds the lock; marks it lost when another holder has taken it."""
        if not self._held:
            return False
        found = self._read()
        if found is None or found[0].get("token") != self.token:
            self._lost = True
            return False
        return True

    def refresh(self) -> None:
        """Heartbeat: touch the lock file if this process still holds it, else mark the lock lost."""
        if not self._still_ours():
            return
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path)

    def release(self) -> None:
        """Delete the lock if it is still this process's (a taken-over lock is left to its new holder)."""
        if not self._held:
            return
        self._held = False
        _HELD_TOKENS.discard(self.token)
        found = self._read()
        if found is not None and found[0].get("token") == self.token:
            self._delete()

    def _delete(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class GcsLease(LocalLock):
    """`PhaseLock` on Cloud Storage: the lock object `<phase>/trainer.lock` holds the holder's info and
    its heartbeat time (`"heartbeat"`, seconds since the epoch; an object has no mtime to touch).

    Every write is conditional on the object's generation (`gcs.write_if`, Cloud Storage's
    `ifGenerationMatch`), so the server decides every race:
    - acquire: read the object; a live holder (heartbeat newer than the stale time, or a live pid on
      this host) raises LockHeld; else write our info if the object is still what was read (absent, or
      the stale holder's generation). Of two trainers starting at the same instant exactly one write
      succeeds; the other reads again and finds a live holder.
    - refresh: rewrite the heartbeat only over our own last generation; a failed write means another
      trainer took the lock over (we looked dead): `lost`.
    - release: delete only our own generation.
    It works on any path `gcs.write_if` takes (a local path goes through tensorstore's `file` kvstore,
    which the tests use to race real processes); `phase_lock` uses it for gs:// roots only.
    """

    def __init__(self, folder: str, *, description: str = "", stale_after: float | None = None) -> None:
        super().__init__(Path("."), description=description or str(folder), stale_after=stale_after)
        from smelt_jax.platform import storage as gcs
        self._gcs = gcs
        self.folder = str(folder).rstrip("/")
        self.path = f"{self.folder}/{LOCK_NAME}"
        self._generation = b""

    @staticmethod
    def _parse(data: bytes) -> tuple[dict, float]:
        try:
            info = json.loads(data.decode("utf-8"))
        except ValueError:
            info = {}
        info = info if isinstance(info, dict) else {}
        heartbeat = info.get("heartbeat")
        return info, float(heartbeat) if isinstance(heartbeat, (int, float)) else 0.0

    def _read(self, path=None) -> tuple[dict, float] | None:
        data, _generation = self._gcs.read_versioned(self.path)
        return None if data is None else self._parse(data)

    def _payload(self) -> bytes:
        return json.dumps({**self.info, "heartbeat": time.time()}).encode("utf-8")

    def acquire(self) -> None:
        for _attempt in range(5):
            data, generation = self._gcs.read_versioned(self.path)
            previous = None
            if data is not None:
                info, heartbeat = self._parse(data)
                if info.get("token") != self.token and not self._stale(info, heartbeat):
                    raise LockHeld(self.holder_line(info, heartbeat))
                previous = info if info.get("token") != self.token else None
            written = self._gcs.write_if(self.path, self._payload(), generation)
            if written is not None:
                self._generation, self.took_over = written, previous
                self._held, self._lost = True, False
                _HELD_TOKENS.add(self.token)
                return
            # Another trainer wrote between our read and our write: read again.
        found = self._read()
        raise LockHeld(self.holder_line(*found) if found else
                       f"{self.description}: could not take the lock {self.path}; try again")

    def _still_ours(self) -> bool:
        return self._held and not self._lost

    def refresh(self) -> None:
        if not self._still_ours():
            return
        written = self._gcs.write_if(self.path, self._payload(), self._generation)
        if written is None:
            self._lost = True  # the generation moved on: another trainer took the lock over
        else:
            self._generation = written

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        _HELD_TOKENS.discard(self.token)
        if not self._lost:
            self._gcs.delete_if(self.path, self._generation)


def _write_synced(path: Path, flags: int, data: bytes) -> None:
    """Open `path` with `flags`, write `data` whole and fsync it."""
    fd = os.open(path, flags, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def phase_lock(folder: str | os.PathLike, *, description: str = "") -> PhaseLock:
    """The lock of one run phase folder: `GcsLease` on gs://, else `LocalLock`."""
    from smelt_jax.platform import storage
    if storage.is_gcs(folder):
        return GcsLease(str(folder), description=description)
    return LocalLock(folder, description=description)


@contextlib.contextmanager
def holding(lock: PhaseLock, heartbeat_every: float = HEARTBEAT_SECONDS) -> Iterator[PhaseLock]:
    """Acquire `lock`, refresh it from a daemon thread every `heartbeat_every` s, release on exit."""
    lock.acquire()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_every):
            with contextlib.suppress(OSError):
                lock.refresh()

    thread = threading.Thread(target=beat, name="smelt-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield lock
    finally:
        stop.set()
        thread.join(timeout=5)
        lock.release()

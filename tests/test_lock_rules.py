"""Issue 27 item 8: the trainer lock is written whole or not at all (a full disk leaves no empty
trainer.lock), its refusal states the stale rule that applies to the lock it found (30 s for an
unreadable lock, the heartbeat rule otherwise), and this process's own pid is not a live holder unless
the lock is one this process holds (a restarted container's trainer is pid 1 again)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smelt_jax.train import lock as lock_lib
from smelt_jax.train.lock import LOCK_NAME, UNREADABLE_STALE_SECONDS, LocalLock, LockHeld

REPO = Path(__file__).resolve().parents[1]


def test_a_failed_write_leaves_no_lock_file(tmp_path, monkeypatch):
    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(lock_lib.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        LocalLock(tmp_path).acquire()
    assert list(tmp_path.iterdir()) == []  # neither trainer.lock nor a temporary file
    monkeypatch.undo()
    lock = LocalLock(tmp_path)
    lock.acquire()  # nothing to take over
    assert lock.took_over is None
    lock.release()


def test_without_hard_links_a_failed_write_still_leaves_no_lock_file(tmp_path, monkeypatch):
    def no_links(*_args):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(lock_lib.os, "link", no_links)
    lock = LocalLock(tmp_path)
    lock.acquire()  # the O_EXCL fallback
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    with pytest.raises(LockHeld):
        LocalLock(tmp_path).acquire()
    lock.release()
    monkeypatch.setattr(lock_lib.os, "fsync",
                        lambda _fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(OSError):
        LocalLock(tmp_path).acquire()
    assert list(tmp_path.iterdir()) == []


_FULL_DISK = """
import sys
sys.path.insert(0, {repo!r})
from smelt_jax.train.lock import LocalLock
try:
    LocalLock({folder!r}).acquire()
except OSError as err:
    print("refused", err.errno)
"""


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_a_full_disk_at_start_leaves_no_empty_lock(tmp_path):
    """A real full file system: a 4 kB tmpfs filled to the last byte."""
    folder = tmp_path / "phase"
    folder.mkdir()
    script = tmp_path / "take.py"
    script.write_text(_FULL_DISK.format(repo=str(REPO), folder=str(folder)))
    shell = (f"mount -t tmpfs -o size=4k none {folder} && "
             f"(dd if=/dev/zero of={folder}/fill bs=1k count=64 2>/dev/null; true) && "
             f"{sys.executable} {script} && ls -a {folder}")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"refused {errno.ENOSPC}" in result.stdout, result.stdout + result.stderr
    listed = result.stdout.split()
    assert LOCK_NAME not in listed and not any(n.startswith(LOCK_NAME) for n in listed), listed


def test_an_unreadable_lock_is_refused_with_the_30_second_rule(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(LockHeld) as err:
        LocalLock(tmp_path, stale_after=300).acquire()
    line = str(err.value)
    assert f"{UNREADABLE_STALE_SECONDS:.0f} s" in line and "300 s" not in line and "\n" not in line
    (tmp_path / LOCK_NAME).write_text("{garbage")
    with pytest.raises(LockHeld, match=f"after {UNREADABLE_STALE_SECONDS:.0f} s"):
        LocalLock(tmp_path, stale_after=300).acquire()
    past = time.time() - UNREADABLE_STALE_SECONDS - 1
    os.utime(tmp_path / LOCK_NAME, (past, past))
    lock = LocalLock(tmp_path, stale_after=300)
    lock.acquire()  # 31 s: taken over, as the message said
    lock.release()


def test_a_live_holder_is_refused_with_the_heartbeat_rule(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "t"}))
    with pytest.raises(LockHeld) as err:
        LocalLock(tmp_path, stale_after=300).acquire()
    assert "300 s" in str(err.value) and "30 s" not in str(err.value)


def test_our_own_pid_in_a_lock_we_do_not_hold_is_stale(tmp_path):
    """A container restarted: its trainer is pid 1 again, on the same host name, and the lock the
    killed one left names pid 1. Here: our pid, a fresh heartbeat, a token no lock of ours holds."""
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "token": "previous-life"}))
    lock = LocalLock(tmp_path, stale_after=3600)
    lock.acquire()
    assert lock.took_over["token"] == "previous-life"
    lock.release()


def test_a_lock_this_process_holds_still_refuses_a_second_holder(tmp_path):
    first = LocalLock(tmp_path, stale_after=3600)
    first.acquire()
    with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
        LocalLock(tmp_path, stale_after=3600).acquire()
    first.release()

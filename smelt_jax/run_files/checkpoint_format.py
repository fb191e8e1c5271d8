"""The checkpoint format on disk, and the one judgement of a checkpoint step: committed, whole, damaged,
or not readable right now. No JAX: the trainer (through `smelt_jax.train.checkpoint`), the sweep graph
and evaluation all read checkpoints through this module.

    <phase>/checkpoints/<step>/                   a committed orbax step: items `state`, `metadata`
    <phase>/checkpoints/<step>/_CHECKPOINT_METADATA   orbax's commit file (local)
    <phase>/checkpoints/<step>/commit_success.txt     orbax's commit marker on Cloud Storage
    <phase>/checkpoints/<step>/smelt_checksums.json   {"version": 2, "files": {name: {sha256, size}}}
    <phase>/checkpoints/<step>.orbax-checkpoint-tmp*  a save that never committed (local only)
    <phase>/checkpoints/<step>.damaged[.n]/           a damaged step the trainer moved aside (kept)

A step's `metadata` item (`<step>/metadata/metadata`, read without JAX by `step_metadata`) is a JSON
dict holding at least `step` and `data_step` (the data position), and from the trainer `run_id`,
`branch`, `data_digest` and `tokenizer_sha256` (the token store's digest and its tokenizer's sha256:
`smelt_jax.run_files.run_data`; absent in older checkpoints); its `state` item holds the arrays (`params`,
`opt_state`). Checkpoints written before the trainer kept
one `TrainState` have this same layout: they restore unchanged.

Locally orbax commits a step by renaming its temporary folder, so a plain integer folder name means
committed; every committed step the trainer wrote also has a checksum file (sha256 and size of each
file). On gs:// orbax writes a step in place and commits it with `commit_success.txt`; no checksums are
written there (Cloud Storage checks each object's CRC32C).

Failures to read a step are of two kinds, and only the first one moves a step aside:
- integrity (`damage`): a file missing, truncated or changed since the save, a checksum file that does
  not parse, a step orbax cannot decode;
- access (`CheckpointAccessError`): permissions, credentials, or a storage error that persisted after
  `TRANSIENT_RETRIES` retries `RETRY_DELAYS` seconds apart (7 s in all). Nothing is moved: the run stops
  with one line and resumes unchanged once access is back.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from pathlib import Path

from smelt_jax.platform import storage
from smelt_jax.platform.errors import SmeltError

CHECKSUM_FILE = "smelt_checksums.json"
DAMAGED_SUFFIX = ".damaged"
ORBAX_COMMIT_FILE = "_CHECKPOINT_METADATA"
GCS_COMMIT_FILE = "commit_success.txt"
_ORBAX_TMP = re.compile(r"\.orbax-checkpoint-tmp")

TRANSIENT_RETRIES = 3
RETRY_DELAYS = (1.0, 2.0, 4.0)  # seconds before retry 1, 2, 3

_ACCESS_ERRNOS = {errno.EACCES, errno.EPERM}
_TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN, errno.EINTR}
# Status codes in tensorstore's and Cloud Storage clients' messages.
_ACCESS_WORDS = ("PERMISSION_DENIED", "UNAUTHENTICATED", "Permission denied", "403 Forbidden",
                 "401 Unauthorized", "DefaultCredentialsError", "RefreshError")
_TRANSIENT_WORDS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "503 Service Unavailable",
                    "429 Too Many Requests", "Connection reset", "timed out")


class CheckpointAccessError(SmeltError, RuntimeError):
    """A checkpoint could not be read for a reason that is not damage (permissions, credentials, a
    storage error that persisted): nothing is moved aside; fix access and run again (one line, exit 2)."""


# Judging one read error --------------------------------------------------------------------------------

def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def failure_kind(err: BaseException) -> str:
    """'access', 'transient' or 'integrity' for an error raised while reading a checkpoint step. Read
    from the exception chain: OS error numbers first, then the status words of tensorstore and Cloud
    Storage messages; everything else (decode errors, missing files) is integrity."""
    for link in _chain(err):
        if isinstance(link, CheckpointAccessError):
            return "access"
        if isinstance(link, FileNotFoundError):
            return "integrity"
        if isinstance(link, PermissionError) or (isinstance(link, OSError) and link.errno in _ACCESS_ERRNOS):
            return "access"
        if isinstance(link, (TimeoutError, ConnectionError)) or (
                isinstance(link, OSError) and link.errno in _TRANSIENT_ERRNOS):
            return "transient"
    text = " ".join(f"{type(link).__name__}: {link}" for link in _chain(err))
    if any(word in text for word in _ACCESS_WORDS):
        return "access"
    if any(word in text for word in _TRANSIENT_WORDS):
        return "transient"
    return "integrity"


def read_retrying(read, what: str):
    """`read()`, retried on transient errors (`TRANSIENT_RETRIES` times, `RETRY_DELAYS` apart). An access
    error, or a transient one that outlasts the retries, raises CheckpointAccessError naming `what`; an
    integrity error propagates unchanged (the caller decides about damage)."""
    for attempt in range(TRANSIENT_RETRIES + 1):
        try:
            return read()
        except CheckpointAccessError:
            raise
        except Exception as err:  # noqa: BLE001 — judged below; integrity errors propagate
            kind = failure_kind(err)
            if kind == "integrity":
                raise
            if kind == "transient" and attempt < TRANSIENT_RETRIES:
                time.sleep(RETRY_DELAYS[attempt])
                continue
            tries = f" (after {attempt + 1} tries)" if kind == "transient" else ""
            raise CheckpointAccessError(
                f"cannot read {what}{tries}: {_short(err)}; nothing was moved aside: fix access "
                "(permissions, credentials, storage) and run again") from err
    raise AssertionError("unreachable")


def _short(err: BaseException, limit: int = 240) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[:limit] + "..."


# Listing steps -----------------------------------------------------------------------------------------

def _remote_files(checkpoint_dir) -> list[str]:
    """Paths relative to a gs:// checkpoint folder of every object under it."""
    base = str(checkpoint_dir).rstrip("/") + "/"
    return [url[len(base):] for url in storage.list_files(base)]


def committed_steps(checkpoint_dir) -> list[int]:
    """Steps whose checkpoint is committed: a plain integer folder name locally (orbax renames its
    temporary folder only once every file is written), a `<step>/commit_success.txt` on gs://."""
    if storage.is_gcs(checkpoint_dir):
        return sorted({int(name.split("/")[0]) for name in _remote_files(checkpoint_dir)
                       if name.count("/") == 1 and name.endswith("/" + GCS_COMMIT_FILE)
                       and name.split("/")[0].isdigit()})
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoint_dir.iterdir()
                  if p.is_dir() and p.name.isdigit() and not _ORBAX_TMP.search(p.name))


def checkpoint_committed(checkpoint_dir, step: int) -> bool:
    return step in committed_steps(checkpoint_dir)


def temporary_checkpoints(checkpoint_dir) -> list[Path]:
    """Orbax's temporary folders (`<step>.orbax-checkpoint-tmp*`): saves that never committed (none on
    gs://, where orbax writes in place)."""
    if storage.is_gcs(checkpoint_dir) or not Path(checkpoint_dir).is_dir():
        return []
    return sorted(p for p in Path(checkpoint_dir).iterdir() if _ORBAX_TMP.search(p.name))


def damaged_checkpoints(checkpoint_dir) -> list[Path]:
    """Checkpoints the trainer moved aside (`<step>.damaged[.n]`)."""
    if storage.is_gcs(checkpoint_dir):
        return sorted({storage.as_path(str(checkpoint_dir).rstrip("/") + "/" + name.split("/")[0])
                       for name in _remote_files(checkpoint_dir)
                       if DAMAGED_SUFFIX in name.split("/")[0]}, key=str)
    if not Path(checkpoint_dir).is_dir():
        return []
    return sorted(p for p in Path(checkpoint_dir).iterdir() if DAMAGED_SUFFIX in p.name)


METADATA_FILE = "metadata/metadata"  # orbax's file of the `metadata` item (JsonSave)


def step_metadata(checkpoint_dir, step: int) -> dict | None:
    """The `metadata` item of a committed step as a dict; None when it has none or it does not parse."""
    try:
        data = json.loads(storage.read_text(storage.join(checkpoint_dir, str(step), METADATA_FILE)))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


# Checksums ---------------------------------------------------------------------------------------------

def file_digests(step_dir) -> dict[str, dict]:
    """{relative path: {"sha256", "size"}} of every file of a local step (the checksum file excluded)."""
    step_dir = Path(step_dir)
    out = {}
    for path in sorted(p for p in step_dir.rglob("*")
                       if p.is_file() and not p.name.startswith(CHECKSUM_FILE)):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
        out[path.relative_to(step_dir).as_posix()] = {"sha256": digest.hexdigest(),
                                                      "size": path.stat().st_size}
    return out


def seal(step_dir) -> None:
    """Write the step's checksum file (atomically: a temporary file renamed into place); nothing when
    it has one already."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir() or (step_dir / CHECKSUM_FILE).exists():
        return
    import tempfile
    digests = json.dumps({"version": 2, "files": file_digests(step_dir)}, indent=0, sort_keys=True)
    handle, temp = tempfile.mkstemp(prefix=CHECKSUM_FILE, suffix=".tmp", dir=step_dir)
    with os.fdopen(handle, "w") as out:
        out.write(digests)
    os.replace(temp, step_dir / CHECKSUM_FILE)


def recorded_files(step_dir) -> dict[str, dict] | None:
    """{relative path: {"sha256", "size" (None in old files)}} from a step's checksum file; None when
    the step has none (not sealed; always on gs://) or it does not parse. A checksum file that exists but
    cannot be read for lack of access raises CheckpointAccessError."""
    if storage.is_gcs(step_dir):
        return None
    try:
        text = (Path(step_dir) / CHECKSUM_FILE).read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        if failure_kind(err) != "integrity":
            raise CheckpointAccessError(f"cannot read {Path(step_dir) / CHECKSUM_FILE}: {_short(err)}; "
                                        "nothing was moved aside") from err
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    files = data.get("files") if isinstance(data, dict) and "files" in data else data
    if not isinstance(files, dict):
        return None
    return {name: (value if isinstance(value, dict) else {"sha256": value, "size": None})
            for name, value in files.items()}


def checkpoint_damage(checkpoint_dir, step: int) -> str | None:
    """Why the committed checkpoint at `step` is damaged, or None if it looks whole. Cheap (no file is
    read but the checksum file): orbax's commit file must exist, and every file the checksum file records
    must exist with its recorded size. An access error (a folder that cannot be listed) raises
    CheckpointAccessError: it is not damage."""
    if storage.is_gcs(checkpoint_dir):  # no checksums on gs://: committed or missing
        return None if step in committed_steps(checkpoint_dir) else "missing"
    step_dir = Path(checkpoint_dir) / str(step)
    if not step_dir.is_dir():
        return "missing"
    recorded = recorded_files(step_dir)
    if recorded is None:
        if (step_dir / CHECKSUM_FILE).exists():
            return f"its {CHECKSUM_FILE} is unreadable"
        return None  # not sealed (or not written by the trainer): only a restore can tell
    if not (step_dir / ORBAX_COMMIT_FILE).is_file() and ORBAX_COMMIT_FILE in recorded:
        return f"{ORBAX_COMMIT_FILE} is missing"
    problems = []
    for name, want in recorded.items():
        try:
            size = (step_dir / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} missing")
            continue
        except OSError as err:
            if failure_kind(err) == "integrity":
                problems.append(f"{name} missing")
                continue
            raise CheckpointAccessError(f"cannot read {step_dir / name}: {_short(err)}; nothing was "
                                        "moved aside") from err
        if want.get("size") is not None and size != want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} when saved")
    if problems:
        return "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    return None


def digest_damage(checkpoint_dir, step: int) -> str | None:
    """`checkpoint_damage`, then every recorded file's sha256 compared (reads the whole step): why the
    step is damaged, or None. Read errors propagate (the caller judges them with `failure_kind`)."""
    quick = checkpoint_damage(checkpoint_dir, step)
    if quick:
        return quick
    step_dir = Path(checkpoint_dir) / str(step)
    recorded = recorded_files(step_dir) if not storage.is_gcs(checkpoint_dir) else None
    if recorded is None:
        return None  # saved by another writer or not sealed yet: the restore itself is the check
    actual = file_digests(step_dir)
    bad = sorted(name for name, want in recorded.items()
                 if actual.get(name, {}).get("sha256") != want["sha256"])
    return f"files missing or changed since the save: {bad[:5]}" if bad else None


def good_steps(checkpoint_dir) -> list[int]:
    """Committed steps that pass the cheap check of `checkpoint_damage`."""
    return [s for s in committed_steps(checkpoint_dir) if checkpoint_damage(checkpoint_dir, s) is None]


# Moving a damaged step aside ---------------------------------------------------------------------------

def move_aside(checkpoint_dir, step: int):
    """Rename the damaged `step` to `<step>.damaged` (`.damaged.1`, ... when taken); returns the new
    path. On gs:// (no rename) its objects are copied, the commit file first, then deleted, so a move cut
    short leaves an uncommitted step behind."""
    remote = storage.is_gcs(checkpoint_dir)
    base = storage.as_path(checkpoint_dir)
    source, target = base / str(step), base / f"{step}{DAMAGED_SUFFIX}"
    taken = {p.name for p in damaged_checkpoints(checkpoint_dir)} if remote else None
    n = 1
    while (target.name in taken) if remote else target.exists():
        target = base / f"{step}{DAMAGED_SUFFIX}.{n}"
        n += 1
    if remote:
        files = storage.list_files(str(source))
        files.sort(key=lambda url: not url.endswith("/" + GCS_COMMIT_FILE))
        for url in files:
            storage.write_bytes(str(target) + url[len(str(source)):], storage.read_bytes(url))
        for url in files:
            storage.delete(url)
    else:
        os.rename(source, target)
    return target

"""The one storage module: local paths and `gs://bucket/key` URLs (detection, read, write, exists,
listing, conditional writes), the gs:// side through tensorstore.

Which locations are supported is decided here: a local path, or `gs://`. Any other URL scheme
(`s3://`, `http://`, ...) is refused with one line (`UnsupportedLocation`) by `check`, `as_path` and
`normalize`, before anything is written (a `pathlib.Path` would turn `s3://b/x` into the local folder
`./s3:/b/x`).

Local paths use the file system directly (atomic writes: a temporary file renamed into place); `gs://`
URLs use tensorstore's `gcs` kvstore, the same client that writes the zarr arrays, so one set of
credentials and one setting (`TENSORSTORE_GCS_HTTP_URL` for an emulator) covers every byte.

Listing always goes through the bucket's root kvstore with a key range and is filtered again here:
some Cloud Storage emulators ignore the range parameters and return the whole bucket (a kvstore opened
*at* a prefix then mis-strips keys), and the extra filter makes the answer right either way.
Deletion is key by key, never `delete_range`, for the same reason.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import re
import tempfile
from pathlib import Path

from smelt_jax.platform.errors import MissingInput, SmeltError, UsageError

GCS_PREFIX = "gs://"
_WILDCARDS = "*?["
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class UnsupportedLocation(UsageError):
    """A URL whose scheme is neither a local path nor gs:// (one line, exit 2)."""


def is_gcs(url) -> bool:
    """True for a gs:// URL (the only remote scheme)."""
    return str(url).startswith(GCS_PREFIX)


def check(url) -> str:
    """`url` as text when it is a local path or a gs:// URL; UnsupportedLocation otherwise."""
    text = str(url)
    scheme = _SCHEME.match(text)
    if scheme and scheme.group(1) != "gs":
        raise UnsupportedLocation(f"{text!r}: unsupported location scheme {scheme.group(1)}://; use a "
                                  "local path or gs://BUCKET/PATH")
    return text


def as_path(path: str | os.PathLike) -> Path:
    """A local path as a `pathlib.Path`; a `gs://BUCKET/...` URL as an `etils.epath.Path`, which keeps
    the URL whole (a `pathlib.Path` would make it the local folder `gs:/BUCKET/...`). Joining and
    `str()` need no I/O; reading and writing a gs:// path goes through this module. Other schemes:
    UnsupportedLocation."""
    text = check(path)
    if is_gcs(text):
        from etils import epath
        return epath.Path(text)
    return Path(path)


def require_folder(url, what: str = "folder") -> None:
    """A folder argument checked: an unsupported scheme, or a local path that exists but is a file,
    is refused with one line (UsageError); gs:// prefixes and folders not made yet pass."""
    check(url)
    if not is_gcs(url) and Path(url).exists() and not Path(url).is_dir():
        raise UsageError(f"{what} {str(url)!r} is a file, not a folder")


def split_gcs(url: str) -> tuple[str, str]:
    """`gs://bucket/a/b` -> ("bucket", "a/b")."""
    rest = str(url)[len(GCS_PREFIX):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UsageError(f"{url!r} names no bucket (expected gs://BUCKET/PATH)")
    return bucket, key


def normalize(url) -> str:
    """A local path made absolute, or a gs:// URL without a trailing slash."""
    text = check(url)
    if is_gcs(text):
        return text.rstrip("/") if text.count("/") > 2 else text
    return str(Path(text).expanduser().absolute())


def join(base, *parts: str) -> str:
    text = str(base)
    if is_gcs(text):
        for part in parts:
            text = text.rstrip("/") + "/" + str(part).lstrip("/")
        return text
    return str(Path(text, *parts))


def basename(url) -> str:
    return str(url).rstrip("/").rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=None)
def _bucket(bucket: str):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()


class Unreachable(SmeltError, ConnectionError):
    """A gs:// location that cannot be reached (network, an emulator not running, credentials, a bad
    bucket name): one line with the cause, after PROBE_RETRIES tries (`check_reachable`)."""


PROBE_RETRIES = 3                  # tries of the probe's one request (tensorstore's retry loop)
PROBE_TIMEOUT_SECONDS = 30.0       # and its wall-clock bound, whatever the retries do
PROBE_KEY = ".smelt-reachable"     # an object name nobody writes: the read answers "missing" when all is well


def check_reachable(url, what: str = "runs root") -> None:
    """Nothing for a local path or a gs:// URL that answers; Unreachable (one line naming `url` and the
    cause) when a read under it fails after PROBE_RETRIES tries or PROBE_TIMEOUT_SECONDS. Commands call it
    before they start on a gs:// runs root, so an unreachable bucket fails in seconds, not after the
    minutes of retries (tensorstore, gcsfs) that the reads themselves would make."""
    text = check(url)
    if not is_gcs(text):
        return
    import tensorstore as ts

    bucket, key = split_gcs(text)
    retries = {"max_retries": PROBE_RETRIES, "initial_delay": "0.2s", "max_delay": "2s"}
    try:
        store = ts.KvStore.open({"driver": "gcs", "bucket": bucket,
                                 "context": {"gcs_request_retries": retries}}).result()
        store.read(join(key, PROBE_KEY) if key else PROBE_KEY).result(timeout=PROBE_TIMEOUT_SECONDS)
    except TimeoutError:
        raise Unreachable(f"cannot reach the {what} {text}: no answer in {PROBE_TIMEOUT_SECONDS:g} s "
                          "(network, credentials, or TENSORSTORE_GCS_HTTP_URL)") from None
    except ValueError as err:
        cause = " ".join(str(err).split())
        cause = cause if len(cause) <= 200 else cause[:200] + "..."
        raise Unreachable(f"cannot reach the {what} {text}: {cause}") from None


def kvstore_spec(url) -> dict:
    """A tensorstore kvstore spec for a directory (local or gs://): what `zarr3` specs nest."""
    text = str(url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        return {"driver": "gcs", "bucket": bucket, "path": key.rstrip("/") + "/" if key else ""}
    return {"driver": "file", "path": normalize(text).rstrip("/") + "/"}


def read_bytes(url) -> bytes:
    """The whole object; FileNotFoundError when it does not exist."""
    text = str(url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        result = _bucket(bucket).read(key).result()
        if result.state != "value":
            raise MissingInput(f"no object {text}")
        return bytes(result.value)
    with open(text, "rb") as handle:
        return handle.read()


def write_bytes(url, data: bytes) -> None:
    """Write an object whole (local: into a temporary file renamed into place)."""
    text = str(url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        _bucket(bucket).write(key, bytes(data)).result()
        return
    path = Path(text)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def tensorstore_os_error(err: BaseException) -> OSError | None:
    """tensorstore reports a failed file access as a ValueError whose text ends in
    `[os_error_code='28']` and names the file: that as an OSError (errno, reason, file), else None."""
    text = " ".join(str(err).split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code is None:
        return None
    where = re.search(r'(?:local file|Failed writing:|Failed reading:) "([^"]+)"', text)
    return OSError(int(code.group(1)), os.strerror(int(code.group(1))), where.group(1) if where else None)


@contextlib.contextmanager
def naming(path):
    """An OSError raised inside without a file name (a full disk during `write()`: "No space left on
    device") gets `path` as its file name, so the one-line error says where."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None and err.strerror:
            err.filename = str(path)
        raise


def write_json(url, data) -> None:
    """`data` as indented, key-sorted JSON, written whole (`write_bytes`)."""
    import json
    write_text(url, json.dumps(data, indent=1, sort_keys=True))


def read_text(url) -> str:
    return read_bytes(url).decode("utf-8")


def write_text(url, text: str) -> None:
    write_bytes(url, text.encode("utf-8"))


def exists(url) -> bool:
    text = str(url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        return _bucket(bucket).read(key).result().state == "value"
    return os.path.isfile(text)


def delete(url) -> None:
    """Remove one object or file (nothing when absent)."""
    text = str(url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        del _bucket(bucket)[key]
        return
    try:
        os.unlink(text)
    except FileNotFoundError:
        pass


# Conditional operations (compare-and-swap on an object's generation) ---------------------------------
@functools.lru_cache(maxsize=None)
def _folder(path: str):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "file", "path": path.rstrip("/") + "/"}).result()


def _store_and_key(url) -> tuple[object, str]:
    """The kvstore and key of `url`: the bucket's `gcs` kvstore on gs://, tensorstore's `file` kvstore of
    the parent folder on a local path (it implements the same generation conditions, with lock files)."""
    text = str(url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        return _bucket(bucket), key
    path = Path(normalize(text))
    path.parent.mkdir(parents=True, exist_ok=True)
    return _folder(str(path.parent)), path.name


def read_versioned(url) -> tuple[bytes | None, bytes]:
    """(the object's bytes, or None when absent; its generation). The generation is an opaque token for
    `write_if` / `delete_if`; that of an absent object means "still absent"."""
    store, key = _store_and_key(url)
    result = store.read(key).result()
    return (bytes(result.value) if result.state == "value" else None), bytes(result.stamp.generation)


def write_if(url, data: bytes, generation: bytes) -> bytes | None:
    """Write `data` only if the object still has `generation` (from `read_versioned`; an absent object's
    generation: create only if still absent). Returns the new generation, or None when the object
    changed meanwhile and nothing was written. On Cloud Storage this is the `ifGenerationMatch`
    precondition, decided by the server."""
    store, key = _store_and_key(url)
    stamp = store.write(key, bytes(data), if_equal=generation).result()
    return bytes(stamp.generation) or None


def delete_if(url, generation: bytes) -> bool:
    """Delete the object only if it still has `generation`; True when it was deleted."""
    store, key = _store_and_key(url)
    return bool(store.write(key, None, if_equal=generation).result().generation)


def _successor(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ""


def list_gcs_starting(url: str) -> list[str]:
    """Every object whose gs:// URL starts with `url` (a key prefix, not only a folder: `gs://b/runs/ab`
    finds `gs://b/runs/abc/x` and `gs://b/runs/ab/y`), sorted. One listing of that key range."""
    import tensorstore as ts

    bucket, prefix = split_gcs(url)
    keys = _bucket(bucket).list(ts.KvStore.KeyRange(prefix, _successor(prefix))).result()
    return [f"{GCS_PREFIX}{bucket}/{name}" for name in sorted(k.decode() for k in keys)
            if name.startswith(prefix)]


def list_files(prefix_url) -> list[str]:
    """Every file under a directory (recursively), as full paths / URLs, sorted."""
    text = str(prefix_url)
    if is_gcs(text):
        bucket, key = split_gcs(text)
        return list_gcs_starting(f"{GCS_PREFIX}{bucket}/" + (key.rstrip("/") + "/" if key else ""))
    root = Path(text)
    if not root.is_dir():
        return []
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def delete_tree(prefix_url) -> int:
    """Delete every file under a directory; returns how many."""
    files = list_files(prefix_url)
    for name in files:
        delete(name)
    if not is_gcs(prefix_url) and Path(prefix_url).is_dir():
        import shutil

        shutil.rmtree(prefix_url, ignore_errors=True)
    return len(files)


def expand(patterns, suffixes: tuple[str, ...] = ()) -> list[str]:
    """Paths / globs / gs:// patterns -> sorted, distinct files.

    A pattern with `*`, `?` or `[` matches files (for gs://, `*` also crosses `/`); a plain name is
    that file, or, when it is a directory (a gs:// prefix), every file under it whose name ends with one
    of `suffixes`. A pattern that matches nothing raises FileNotFoundError.
    """
    found: set[str] = set()
    for pattern in patterns:
        text = str(pattern)
        matches: list[str]
        if any(c in text for c in _WILDCARDS):
            if is_gcs(text):
                head = text[:min(text.index(c) for c in _WILDCARDS if c in text)]
                directory = head[:head.rfind("/") + 1]
                matches = [u for u in list_files(directory) if fnmatch.fnmatchcase(u, text)]
            else:
                import glob

                matches = [normalize(p) for p in glob.glob(os.path.expanduser(text), recursive=True)
                           if os.path.isfile(p)]
        elif is_gcs(text) and exists(text):
            matches = [text]
        elif not is_gcs(text) and os.path.isfile(text):
            matches = [normalize(text)]
        else:
            matches = [u for u in list_files(text) if not suffixes or u.endswith(suffixes)]
        if not matches:
            raise MissingInput(f"no input files match {text!r} (check the path; quote globs)")
        found.update(matches)
    return sorted(found)

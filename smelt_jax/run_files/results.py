"""The results store: one row per finished endpoint, in a parquet table with a CSV export.

Every endpoint (a decay branch's end) appends one row. Writers may be several processes at once (a sweep
running jobs side by side), so an append holds an exclusive `fcntl.flock` on `results.lock`, reads the
table, replaces any row of the same (run_id, branch) — re-appending an endpoint updates it instead of
duplicating it — and writes the new table to a temporary file that `os.replace` puts in place. A reader
therefore sees the old table or the new one, never half a row, and a crash mid-write leaves the old table.
The parquet file is the source of truth; the CSV is rewritten from it on every append and by
`rewrite_csv` (which `smelt results collect` calls), so a damaged or stale CSV never outlives a collect.
A table that does not parse (`ResultsDamaged`) is never silently replaced by a reader: readers
report it in one line; an endpoint's append and `smelt results collect` (`set_aside_damaged`) rename
it `results.parquet.damaged-<UTC time>` and start a new table, which collect fills from the endpoint
files. A reader of a folder it cannot write reads without the lock (a read-only mount).
The files get the permissions of any new file (0666 less the umask: group-readable under the usual
022 umask), not mkstemp's private 0600.

A folder on Cloud Storage (`gs://...`, through `smelt_jax.platform.storage`) has no file lock: an append reads
the table object, replaces the row and writes the parquet and CSV objects whole (each object write is
atomic, so a reader never sees half a table). Two endpoints appending at the same instant can lose one
row (the later write wins); every endpoint also writes its row to its `endpoint.json`, from which
`smelt results collect` rebuilds the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pandas as pd

from smelt_jax.platform.errors import SmeltError, UsageError

TABLE_NAME = "results.parquet"
CSV_NAME = "results.csv"
LOCK_NAME = "results.lock"
KEY = ("run_id", "branch")
LOSS_PREFIX = "loss_"


class ResultsDamaged(SmeltError, ValueError):
    """results.parquet does not parse (truncated, zero bytes, overwritten): `smelt results collect`
    rebuilds it from the endpoint files."""


def _parse(source, where) -> pd.DataFrame:
    """pd.read_parquet of a path or a file object; a table that does not parse is ResultsDamaged. An
    error with an errno (permission, I/O, a missing mount) is not damage: it propagates as it is."""
    import pyarrow as pa
    try:
        return pd.read_parquet(source)
    except (pa.lib.ArrowException, OSError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise
        raise ResultsDamaged(f"{where} is damaged ({str(err).splitlines()[0]}); `smelt results collect` "
                             "rebuilds it from the endpoint files") from None


@dataclasses.dataclass(frozen=True)
class EndpointResult:
    """One finished endpoint. `losses_by_source` become columns `loss_<source>`."""

    run_id: str
    branch: int
    pair_id: str
    suite: str
    arch: str  # "baseline" or "smelt"
    scale: str  # "100M", "200M", ...
    sparsity_label: str  # "S0", "S85", ...
    sparsity: float  # compute-equivalent sparsity S in [0, 1)
    flops_per_token: float  # training FLOPs per token F
    params: int
    tokens: int  # training tokens D at the endpoint
    cumulative_flops: float
    val_loss: float
    losses_by_source: Mapping[str, float] = dataclasses.field(default_factory=dict)
    git_commit: str = ""
    time: str = ""  # ISO 8601 UTC; filled at append when empty
    # Where the run came from (`run_lookup.run_origin`): "grid" (its suite's own run), "override" (a suite
    # run changed by --override), "config" (a config file's); "" in rows written before it was recorded.
    origin: str = ""

    def __post_init__(self) -> None:
        if not self.run_id or not isinstance(self.run_id, str):
            raise UsageError(f"run_id must be a non-empty string, got {self.run_id!r}")
        if not isinstance(self.branch, int) or self.branch < 0:
            raise UsageError(f"branch must be a non-negative integer, got {self.branch!r}")
        if not 0 <= self.sparsity < 1:
            raise UsageError(f"sparsity must lie in [0, 1), got {self.sparsity}")
        losses = {"val_loss": self.val_loss, **{f"{LOSS_PREFIX}{k}": v for k, v in self.losses_by_source.items()}}
        for name, value in losses.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"{name} must be a finite number, got {value!r}")
        for source in self.losses_by_source:
            if not str(source).isidentifier():
                raise UsageError(f"source name {source!r} must be an identifier (it names a column)")
        for name in ("flops_per_token", "params", "tokens", "cumulative_flops"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")

    def to_row(self) -> dict:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "losses_by_source"}
        row.update({f"{LOSS_PREFIX}{k}": float(v) for k, v in sorted(self.losses_by_source.items())})
        row["params"], row["tokens"] = int(self.params), int(self.tokens)
        for name in ("sparsity", "flops_per_token", "cumulative_flops", "val_loss"):
            row[name] = float(row[name])
        return row


FIXED_COLUMNS = tuple(f.name for f in dataclasses.fields(EndpointResult) if f.name != "losses_by_source")


def git_commit(repo: str | os.PathLike | None = None) -> str:
    """HEAD of the repository holding this package (suffix '-dirty' with local changes), or 'unknown'."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def _locked(folder: Path, exclusive: bool) -> Iterator[None]:
    """The results lock. A reader of a folder it cannot write (a read-only mount, another user's
    runs) reads without it: the table is only ever replaced by a rename, so it sees a whole table."""
    if exclusive:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        handle = open(folder / LOCK_NAME, "a+")
    except OSError as err:
        if exclusive or err.errno not in READ_ONLY_ERRNOS:
            raise
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _new_file_mode() -> int:
    """0666 less the process umask: the mode `open()` would give a new file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _replace_atomically(path: Path, write) -> None:
    """Write through `write(temp_path)` into a temporary sibling, fsync it, then rename it over `path`."""
    from smelt_jax.platform import storage as gcs

    with gcs.naming(path):
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        try:
            os.chmod(temp, _new_file_mode())
            write(temp)
            with open(temp, "rb") as written:
                os.fsync(written.fileno())
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.remove(temp)


def _order_columns(frame: pd.DataFrame) -> pd.DataFrame:
    losses = sorted(c for c in frame.columns if c.startswith(LOSS_PREFIX))
    others = [c for c in frame.columns if c not in FIXED_COLUMNS and c not in losses]
    return frame[[c for c in FIXED_COLUMNS if c in frame.columns] + losses + others]


def _is_gcs(folder) -> bool:
    from smelt_jax.platform.storage import is_gcs
    return is_gcs(folder)


def _folder(folder) -> Path | str:
    """A local folder as a Path; a gs:// folder as its URL (a Path would mangle the `//`). The folder of
    a suite's store is `rundir.results_dir(suite, root)`: there is no other default."""
    return str(folder).rstrip("/") if _is_gcs(folder) else Path(folder)


def _read_gcs_table(folder: str) -> pd.DataFrame:
    import io

    from smelt_jax.platform import storage as gcs
    try:
        data = gcs.read_bytes(f"{folder}/{TABLE_NAME}")
    except FileNotFoundError:
        return pd.DataFrame(columns=list(FIXED_COLUMNS))
    return _parse(io.BytesIO(data), f"{folder}/{TABLE_NAME}")


def _write_gcs_table(folder: str, table: pd.DataFrame, parquet: bool = True) -> None:
    import io

    from smelt_jax.platform import storage as gcs
    if parquet:
        buffer = io.BytesIO()
        table.to_parquet(buffer, index=False)
        gcs.write_bytes(f"{folder}/{TABLE_NAME}", buffer.getvalue())
    gcs.write_text(f"{folder}/{CSV_NAME}", table.to_csv(index=False))


def _read_table(folder: Path) -> pd.DataFrame:
    if _is_gcs(folder):
        return _read_gcs_table(str(folder))
    path = folder / TABLE_NAME
    if not path.exists():
        return pd.DataFrame(columns=list(FIXED_COLUMNS))
    if path.is_dir():  # pandas would read a folder as an empty dataset, and every append then fail
        raise ResultsDamaged(f"{path} is a folder, not the results table; `smelt results collect` sets it "
                             "aside and rebuilds the table from the endpoint files")
    return _parse(path, path)


def _set_aside(folder, err: ResultsDamaged, warn: bool = True):
    """Rename a damaged results.parquet `results.parquet.damaged-<UTC time>` (kept for inspection) and
    warn; the next write starts a new table (local callers hold the exclusive lock)."""
    import warnings
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if _is_gcs(folder):
        from smelt_jax.platform import storage as gcs
        aside = f"{folder}/{TABLE_NAME}.damaged-{stamp}"
        gcs.write_bytes(aside, gcs.read_bytes(f"{folder}/{TABLE_NAME}"))
        gcs.delete(f"{folder}/{TABLE_NAME}")
    else:
        aside = folder / f"{TABLE_NAME}.damaged-{stamp}"
        os.replace(folder / TABLE_NAME, aside)
    if warn:
        warnings.warn(f"{err}; set aside as {aside}", stacklevel=3)
    return aside


def _read_or_set_aside(folder) -> pd.DataFrame:
    """The table, or an empty one when it was damaged (set aside): an endpoint's append never fails on
    a damaged table, and the endpoint files hold every other row (`smelt results collect`)."""
    try:
        return _read_table(folder)
    except ResultsDamaged as err:
        _set_aside(folder, err)
        return pd.DataFrame(columns=list(FIXED_COLUMNS))


def set_aside_damaged(folder: str | os.PathLike):
    """If the folder's results.parquet is damaged, set it aside (see `_set_aside`) and return where it
    went; None when the table parses or is absent. `smelt results collect` then rebuilds the table."""
    folder = _folder(folder)
    if _is_gcs(folder):
        try:
            _read_table(folder)
        except ResultsDamaged as err:
            return _set_aside(folder, err, warn=False)
        return None
    if not (folder / TABLE_NAME).exists():
        return None
    with _locked(folder, exclusive=True):
        try:
            _read_table(folder)
        except ResultsDamaged as err:
            return _set_aside(folder, err, warn=False)
    return None


def append_result(result: EndpointResult, folder: str | os.PathLike) -> pd.DataFrame:
    """Add (or replace, by run_id and branch) `result`'s row; return the whole table as written."""
    folder = _folder(folder)
    row = result.to_row()
    if not row["time"]:
        row["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def updated(table: pd.DataFrame) -> pd.DataFrame:
        if len(table):
            same = (table["run_id"] == row["run_id"]) & (table["branch"] == row["branch"])
            table = table[~same]
        new = pd.DataFrame([row])
        table = new if not len(table) else pd.concat([table, new], ignore_index=True)
        return _order_columns(table).sort_values(list(KEY), kind="stable").reset_index(drop=True)

    if _is_gcs(folder):  # no lock on a bucket (module docstring)
        table = updated(_read_or_set_aside(folder))
        _write_gcs_table(folder, table)
        return table
    with _locked(folder, exclusive=True):
        table = updated(_read_or_set_aside(folder))
        _replace_atomically(folder / TABLE_NAME, lambda p: table.to_parquet(p, index=False))
        _replace_atomically(folder / CSV_NAME, lambda p: table.to_csv(p, index=False))
    return table


def rewrite_csv(folder: str | os.PathLike) -> bool:
    """Rewrite results.csv from results.parquet (the source of truth); False if there is no table."""
    folder = _folder(folder)
    if _is_gcs(folder):
        from smelt_jax.platform import storage as gcs
        if not gcs.exists(f"{folder}/{TABLE_NAME}"):
            return False
        _write_gcs_table(folder, _read_gcs_table(folder), parquet=False)
        return True
    if not (folder / TABLE_NAME).exists():
        return False
    with _locked(folder, exclusive=True):
        table = _read_table(folder)
        _replace_atomically(folder / CSV_NAME, lambda p: table.to_csv(p, index=False))
    return True


def read_results(folder: str | os.PathLike) -> pd.DataFrame:
    """The results table (one row per endpoint, sorted by run_id, branch); empty if none yet."""
    folder = _folder(folder)
    if _is_gcs(folder):
        return _read_gcs_table(folder)
    if not (folder / TABLE_NAME).exists():
        return pd.DataFrame(columns=list(FIXED_COLUMNS))
    with _locked(folder, exclusive=False):
        return _read_table(folder)

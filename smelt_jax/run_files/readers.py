"""Reading one item among many: the item, or a named reason it was skipped (issue 53).

Every command that walks many runs (`smelt results collect`, `sweep status`, `experiments list`, the
notebooks' loaders) reads each file through `read_item`, and each folder of a runs root through
`suite_folders`: a bad item (a file that is not UTF-8, a folder where a file should be, a damaged or
edited run.json, a folder that is not a suite) becomes a `Skipped` naming its path and why, and the
walk goes on. The command prints one line per skipped item and exits `exit_codes.SKIPPED`.

    load_item(path, load)         load(path), or Skipped(path, reason) (a folder, not UTF-8, refused)
    read_item(path, parse)        parse(text) of the file at `path`, or Skipped(path, reason)
    read_run_item(path, run_id)   the run.json record (run_spec_file.read_run_record), or Skipped;
                                  None when there is no run.json (a run not started)
    suite_folders(root)           (the suite folders of a local runs root, the foreign ones as Skipped)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from smelt_jax.platform import storage
from smelt_jax.platform.errors import SmeltError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Skipped:
    """An item left out: where it is and why (one line each)."""

    path: str
    reason: str
    counts: bool = True  # False: a note only (e.g. an empty foreign folder); the exit status stays 0

    def line(self) -> str:
        return f"skipped {self.path}: {self.reason}"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


def load_item(path, load: Callable[[str], T]) -> T | Skipped:
    """`load(path)` (a reader of the file at `path`, local or gs://), or Skipped naming `path` when it is
    a folder, not UTF-8, unreadable, or `load` refuses it (a SmeltError: the user's file is wrong; its
    one-line message is kept whole). FileNotFoundError passes: whether an absent file is an error is the
    caller's to say. Any other exception is a bug and passes too."""
    where = str(path)
    if not storage.is_gcs(where) and Path(where).is_dir():
        return Skipped(where, "a folder where a file should be; remove it")
    try:
        return load(where)
    except FileNotFoundError:
        raise
    except UnicodeDecodeError as err:
        return Skipped(where, f"not a UTF-8 text file (byte {err.start}); fix or delete it")
    except SmeltError as err:
        reason = " ".join(str(err).split())
        return Skipped(where, reason[len(where) + 2:] if reason.startswith(where + ": ") else reason)
    except OSError as err:
        return Skipped(where, f"cannot be read ({err.strerror or _one_line(err)})")


def read_item(path, parse: Callable[[str], T]) -> T | Skipped:
    """`parse(text)` of the UTF-8 file at `path` (`load_item`: the item, or Skipped naming the path)."""
    return load_item(path, lambda where: parse(storage.read_text(where)))


def read_run_item(path, run_id: str | None = None) -> dict | Skipped | None:
    """A run.json's record, checked to describe run `run_id` (`run_spec_file.read_run_record`), or
    Skipped with the one-line reason (damaged, edited, a folder, not UTF-8); None when it is absent."""
    from smelt_jax.run_files.run_spec_file import parse_run_record
    where = str(path)
    if not storage.is_gcs(where) and not Path(where).exists():
        return None
    try:
        return read_item(where, lambda text: parse_run_record(text, where, run_id))
    except FileNotFoundError:
        return None


def suite_folders(root) -> tuple[list[str], list[Skipped]]:
    """(the names of the suite folders of a local runs root, a Skipped per folder whose name cannot be
    a suite's: `lost+found`, `smoke-old`). A foreign folder is a note only (its `counts` False) unless
    it holds endpoint files, which would then be left out of the results. Hidden folders and files
    are passed over in silence."""
    from smelt_jax.run_files.path_names import check_name
    names, foreign = [], []
    for path in sorted(Path(root).iterdir()):
        if path.name.startswith(".") or not path.is_dir():
            continue
        try:
            check_name(path.name, "a suite")
        except SmeltError:
            try:
                held = any(path.glob("*/branch*/endpoint.json"))
            except OSError:  # e.g. lost+found: root's only
                held = False
            why = ("not a suite folder (a suite's name is lower-case letters, digits and dots); "
                   + ("its endpoint files are not collected: rename it to its suite's name" if held
                      else "left alone"))
            foreign.append(Skipped(str(path), why, counts=held))
            continue
        names.append(path.name)
    return names, foreign


def counted(skipped) -> bool:
    """Whether any of `skipped` is an item left out (not a note only): the exit status says so."""
    return any(item.counts for item in skipped)

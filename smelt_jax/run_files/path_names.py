"""The one check of every path component that comes from user input.

A suite, scale, sparsity label, arch or variant name (`RunSpec`, from a suite, a `--config` file or an
`--override`), a run id or id prefix, and a `--suite` name become folder names under the runs root
(`smelt_jax.run_files.rundir`); `--out` targets are the user's own files. Each goes through here, so a config file
cannot name a folder outside the runs root, and a bad name is one line (`UnsafeName`, exit 2) before
anything is written:

    check_name(value, what)        a name: lower-case letters, digits and dots, starting with a letter
                                   or digit, at most NAME_MAX characters (no `..`, `/`, NUL, empty)
    check_run_id(value, what)      a run id or id prefix: a name that may also hold `-`
    check_out_path(value, what)    a file the user names (`--out`): non-empty, no NUL, every component
                                   at most 255 bytes (absolute paths and `..` are the user's choice)
    check_inside(path, root, what) `path`, normalised, lies under `root` (a last guard before writing)
"""

from __future__ import annotations

import os
import posixpath
import re

from smelt_jax.design.config import ConfigError

NAME_MAX = 40  # a run id joins five names and a hash: 5 * 40 + 8 + 5 dashes stays under 255 bytes
RUN_ID_MAX = 5 * NAME_MAX + 8 + 5
COMPONENT_MAX = 255  # bytes of one folder or file name (NAME_MAX of ext4, xfs, GCS object parts)
_NAME = re.compile(r"[a-z0-9][a-z0-9.]*")
_RUN_ID = re.compile(r"[a-z0-9][a-z0-9.-]*")


class UnsafeName(ConfigError):
    """A name from user input that cannot be a folder or file name under the runs root."""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:50] + f"...' ({len(value)} characters)"


def _check(value, what: str, pattern: re.Pattern, limit: int, rule: str) -> str:
    if not isinstance(value, str):
        raise UnsafeName(f"{what}: expected a string, got {_shown(value)}")
    if not value:
        raise UnsafeName(f"{what} is empty; it must be {rule}")
    if len(value) > limit:
        raise UnsafeName(f"{what} {_shown(value)} is longer than {limit} characters")
    if not pattern.fullmatch(value) or ".." in value:
        raise UnsafeName(f"{what} {_shown(value)} must be {rule} (it names a folder under the runs root)")
    return value


def check_name(value, what: str, *, empty_ok: bool = False) -> str:
    """`value` if it is a safe name (lower-case letters, digits and dots, no `..`), else UnsafeName naming
    `what`; `empty_ok` lets "" through (an optional name: `RunSpec.variant`)."""
    if empty_ok and value == "":
        return value
    return _check(value, what, _NAME, NAME_MAX,
                  "lower-case letters, digits and dots, starting with a letter or digit")


def check_run_id(value, what: str = "run id") -> str:
    """`value` if it can be a run id or id prefix (a name that may also hold `-`), else UnsafeName."""
    return _check(value, what, _RUN_ID, RUN_ID_MAX,
                  "lower-case letters, digits, dots and dashes, starting with a letter or digit")


def check_out_path(value, what: str = "--out") -> str:
    """`value` if it can name a file to write: non-empty, no NUL, each component at most 255 bytes."""
    if not isinstance(value, str) or not value:
        raise UnsafeName(f"{what}: expected a file path, got {_shown(value)}")
    if "\0" in value:
        raise UnsafeName(f"{what} {_shown(value)} holds a NUL character")
    long = [part for part in value.split("/") if len(part.encode()) > COMPONENT_MAX]
    if long:
        raise UnsafeName(f"{what}: the name {_shown(long[0])} is longer than {COMPONENT_MAX} bytes")
    return value


def _normal(path) -> str:
    text = str(path)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        return f"{scheme}://{posixpath.normpath(rest)}"
    return os.path.normpath(os.path.abspath(text))


def check_inside(path, root, what: str):
    """`path` if it lies under `root` once both are normalised (lexically: a symlink the user placed
    under the runs root is honoured), else UnsafeName. Local paths and gs:// URLs alike."""
    inner, outer = _normal(path), _normal(root)
    if inner != outer and not inner.startswith(outer.rstrip("/") + "/"):
        raise UnsafeName(f"{what} {path} lies outside the runs root {root}; refused")
    return path


# The `smelt` arguments that name a path component or a file, and their check (`check_arguments`).
# "target" (eval, analyze) may be a run id or a folder: a file check. A new path-bearing option is added
# here; tests/test_path_names.py fails on a parser option of these names that is not. "file or ''": an
# output that '' skips (compile-report's layouts, cadence and ledger files, as their help says).
ARGUMENT_CHECKS = {"suite": "name", "id": "run id", "out": "file", "hlo_out": "file", "costs_out": "file",
                   "json_out": "file or ''", "cadence_out": "file or ''", "results_out": "file or ''",
                   "runs_dir": "file",
                   "data_dir": "file", "target": "file", "config": "file", "store": "file", "input": "file", "cache_dir": "file",
                   "corpus_dir": "file", "fit_dir": "file", "fits_dir": "file"}


def check_arguments(arguments: dict) -> None:
    """Every path-bearing argument of a parsed `smelt` command line (ARGUMENT_CHECKS) checked; UnsafeName
    (one line, exit 2) for the first bad one, before the command runs."""
    for name, kind in ARGUMENT_CHECKS.items():
        given = arguments.get(name)
        values = given if isinstance(given, (list, tuple)) else [given]  # nargs="+": each one checked
        flag = name if name in ("id", "target", "store", "fit_dir") else "--" + name.replace("_", "-")
        for value in values:
            if value is None or not isinstance(value, str):
                continue
            if kind == "name":
                check_name(value, flag)
            elif kind == "run id":
                check_run_id(value, flag)
            elif not (kind == "file or ''" and value == ""):  # '' skips that output (compile-report)
                check_out_path(value, flag)

"""The `smelt` command: a thin layer over library functions.

Each module in this package that defines `register(subparsers)` adds its subcommands; a handler
returns an exit code. A `SmeltError` (smelt_jax/platform/errors.py: the user's input was wrong) becomes one
line on stderr and exit code 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import importlib
import pkgutil
import sys
import warnings

from smelt_jax.platform.errors import SmeltError
from smelt_jax.platform.exit_codes import USER_ERROR
from smelt_jax.platform.fit_isa import FIT_COMMANDS, pin_this_process
from smelt_jax.platform.jax_platform import pin_cpu_without_accelerator


class CliError(SmeltError):
    """A user error reported as one line."""


# Filesystem errors a user can fix (read-only or full disk, no permission, a file where a folder
# should be): one line and exit 2 instead of a traceback.
USER_FS_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                  errno.EISDIR, errno.EEXIST, errno.ELOOP}  # ELOOP: a symlink loop (issue 53)
WRITE_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT}  # only a write fails so; the others: any access


def filesystem_errors(handler):
    """Decorator for CLI handlers: an OSError the user can fix becomes a one-line CliError."""
    @functools.wraps(handler)
    def wrapped(args) -> int:
        try:
            return handler(args)
        except OSError as err:
            if err.errno not in USER_FS_ERRNOS:
                raise
            where = f" {err.filename}" if err.filename else ""
            verb = "cannot write" if err.errno in WRITE_ERRNOS else "cannot access"
            raise CliError(f"{verb}{where}: {err.strerror or err}") from err
    return wrapped


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"smelt: warning: {message}\n"


@contextlib.contextmanager
def one_line_warnings():
    """Warnings print as `smelt: warning: ...` (one line) inside the block."""
    previous = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smelt", description="SMELT experiment suite: budgets, matching, training, sweeps, fits.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        if hasattr(module, "register"):
            module.register(subparsers)
    _describe_commands(parser)
    return parser


def _describe_commands(parser: argparse.ArgumentParser) -> None:
    """Every command has a description in its --help: its one-line help where none was written."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if not sub.description and helps.get(name):
                    sub.description = helps[name][:1].upper() + helps[name][1:] + "."
                _describe_commands(sub)


# Commands that start JAX on the local devices: JAX_PLATFORMS is checked against the devices present
# before they run (`compile` is left out: it compiles for TPUs it does not have, through libtpu).
JAX_COMMANDS = {"train", "eval", "analyze", "fit", "fit-suite", "fits-all", "gain", "tables", "demo"}
# Commands (and verbs) that read the runs root ($SMELT_RUNS_DIR or --runs-dir): a gs:// one is probed
# first (`sweep submit` is not: a dry run never reads it, and --submit refuses a placeholder root first).
RUNS_ROOT_COMMANDS = {"train", "eval", "analyze", "experiments", ("sweep", "status"), ("results", "collect"),
                      ("results", "export")}


def check_environment(command: str | None, args: argparse.Namespace | None = None) -> None:
    """Every outside value the command depends on, read through `smelt_jax.platform.env` and checked
    before it runs: EnvError or storage.Unreachable (one line) instead of a traceback later."""
    from smelt_jax.platform import env, storage
    env.lock_stale_seconds()
    root = (getattr(args, "runs_dir", None) if args is not None else None) or env.runs_dir()
    storage.check(root)
    if command in JAX_COMMANDS:
        env.check_jax_platforms()
    reads_root = command in RUNS_ROOT_COMMANDS or (command, getattr(args, "verb", None)) in RUNS_ROOT_COMMANDS
    if args is not None and reads_root and storage.is_gcs(root):
        storage.check_reachable(root)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given and given[0] in FIT_COMMANDS:
        pin_this_process()  # before NumPy and JAX load: the same bits on every CPU (smelt_jax/platform/fit_isa.py)
    try:
        check_environment(given[0] if given else None)  # before JAX (and libtpu) load
        pin_cpu_without_accelerator()
    except SmeltError as err:
        print(f"smelt: error: {err}", file=sys.stderr)
        return USER_ERROR
    import experiments  # noqa: F401 — the suites fill the library's registry (smelt_jax.design.suites)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return USER_ERROR
    try:
        from smelt_jax.run_files.path_names import check_arguments
        check_arguments(vars(args))  # every path-bearing argument, before the command runs
        check_environment(given[0], args)  # and the runs root it names, when that is gs://
        return int(args.handler(args) or 0)
    except SmeltError as err:  # the user's input was wrong: one line; anything else is a bug
        print(f"smelt: error: {err}", file=sys.stderr)
        return USER_ERROR
    except BrokenPipeError:
        return 0
    except RuntimeError as err:  # JAX could not start the backend JAX_PLATFORMS asked for: one line
        from smelt_jax.platform.env import jax_backend_problem
        problem = jax_backend_problem(err)
        if problem is None:
            raise
        print(f"smelt: error: {problem}", file=sys.stderr)
        return USER_ERROR


if __name__ == "__main__":
    sys.exit(main())

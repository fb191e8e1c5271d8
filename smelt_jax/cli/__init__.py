"""The `smelt` command: a thin layer over library functions.

Each module in this package that defines `register(subparsers)` adds its subcommands; a handler
returns an exit code. A `CliError` (or `ConfigError`, `KeyError` for unknown ids, `ValueError` for bad
input) becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from smelt_jax.config import ConfigError
from smelt_jax.platform import pin_cpu_without_accelerator


class CliError(Exception):
    """A user error reported as one line."""


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


def main(argv: list[str] | None = None) -> int:
    pin_cpu_without_accelerator()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (CliError, ConfigError, FileNotFoundError, ValueError) as err:
        print(f"smelt: error: {err}", file=sys.stderr)
        return 2
    except KeyError as err:
        print(f"smelt: error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

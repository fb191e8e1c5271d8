"""The CLI's surface: every command has a description, every flag a help text, one spelling per concept."""

from __future__ import annotations

import argparse

import pytest

from smelt_jax.cli import build_parser, main

# Concepts and the one spelling each has across commands (issue 13).
OLD_SPELLINGS = ("--root", "--corpus", "--dir", "--no-progress")


def _walk(parser: argparse.ArgumentParser, path: str):
    """(command path, parser, its non-help actions) for the parser and every sub-command below it."""
    actions = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            actions.append(action)
    yield path, parser, actions


COMMANDS = list(_walk(build_parser(), "smelt"))


def test_every_command_has_a_description_and_every_flag_a_help():
    no_description = [path for path, parser, _ in COMMANDS if not parser.description]
    no_help = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, _, actions in COMMANDS
               for a in actions if not a.help]
    assert not no_description, no_description
    assert not no_help, no_help


def test_one_spelling_per_concept():
    used = {option for _, _, actions in COMMANDS for a in actions for option in a.option_strings}
    assert not used & set(OLD_SPELLINGS), sorted(used & set(OLD_SPELLINGS))
    runs_root = {path for path, _, actions in COMMANDS for a in actions if "--runs-dir" in a.option_strings}
    assert {"smelt train", "smelt eval", "smelt analyze", "smelt sweep status",
            "smelt results collect"} <= runs_root


@pytest.mark.parametrize("argv", [["sweep", "plan", "--suite", "smoke", "--submit"],
                                  ["sweep", "status", "--suite", "smoke", "--parallel", "2"]])
def test_a_verb_refuses_another_verbs_flag(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_suites_are_named_by_one_flag_and_lists_by_one_style():
    """The suite is always `--suite` (never positional); a list is always space-separated values after
    one flag (nargs), never comma-separated text or a repeated flag alone."""
    positional_suite = [path for path, _, actions in COMMANDS for a in actions
                        if not a.option_strings and a.dest == "suite"]
    assert not positional_suite, positional_suite
    repeated = [f"{path} {a.option_strings}" for path, _, actions in COMMANDS for a in actions
                if type(a) is argparse._AppendAction]  # extend (nargs + repeatable) is fine
    comma = [f"{path} {a.option_strings}" for path, _, actions in COMMANDS for a in actions
             if "comma-separated" in (a.help or "") or "comma separated" in (a.help or "")]
    assert not repeated and not comma, (repeated, comma)
    lists = {f"{path} {a.option_strings[0]}" for path, _, actions in COMMANDS for a in actions
             if a.option_strings and a.nargs == "+"}
    assert {"smelt gain --compute", "smelt gain --sparsity", "smelt eval --dyck-shots",
            "smelt train --override", "smelt sweep cancel --job"} <= lists

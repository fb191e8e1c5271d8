"""The user-error family: what the `smelt` command reports as one line and exit code 2.

A `SmeltError` says the input was wrong (a bad value, an unknown id, a missing file, data that fails
its checks, a run that cannot resume); the message says what and how to fix it. Anything else that
escapes a command is a bug and keeps its traceback. Each domain defines its own subclass beside the
code that raises it (`config.ConfigError`, `matching.MatchError`, `data.corpus.CorpusError`, ...);
the generic ones live here. Subclasses also derive from the built-in exception they refine
(`ValueError`, `KeyError`, `FileNotFoundError`, `RuntimeError`), so library callers that catch those
keep working.
"""

from __future__ import annotations


class SmeltError(Exception):
    """A user error: reported as one line, never a traceback."""


class UsageError(SmeltError, ValueError):
    """A bad argument or value given by the user."""


class UnknownName(SmeltError, KeyError):
    """An unknown suite, run id, verb or other name; the message lists the known or nearest ones."""

    def __str__(self) -> str:  # KeyError quotes its message; a user error should read as a sentence
        return str(self.args[0]) if self.args else ""


class AmbiguousName(UnknownName):
    """A prefix that starts several ids (or names): the message lists some; give more of it."""


class MissingInput(SmeltError, FileNotFoundError):
    """A file or folder the user named, or a run output the command needs, does not exist."""

"""The registry through which the library reaches the experiment suites (`experiments/`, at the top of
the repository) without importing them: the suites sit above the library, so the library asks here.

`experiments` fills it when imported (`experiments.register()`); the `smelt` CLI imports it before any
command runs, and so do the tests (conftest) and the notebooks that name suites. A library call that
needs a suite while nothing is registered stops with one line (`NoSuites`).

A source provides `load_suite(name) -> tuple[RunSpec, ...]`, `find_run(run_id) -> RunSpec` and
`placement_for(run) -> Parallelism` (a run's TPU placement).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from smelt_jax.platform.errors import SmeltError

if TYPE_CHECKING:
    from pathlib import Path

    from smelt_jax.design.descriptors import Parallelism, RunSpec


class NoSuites(SmeltError, RuntimeError):
    """No suite source is registered (import `experiments`, or call `smelt_jax.design.suites.register`)."""


class SuiteSource(Protocol):
    def load_suite(self, name: str) -> tuple[RunSpec, ...]: ...
    def find_run(self, run_id: str) -> RunSpec: ...
    def placement_for(self, run: RunSpec) -> Parallelism: ...
    def layouts_file(self, suite: str) -> Path: ...


_SOURCE: SuiteSource | None = None


def register(source: SuiteSource) -> None:
    """Make `source` the suites every library call reads (the last one registered wins)."""
    global _SOURCE
    _SOURCE = source


def source() -> SuiteSource:
    if _SOURCE is None:
        raise NoSuites("no experiment suites are registered: `import experiments` (the smelt CLI does) "
                       "or call smelt_jax.design.suites.register(SOURCE) first")
    return _SOURCE


def names() -> tuple[str, ...]:
    """The registered suites' names (the source's SUITE_NAMES), or () when none is registered."""
    return tuple(getattr(_SOURCE, "SUITE_NAMES", ())) if _SOURCE is not None else ()


def described(fallback: str = "suite name") -> str:
    """'suite name (smelt16, ..., nanolr)' for a --suite help text: the names from the registry."""
    return f"{fallback} ({', '.join(names())})" if names() else fallback


def load_suite(name: str) -> tuple[RunSpec, ...]:
    return source().load_suite(name)


def find_run(run_id: str) -> RunSpec:
    return source().find_run(run_id)


def placement_for(run: RunSpec) -> Parallelism:
    return source().placement_for(run)


def layouts_file(suite: str) -> Path:
    """Where the suite's compiled layouts (and the files beside them) live."""
    return source().layouts_file(suite)

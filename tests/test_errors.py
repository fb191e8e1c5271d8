"""The user-error family (smelt_jax/platform/errors.py): a user error is one line and exit code 2, a bug keeps
its traceback, and every domain error a user can cause is a `SmeltError`."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import experiments
from smelt_jax.cli import main
from smelt_jax.platform.errors import MissingInput, SmeltError, UnknownName, UsageError

PACKAGE = Path(__file__).resolve().parents[1] / "smelt_jax"
SMOKE_RUN = experiments.load_suite("smoke")[0].id


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("smelt: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["budget", "nope-run"], "no run with id 'nope-run'"),
    (["experiments", "list", "--suite", "nope"], "unknown suite 'nope'"),
    (["train", SMOKE_RUN, "--layout", "data=x"], "layout item 'data=x'"),
    (["train", SMOKE_RUN, "--layout", "bogus=2"], "layout item 'bogus=2'"),
    (["train", SMOKE_RUN, "--profile", "a:b"], "--profile 'a:b'"),
    (["train", SMOKE_RUN, "--branch", "99"], "--branch 99"),
    (["data", "tokenizer", "info", "{tmp}/nope.json"], "{tmp}/nope.json"),
    (["data", "prepare", "--input", "{tmp}/in.jsonl", "--out", "{tmp}/store", "--tokenizer", "{tmp}/nope.json"],
     "{tmp}/nope.json"),
    (["data", "prepare", "--input", "{tmp}/missing.jsonl", "--out", "{tmp}/store"], "no input files match"),
    (["fit", "--law", "smelt", "--input", "{tmp}/missing.csv", "--out", "{tmp}/fit"], "does not exist"),
    (["fit", "--law", "smelt", "--input", "{tmp}/in.jsonl", "--out", "{tmp}/fit"], "expected .csv or .parquet"),
    (["tables", "{tmp}"], "neither coefficients.json nor pair.json"),
    (["gain", "--reference", "{tmp}/none", "--target", "{tmp}/none"], "no coefficients at"),
    (["results", "collect", "--runs-dir", "{tmp}/no_runs"], "does not exist"),
    (["eval", SMOKE_RUN, "--runs-dir", "{tmp}/no_runs"], "has not been trained"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert says.replace("{tmp}", str(tmp_path)) in line, line
    assert not line.startswith('smelt: error: "'), line  # UnknownName reads as a sentence, not a quoted key


@pytest.mark.parametrize("bug", [ValueError("boom"), KeyError("boom"), FileNotFoundError("boom")])
def test_a_bug_keeps_its_traceback(bug, monkeypatch, capsys):
    """The built-in exceptions main used to catch now escape: only SmeltError is a user error."""
    def broken(run_id):
        raise bug

    monkeypatch.setattr(experiments, "find_run", broken)
    with pytest.raises(type(bug), match="boom"):
        main(["budget", "anything"])
    assert "smelt: error:" not in capsys.readouterr().err


def test_user_errors_still_are_the_builtin_exceptions():
    """Library callers that catch ValueError / KeyError / FileNotFoundError keep working."""
    with pytest.raises(KeyError):
        experiments.find_run("nope-run")
    with pytest.raises(KeyError):
        experiments.load_suite("nope")
    from smelt_jax.parallel.layout import parse_layout
    from smelt_jax.scaling.io import read_table
    with pytest.raises(ValueError):
        parse_layout("data=x", experiments.find_run(SMOKE_RUN).parallelism)
    with pytest.raises(FileNotFoundError):
        read_table("/nonexistent/table.csv")
    assert issubclass(UsageError, ValueError) and issubclass(UnknownName, KeyError)
    assert issubclass(MissingInput, FileNotFoundError)
    assert str(UnknownName("no run with id 'x'")) == "no run with id 'x'"


DOMAIN_ERRORS = [
    ("smelt_jax.design.config", "ConfigError"), ("smelt_jax.design.matching", "MatchError"),
    ("smelt_jax.run_files.checkpoint_format", "CheckpointAccessError"),
    ("smelt_jax.sweep.local", "SweepError"), ("smelt_jax.sweep.base", "MissingTool"),
    ("smelt_jax.train.lock", "LockHeld"), ("smelt_jax.train.checkpoint", "CheckpointError"),
    ("smelt_jax.data.hf_tokenizer", "TokenizerError"), ("smelt_jax.data.store_checks", "StoreError"),
    ("smelt_jax.data.inputs", "InputError"), ("smelt_jax.data.prepare", "PrepareError"),
    ("smelt_jax.data.corpus", "CorpusError"), ("smelt_jax.data.corpus", "DigestMismatch"),
    ("smelt_jax.analysis.tasks", "TaskFileError"), ("smelt_jax.train.phase", "ForkCheckpointDamaged"),
    ("smelt_jax.train.phase", "NonFiniteLoss"), ("smelt_jax.compile.aot", "TpuOutOfMemory"),
    ("smelt_jax.compile.aot", "LibTpuUnavailable"), ("smelt_jax.cli", "CliError"),
    ("smelt_jax.platform.env", "EnvError"),
]

# Exception classes under smelt_jax/ that are deliberately not user errors (a traceback is wanted, or
# the CLI turns them into a CliError itself with more context).
NOT_USER_ERRORS = {
    "TpuCompileError",       # the TPU compiler failed on a program we built: a bug
    "CheckpointSaveError",   # cli/train.py reports it as a CliError
}


@pytest.mark.parametrize("module, name", DOMAIN_ERRORS)
def test_domain_errors_are_smelt_errors(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, SmeltError), f"{module}.{name} does not derive from SmeltError"


def _defined_exception_classes() -> dict[str, str]:
    """{class name: file} of every class under smelt_jax/ whose name ends in Error."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                found[node.name] = str(path.relative_to(PACKAGE.parent))
    return found


def test_every_error_class_is_a_smelt_error_or_listed_as_internal():
    classes = _defined_exception_classes()
    listed = {name for _, name in DOMAIN_ERRORS}
    assert {"ConfigError", "StoreError", "TaskFileError", "SmeltError", "UsageError"} <= set(classes)
    unclassified = sorted(f"{file}: {name}" for name, file in classes.items()
                          if name not in listed | NOT_USER_ERRORS | {"SmeltError", "UsageError"})
    assert not unclassified, f"classify these as user errors (DOMAIN_ERRORS) or internal: {unclassified}"
    for name in NOT_USER_ERRORS:
        module = classes[name].removesuffix(".py").replace("/", ".")
        assert not issubclass(getattr(importlib.import_module(module), name), SmeltError), name


# A built-in exception a CLI handler raises itself would print a traceback for a user's mistake: a
# handler's own refusals must be SmeltErrors.
def test_cli_handlers_raise_no_builtin_exceptions():
    offenders = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and isinstance(node.exc.func, ast.Name) \
                    and node.exc.func.id in ("ValueError", "KeyError", "FileNotFoundError", "RuntimeError"):
                offenders.append(f"{relative}:{node.lineno} raise {node.exc.func.id}")
    assert not offenders, offenders

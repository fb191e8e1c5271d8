"""Bad inputs as one line (issue 27, item 9): an override no model can have is refused before the run
folder is written, and a filesystem error says "write" only when a write failed."""

from __future__ import annotations

import errno

import pytest

import experiments
from smelt_jax.cli import CliError, filesystem_errors, main
from smelt_jax.design.config import ConfigError
from smelt_jax.run_files.overrides import apply_overrides

RUN = experiments.load_suite("micro")[0]


@pytest.mark.parametrize("override, message", [
    ("n_experts=100000000000000000000", "fits 64 bits"),  # was accepted, then a traceback
    ("schedule.stable_steps=100000000000000000000", "fits 64 bits"),
    ("n_experts=1000000000", "parameters (more than 1e+13)"),
    ("n_experts=1e20", "expected an integer"),
])
def test_absurd_overrides_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        apply_overrides(RUN, [override])


def test_sensible_overrides_still_apply():
    assert apply_overrides(RUN, ["n_experts=8"]).model.n_experts == 8
    assert apply_overrides(RUN, ["schedule.seed=4294967295"]).schedule.seed == 2**32 - 1


@pytest.mark.parametrize("override", ["n_experts=1e20", "n_experts=100000000000000000000",
                                      "n_experts=1000000000"])
def test_train_refuses_the_override_before_writing_run_json(override, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["train", RUN.id, "--runs-dir", str(runs), "--override", override, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "n_experts" in err
    assert not runs.exists() or not any(runs.rglob("run.json"))


@pytest.mark.parametrize("code, verb", [(errno.ENOSPC, "cannot write"), (errno.EROFS, "cannot write"),
                                        (errno.EACCES, "cannot access"), (errno.ENOTDIR, "cannot access"),
                                        (errno.EISDIR, "cannot access")])
def test_filesystem_errors_say_write_only_for_write_failures(code, verb):
    def handler(_args):
        raise OSError(code, "message", "/runs/x")

    with pytest.raises(CliError) as err:
        filesystem_errors(handler)(None)
    assert str(err.value) == f"{verb} /runs/x: message"

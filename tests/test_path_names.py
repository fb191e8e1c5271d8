"""Every path component from user input goes through `smelt_jax.run_files.path_names`: a config file, an id, a
`--suite` or an `--out` cannot name a folder outside the runs root, and a bad one is one line (exit 2)
before anything is written."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from smelt_jax.run_files import path_names
from smelt_jax.cli import build_parser, main
from smelt_jax.design.config import ConfigError, ModelConfig, Schedule
from smelt_jax.design.descriptors import PATH_FIELDS, Parallelism, RunSpec
from smelt_jax.run_files.rundir import results_dir, run_dir
from tests.custom_run_helpers import TINY_SPEC, write_spec_file

BAD = ["..", "../../../../escape_var", "/etc", "a/b", "a\\b", "", "a\0b", "x" * 300, ".hidden", "a..b",
       "Upper", "-dash"]
# String fields that never reach a path, and why: a new string field must join one list or the other.
NOT_A_PATH = {
    (RunSpec, "pair_id"): "a label in results rows and TensorBoard hparams, never a folder name",
    (RunSpec, "tokenizer"): "one of descriptors.TOKENIZER_KINDS",
    (ModelConfig, "expert_impl"): "one of kernels.backend.EXPERT_IMPLS",
    (ModelConfig, "param_dtype"): "one of config.DTYPES",
    (ModelConfig, "compute_dtype"): "one of config.DTYPES",
    (ModelConfig, "expert_exchange"): "one of kernels.backend.EXPERT_EXCHANGES",
    (ModelConfig, "attention_impl"): "one of kernels.backend.ATTENTION_IMPLS",
    (Parallelism, "tpu_type"): "a TPU type, matched against hardware.py's table",
    (Parallelism, "remat"): "one of config.REMAT_POLICIES",
    (Parallelism, "exchange"): "one of kernels.backend.EXPERT_EXCHANGES",
    (Parallelism, "layer_loop"): "one of kernels.backend.LAYER_LOOPS",
    (Parallelism, "collectives"): "one of platform.xla_options.COLLECTIVE_FORMS",
}


def _string_fields(cls) -> set[tuple[type, str]]:
    return {(cls, f.name) for f in dataclasses.fields(cls) if str(f.type).split("|")[0].strip() == "str"}


def test_every_string_field_is_checked_or_listed_as_not_a_path():
    fields = set().union(*map(_string_fields, (RunSpec, ModelConfig, Schedule, Parallelism)))
    assert fields == {(RunSpec, name) for name in PATH_FIELDS} | set(NOT_A_PATH)


@pytest.mark.parametrize("field", PATH_FIELDS)
@pytest.mark.parametrize("value", BAD)
def test_every_path_field_refuses_path_characters(field, value):
    if field == "variant" and value == "":
        assert RunSpec.from_dict({**TINY_SPEC, "variant": ""}).variant == ""  # no variant: allowed
        return
    with pytest.raises(path_names.UnsafeName, match=f"RunSpec.{field}") as caught:
        RunSpec.from_dict({**TINY_SPEC, field: value})
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


@pytest.mark.parametrize("value", BAD)
def test_ids_and_suites_refuse_path_characters(tmp_path, value):
    with pytest.raises(path_names.UnsafeName):
        results_dir(value, tmp_path)
    with pytest.raises(path_names.UnsafeName):
        run_dir("smoke", value, tmp_path)
    with pytest.raises(path_names.UnsafeName):
        run_dir(value, "smoke-xs-s95-smelt-0123abcd", tmp_path)


def test_check_inside_is_lexical_and_handles_urls(tmp_path):
    assert path_names.check_inside(tmp_path / "a" / "b", tmp_path, "x") == tmp_path / "a" / "b"
    for outside in (tmp_path / ".." / "x", tmp_path.parent, "/etc"):
        with pytest.raises(path_names.UnsafeName, match="outside the runs root"):
            path_names.check_inside(outside, tmp_path, "x")
    assert path_names.check_inside("gs://b/runs/s/r", "gs://b/runs", "x")
    with pytest.raises(path_names.UnsafeName):
        path_names.check_inside("gs://b/runs/../s", "gs://b/runs", "x")
    with pytest.raises(path_names.UnsafeName):
        path_names.check_inside("gs://b/runs2/s", "gs://b/runs", "x")


def test_out_paths_refuse_only_what_no_file_system_takes():
    for good in ("/tmp/a.csv", "../fits/x.csv", "gs://b/x"):
        assert path_names.check_out_path(good) == good
    for bad in ("", "a\0b", "d/" + "x" * 300):
        with pytest.raises(path_names.UnsafeName):
            path_names.check_out_path(bad)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
        elif action.dest not in ("help", argparse.SUPPRESS):
            found.add(action.dest)
    return found


def test_every_path_bearing_cli_option_is_checked():
    # An option named like a path (…out, …dir, suite, id, target, config, store, input, prefix) must be
    # in ARGUMENT_CHECKS; `--input` takes a list (nargs) and is checked by its command.
    named = {d for d in _options(build_parser())
             if d.endswith(("out", "dir", "prefix")) or d in ("suite", "id", "target", "config", "store")}
    named -= {"layout"}  # mesh sizes (data=-1,fsdp=8), not a path
    assert named - set(path_names.ARGUMENT_CHECKS) == set()


@pytest.mark.parametrize("argv", [
    ["results", "export", "--suite", "x" * 300],
    ["results", "export", "--suite", "../up"],
    ["experiments", "show", "../../etc"],
    ["results", "export", "--suite", "smoke", "--out", "a\0b"],
])
def test_cli_refuses_bad_names_in_one_line(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("smelt: error:"), err
    assert list(tmp_path.iterdir()) == []


def test_a_config_variant_cannot_escape_the_runs_root(tmp_path, capsys):
    root = tmp_path / "a" / "b" / "runs"
    root.mkdir(parents=True)
    config = write_spec_file(tmp_path / "escape.yaml", {**TINY_SPEC, "variant": "../../../../escape_var"})
    assert main(["train", "--config", str(config), "--runs-dir", str(root), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RunSpec.variant" in err and str(config) in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "escape.yaml", "runs"]


def test_variants_of_equal_content_have_distinct_ids():
    # The hash covers what decides the numbers; the variant is in the id's text, and no name before it
    # holds a dash, so two variants never share an id (nor a folder).
    plain = RunSpec.from_dict(TINY_SPEC)
    one, two = (RunSpec.from_dict({**TINY_SPEC, "variant": v}) for v in ("r2", "r3"))
    assert len({plain.id, one.id, two.id}) == 3
    assert one.id.rsplit("-", 1)[1] == two.id.rsplit("-", 1)[1] == plain.id.rsplit("-", 1)[1]


def test_config_error_is_the_base():
    assert issubclass(path_names.UnsafeName, ConfigError)



def test_the_outputs_compile_report_skips_take_an_empty_name_and_refuse_a_bad_one():
    """`--json-out ''` (and --cadence-out, --results-out) skips that file, as the help says; `--out ''`
    and a NUL are still refused."""
    path_names.check_arguments({"json_out": "", "cadence_out": "", "results_out": ""})
    for arguments in ({"out": ""}, {"json_out": "a\0b"}, {"cadence_out": "d/" + "x" * 300}):
        with pytest.raises(path_names.UnsafeName):
            path_names.check_arguments(arguments)

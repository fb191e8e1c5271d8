"""Placeholders (PROJECT, BUCKET, ...) are one list (`sweep.base.PLACEHOLDER_WORDS`) checked by every
`--submit`, the optional gs:// settings (`--data-dir gs://BUCKET/...`) included."""

from __future__ import annotations

import pytest

from smelt_jax.cli import main
from smelt_jax.sweep import base
from smelt_jax.sweep.base import OPTIONAL_CHECKED, PLACEHOLDER_WORDS, CloudSettings

REAL = {"image": "us-docker.pkg.dev/p/smelt/smelt-jax:abc", "bucket": "gs://b/smelt", "project": "p",
        "zone": "us-east5-a", "cluster": "c"}


@pytest.mark.parametrize("field, value", [("data_dir", "gs://BUCKET/tokens"), ("reservation", "PROJECT-res"),
                                          ("queue", "CLUSTER")])
def test_an_optional_setting_with_a_placeholder_is_refused(field, value):
    extra = {"capacity": "reserved"} if field == "reservation" else {}
    settings = CloudSettings(**REAL, **extra, **{field: value})
    problem = settings.submit_problem(tuple(REAL))
    assert problem and f"--{field.replace('_', '-')}" in problem
    assert CloudSettings(**REAL, **extra).submit_problem(tuple(REAL)) is None


def test_every_optional_string_setting_is_checked():
    strings = {name for name, value in vars(CloudSettings()).items() if isinstance(value, str)}
    assert strings - {"image", "bucket", "project", "zone", "cluster", "capacity"} == set(OPTIONAL_CHECKED) - {"root"}
    assert {"BUCKET", "PROJECT", "ZONE", "CLUSTER", "REGION", "TAG"} <= set(PLACEHOLDER_WORDS)


@pytest.mark.parametrize("backend", ["xpk", "tpu-vm"])
def test_submit_refuses_a_placeholder_data_dir_in_one_line(tmp_path, monkeypatch, capsys, backend):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(base.subprocess, "run", lambda *a, **k: pytest.fail("must not submit"))
    flags = [x for k, v in REAL.items() for x in (f"--{k}", v)]
    assert main(["sweep", "submit", "--suite", "smoke", "--backend", backend, "--submit", *flags,
                 "--data-dir", "gs://BUCKET/tokens", "--out", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data-dir" in err and "placeholder" in err, err
    assert not (tmp_path / "plan").exists()  # refused before the plan (manifests, submit.sh) is written

"""The unembedding's matmul form in a TPU program: an ahead-of-time compile for v5p on this CPU must take
the TPU form (`einsum`), not this machine's (`matmul`): the program the platform decision gives is the one
of the explicit einsum form, and differs from the 2-D form's (so the comparison can fail)."""

import gzip
import re

import pytest

from smelt_jax.compile import aot
from smelt_jax.compile import report as cr
from smelt_jax.descriptors import Parallelism
from smelt_jax.model import loss


def _hlo(run, tmp_path, name) -> str:
    path = tmp_path / f"{name}.hlo.gz"
    report = cr.compile_run(run, "v5p-8", Parallelism(data=2, fsdp=2), hlo_path=path)
    assert report.error is None
    text = gzip.decompress(path.read_bytes()).decode()
    return re.sub(r", metadata=\{[^}]*\}", "", text)  # source locations differ between call sites


@pytest.mark.integration
@pytest.mark.tpu
def test_tpu_train_step_keeps_the_einsum_form(tmp_path, monkeypatch):
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments
    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    hlo = {}
    for form in ("chosen", "einsum", "matmul"):
        if form != "chosen":
            monkeypatch.setattr(loss, "choose_unembedding_form", lambda form=form, **_: form)
        hlo[form] = _hlo(run, tmp_path, form)
    assert hlo["chosen"] == hlo["einsum"]
    assert hlo["matmul"] != hlo["einsum"]

"""The platform choices of kernels/backend.py in a TPU program: an ahead-of-time compile for v5p on this CPU
must take the TPU's loss (the `fused` Pallas kernel) and layer loop (`scan`), not this machine's (`chunked`,
`unrolled`): the program the platform decisions give is the one of the explicit TPU choices, and differs
from the CPU choices' (so each comparison can fail). The chunked loss's unembedding form (`einsum` on TPU,
`matmul` on CPU) changes its program too."""

import gzip
import re

import pytest

from smelt_jax.compile import aot
from smelt_jax.compile import report as cr
from smelt_jax.design.descriptors import Parallelism
from smelt_jax.model import decoder, loss


def _hlo(run, tmp_path, name) -> str:
    path = tmp_path / f"{name}.hlo.gz"
    report = cr.compile_run(run, "v5p-8", Parallelism(data=2, fsdp=2), hlo_path=path)
    assert report.error is None
    text = gzip.decompress(path.read_bytes()).decode()
    return re.sub(r", metadata=\{[^}]*\}", "", text)  # source locations differ between call sites


@pytest.mark.integration
@pytest.mark.tpu
def test_tpu_train_step_keeps_the_einsum_form_and_the_scan(tmp_path, monkeypatch):
    available, reason = aot.libtpu_status()
    if not available:
        pytest.skip(reason)
    import experiments
    run = next(r for r in experiments.load_suite("smoke") if r.arch == "baseline")
    forms = {"chosen": None, "tpu": ("fused", "einsum", "scan"), "chunked": ("chunked", "einsum", "scan"),
             "matmul": ("chunked", "matmul", "scan"), "unrolled": ("fused", "einsum", "unrolled")}
    hlo = {}
    for name, chosen in forms.items():
        if chosen is not None:
            impl, form, loop = chosen
            monkeypatch.setattr(loss, "choose_loss_impl", lambda requested, impl=impl, **_: impl)
            monkeypatch.setattr(loss, "choose_unembedding_form", lambda form=form, **_: form)
            monkeypatch.setattr(decoder, "choose_layer_loop", lambda requested, loop=loop, **_: loop)
        hlo[name] = _hlo(run, tmp_path, name)
    assert hlo["chosen"] == hlo["tpu"]
    assert hlo["chunked"] != hlo["tpu"] and hlo["unrolled"] != hlo["tpu"] and hlo["matmul"] != hlo["chunked"]

"""A full disk ("No space left on device") names the file being written: plain writes, tensorstore's
writes (token store assembly, checkpoints) and `smelt data prepare` on a real full tmpfs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smelt_jax.platform import storage
from smelt_jax.train.metrics_log import MetricsWriter

REPO = Path(__file__).resolve().parents[1]
TENSORSTORE_ENOSPC = ('RESOURCE_EXHAUSTED: Error writing local file "/data/store/.staging/arrays/tokens/c/5": '
                      'Failed writing: "/data/store/.staging/arrays/tokens/c/5.__lock": Failed to write 2047 '
                      "bytes to file 4: No space left on device [os_error_code='28']")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_write_without_a_file_name_gets_the_path():
    with pytest.raises(OSError) as failed, MetricsWriter(Path("/dev/full")) as log:
        log.write({"step": 1})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == "/dev/full"


def test_tensorstore_os_error_names_the_file():
    found = storage.tensorstore_os_error(ValueError(TENSORSTORE_ENOSPC))
    assert (found.errno, found.filename) == (errno.ENOSPC, "/data/store/.staging/arrays/tokens/c/5")
    assert storage.tensorstore_os_error(ValueError("bad shape")) is None


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_data_prepare_on_a_full_disk_names_the_file(tmp_path):
    """Before: `smelt: error: cannot write: No space left on device` (no path)."""
    lines = [json.dumps({"text": f"document {i} " + "word " * 200, "source": "web"}) for i in range(500)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    small = tmp_path / "small"
    small.mkdir()
    cli = f"{sys.executable} -m smelt_jax data prepare --input in.jsonl --out small/store --tokenizer bytes --quiet"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k none {small} && {cli}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"smelt: error: cannot write {small}/store/"), line
    assert line.endswith("No space left on device"), line

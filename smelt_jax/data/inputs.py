"""The embedded corpus's inputs: pinned source archives from the Python package index.

The corpus is built from three archives published on PyPI, each pinned by file name and sha256, so that
it is the same byte for byte on every machine, whatever Python, Debian or packages are installed:

| root        | archive                               | licence                                                  |
|-------------|---------------------------------------|----------------------------------------------------------|
| `django`    | Django 5.2.8 sdist (`django-5.2.8.tar.gz`)  | BSD-3-Clause (Django Software Foundation)          |
| `numpy`     | NumPy 2.4.6 sdist (`numpy-2.4.6.tar.gz`)    | BSD-3-Clause (bundled parts: see `LICENSES_bundled.txt`) |
| `botocore`  | botocore 1.40.69 wheel (`botocore-1.40.69-py3-none-any.whl`) | Apache-2.0 (Amazon.com, Inc.)       |

`fetch_inputs` downloads each archive once into `<cache>/archives/` (from files.pythonhosted.org, or
from `$SMELT_CORPUS_MIRROR/<file name>` when set, e.g. a folder or bucket mirror for machines without
PyPI), checks its sha256, and extracts its regular text-sized files into `<cache>/inputs/<root>-<sha8>/`
(stripping the archive's top folder). Extraction writes into a temporary folder and renames it into
place, so an interrupted fetch never leaves a half tree that looks complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

from smelt_jax.platform.errors import SmeltError

# Files above this size are never read by the sources (sources.MAX_FILE_BYTES); skip them at extraction.
EXTRACT_MAX_BYTES = 1 << 20
DOWNLOAD_ATTEMPTS = 4
MIRROR_ENV = "SMELT_CORPUS_MIRROR"


class InputError(SmeltError, RuntimeError):
    """An input archive that cannot be fetched, or whose bytes are not the pinned ones."""


@dataclasses.dataclass(frozen=True)
class Archive:
    """One pinned archive: the root name the sources read it by, where it is published, its digest."""

    root: str
    filename: str
    url: str
    sha256: str
    size: int
    licence: str

    def to_dict(self) -> dict:
        """What identifies the bytes (the recipe digest covers this, not where they were fetched from)."""
        return {"root": self.root, "filename": self.filename, "sha256": self.sha256}


PINNED_ARCHIVES: tuple[Archive, ...] = (
    Archive("django", "django-5.2.8.tar.gz",
            "https://files.pythonhosted.org/packages/05/a2/933dbbb3dd9990494960f6e64aca2af4c0745b63b7113f59a822df92329e/django-5.2.8.tar.gz",
            "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f", 10_849_032,
            "BSD-3-Clause"),
    Archive("numpy", "numpy-2.4.6.tar.gz",
            "https://files.pythonhosted.org/packages/d0/ad/fed0499ce6a338d2a03ebae59cd15093910c8875328855781952abf6c2fe/numpy-2.4.6.tar.gz",
            "f3a3570c4a2a16746ac2c31a7c7c7b0c186b95ce902e33db6f28094ed7387dda", 20_735_807,
            "BSD-3-Clause (bundled components: see LICENSES_bundled.txt in the archive)"),
    Archive("botocore", "botocore-1.40.69-py3-none-any.whl",
            "https://files.pythonhosted.org/packages/61/d6/bf2b91d4a92af6ee70e0689913414463a48cf51c0fc855c98b94bde8e7f3/botocore-1.40.69-py3-none-any.whl",
            "5d810efeb9e18f91f32690642fa81ae60e482eefeea0d35ec72da2e3d924c1a5", 14_103_454,
            "Apache-2.0"),
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _download(archive: Archive, target: Path) -> None:
    """Fetch `archive` into `target` (atomically), from the mirror when one is set; retry with backoff."""
    from smelt_jax.platform import env  # the one door for outside values (MIRROR_ENV)
    mirror = env.corpus_mirror()
    source = f"{mirror.rstrip('/')}/{archive.filename}" if mirror else archive.url
    partial = target.with_name(target.name + ".part")
    local = bool(mirror) and "://" not in mirror
    last_error: Exception | None = None
    for attempt in range(1 if local else DOWNLOAD_ATTEMPTS):  # a local copy is not worth retrying
        try:
            if local:
                shutil.copyfile(source, partial)
            else:
                with urllib.request.urlopen(source, timeout=120) as response, open(partial, "wb") as out:
                    shutil.copyfileobj(response, out, length=1 << 20)
            os.replace(partial, target)
            return
        except (OSError, urllib.error.URLError) as err:
            last_error = err
            if not local:
                time.sleep(min(2 ** attempt, 8))
    partial.unlink(missing_ok=True)
    raise InputError(f"could not fetch {archive.filename} from {source} ({last_error}); set {MIRROR_ENV} "
                     "to a folder holding the file to build without PyPI")


def _members(path: Path) -> list[tuple[str, Callable[[], bytes], int]]:
    """(name, reader, size) of every regular file in a .tar.gz or .zip/.whl archive."""
    if path.name.endswith((".zip", ".whl")):
        handle = zipfile.ZipFile(path)
        return [(info.filename, (lambda info=info: handle.read(info)), info.file_size)
                for info in handle.infolist() if not info.is_dir()]
    handle = tarfile.open(path, "r:gz")
    return [(m.name, (lambda m=m: handle.extractfile(m).read()), m.size)
            for m in handle.getmembers() if m.isfile()]


def _strip_top(name: str, archive: Archive) -> str | None:
    """Member path relative to the archive's top folder (sdists), or as is (wheels); None if unsafe."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if archive.filename.endswith(".tar.gz"):
        parts = parts[1:]
    if not parts or any(p == ".." for p in parts):
        return None
    return "/".join(parts)


def extract(archive: Archive, archive_path: Path, target: Path) -> None:
    """Extract `archive`'s regular files of at most EXTRACT_MAX_BYTES into `target` (atomically)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.extracting-", dir=target.parent))
    try:
        for name, read, size in _members(archive_path):
            rel = _strip_top(name, archive)
            if rel is None or size > EXTRACT_MAX_BYTES:
                continue
            out = staging / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(read())
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def fetch_inputs(cache_dir: Path, archives: tuple[Archive, ...] = PINNED_ARCHIVES,
                 log: Callable[[str], None] | None = None) -> dict[str, str]:
    """Download (once), verify and extract every archive; returns {root name: extracted folder}."""
    archive_dir, input_dir = cache_dir / "archives", cache_dir / "inputs"
    archive_dir.mkdir(parents=True, exist_ok=True)
    input_dir.mkdir(parents=True, exist_ok=True)
    roots = {}
    for archive in archives:
        folder = input_dir / f"{archive.root}-{archive.sha256[:8]}"
        roots[archive.root] = str(folder)
        if folder.is_dir():
            continue
        path = archive_dir / archive.filename
        if not path.is_file() or _sha256(path) != archive.sha256:
            if log:
                log(f"fetching {archive.filename} ({archive.size / 1e6:.1f} MB)")
            _download(archive, path)
        got = _sha256(path)
        if got != archive.sha256:
            path.rename(path.with_name(path.name + ".bad"))
            raise InputError(f"{archive.filename}: sha256 {got} is not the pinned {archive.sha256}; "
                             f"the file was moved aside to {path.name}.bad")
        extract(archive, path, folder)
    return roots


def archive_table(archives: tuple[Archive, ...] = PINNED_ARCHIVES) -> list[dict]:
    """One row per archive for docs and `smelt data info`."""
    return [{"root": a.root, "file": a.filename, "sha256": a.sha256, "bytes": a.size, "licence": a.licence}
            for a in archives]


"""The named sources of the embedded corpus: which files of the pinned input archives they read, and how.

The inputs are three archives from the Python package index, pinned by sha256 (`smelt_jax.data.inputs`):
the Django 5.2.8 and NumPy 2.4.6 source distributions and the botocore 1.40.69 wheel. Nothing of the
machine's own Python, site-packages or /usr is read, so the corpus is the same everywhere.

| source       | kind           | read from                                                                     |
|--------------|----------------|-------------------------------------------------------------------------------|
| `python`     | code: Python   | Django's and NumPy's `.py` files (no tests, no vendored build tools)          |
| `c`          | code: C / C++  | NumPy's C and C++ sources and headers (`.c`, `.h`, `.cpp`, `.cc`, `.hpp`, `.c.src`, `.h.src`) |
| `prose`      | English prose  | Django's reStructuredText manual (`docs/**/*.txt`), NumPy's (`doc/**/*.rst`), licence texts |
| `structured` | structured     | botocore's JSON service descriptions, NumPy's CSV / TOML / YAML / INI files   |

Files are taken in a deterministic pseudo-random order (sha256 of "source:root:relative path"), so a byte
cap samples the whole tree rather than its alphabetical start. Unreadable, binary (NUL bytes) and
non-UTF-8 files are skipped and counted.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

# Skip single files above this size: generated blobs, not text anyone wrote.
MAX_FILE_BYTES = 1 << 20
# Drop documents shorter than this: empty `__init__.py`, one-line stubs.
MIN_DOCUMENT_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Roots:
    """The folders the sources read, by root name; a missing name (or None) contributes nothing."""

    paths: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, str | Path | None] | None = None, **named: str | Path | None) -> Roots:
        merged = {**(mapping or {}), **named}
        return cls(tuple(sorted((k, None if v is None else str(v)) for k, v in merged.items())))

    def get(self, name: str) -> Path | None:
        value = dict(self.paths).get(name)
        return Path(value) if value else None

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.paths)


@dataclasses.dataclass(frozen=True)
class FileSet:
    """Files under one root whose relative posix path matches a pattern ('**/' any folders, '*' no '/')."""

    root: str
    patterns: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    extractor: str = "text"


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    name: str
    kind: str
    description: str
    file_sets: tuple[FileSet, ...]
    max_bytes: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TEST_DIRS = ("**/test/**", "**/tests/**", "**/testing/**", "**/_vendored/**", "**/benchmarks/**")
# NumPy's sdist carries a copy of meson (a build tool) and of other projects' sources: not NumPy's text.
_NUMPY_VENDORED = ("vendored-meson/**", "numpy/_core/src/highway/**", "numpy/_core/src/common/pythoncapi-compat/**",
                   "numpy/fft/pocketfft/**", "numpy/linalg/lapack_lite/**", "numpy/_core/src/npysort/x86-simd-sort/**")

DEFAULT_SOURCES: tuple[SourceSpec, ...] = (
    SourceSpec(
        name="python", kind="code:python",
        description="Python code of Django and NumPy",
        file_sets=(FileSet("django", ("django/**/*.py",), _TEST_DIRS),
                   FileSet("numpy", ("numpy/**/*.py",), _TEST_DIRS + _NUMPY_VENDORED)),
        max_bytes=8_000_000),
    SourceSpec(
        name="c", kind="code:c",
        description="C and C++ sources and headers of NumPy",
        file_sets=(FileSet("numpy", ("numpy/**/*.c", "numpy/**/*.h", "numpy/**/*.cpp", "numpy/**/*.cc",
                                     "numpy/**/*.hpp", "numpy/**/*.c.src", "numpy/**/*.h.src"),
                           _TEST_DIRS + _NUMPY_VENDORED),),
        max_bytes=6_000_000),
    SourceSpec(
        name="prose", kind="prose:english",
        description="English prose: the Django and NumPy manuals (reStructuredText) and licence texts",
        file_sets=(
            FileSet("django", ("docs/**/*.txt", "LICENSE", "AUTHORS"), ("docs/releases/**",)),
            FileSet("numpy", ("doc/**/*.rst", "LICENSE.txt", "LICENSES_bundled.txt"),
                    ("doc/changelog/**", "doc/release/**")),
        ),
        max_bytes=8_000_000),
    SourceSpec(
        name="structured", kind="structured",
        description="JSON service descriptions of botocore; CSV, TOML, YAML and INI files of NumPy",
        file_sets=(FileSet("botocore", ("botocore/data/**/*.json",)),
                   FileSet("numpy", ("**/*.csv", "**/*.toml", "**/*.yaml", "**/*.yml", "**/*.ini",
                                     "**/*.cfg"), _NUMPY_VENDORED)),
        max_bytes=4_000_000),
)


@functools.cache
def _glob_regex(pattern: str) -> re.Pattern:
    """'**/' = any (possibly empty) chain of folders, '*' = any run without '/', '?' = one char."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def list_files(root: Path, file_set: FileSet) -> list[str]:
    """Relative posix paths of regular files under `root` matching `file_set`, sorted; [] if no root."""
    if not root.is_dir():
        return []
    include = [_glob_regex(p) for p in file_set.patterns]
    exclude = [_glob_regex(p) for p in file_set.exclude]
    found = []
    for folder, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_folder = Path(folder).relative_to(root).as_posix()
        prefix = "" if rel_folder == "." else rel_folder + "/"
        for name in sorted(filenames):
            rel = prefix + name
            if any(r.match(rel) for r in include) and not any(r.match(rel) for r in exclude):
                found.append(rel)
    return sorted(found)


def _read_text(path: Path) -> bytes | None:
    """The file's bytes if it is a readable, small, NUL-free UTF-8 text file; else None."""
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _extract_text(rel: str, data: bytes) -> list[bytes]:
    return [data]


def _extract_docstrings(rel: str, data: bytes) -> list[bytes]:
    """Module, class and function docstrings of a Python file, as one document (cleaned by inspect)."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return []
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                texts.append(doc.strip())
    return ["\n\n".join(texts).encode("utf-8") + b"\n"] if texts else []


def _extract_pydoc_topics(rel: str, data: bytes) -> list[bytes]:
    """Each entry of `pydoc_data.topics.topics` (the Language Reference excerpts) as a document."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets)):
            topics = ast.literal_eval(node.value)
            return [text.encode("utf-8") for _, text in sorted(topics.items()) if text.strip()]
    return []


EXTRACTORS: dict[str, Callable[[str, bytes], list[bytes]]] = {
    "text": _extract_text,
    "docstrings": _extract_docstrings,
    "pydoc_topics": _extract_pydoc_topics,
}


def split_document(data: bytes, max_bytes: int) -> list[bytes]:
    """Cut `data` into chunks of at most `max_bytes`, at a blank line, else a newline, else anywhere."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks, start = [], 0
    while len(data) - start > max_bytes:
        window = data[start:start + max_bytes]
        cut = window.rfind(b"\n\n", 0, max_bytes - 1) + 2  # just after a blank line
        if cut < max_bytes // 2:
            cut = window.rfind(b"\n") + 1  # just after a newline
        if cut < max_bytes // 2:
            cut = max_bytes  # one long line: cut anywhere
        chunks.append(data[start:start + cut])
        start += cut
    chunks.append(data[start:])
    return [c for c in chunks if c]


@dataclasses.dataclass
class SourceDocuments:
    """What one source yielded: the documents (with origin and split key) and the provenance record."""

    name: str
    documents: list[tuple[str, bytes, bytes]]  # (origin "root:relpath#chunk", text, split key)
    provenance: list[dict]
    total_bytes: int
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # "root:relpath" -> sha256[:16]


def _ordered_candidates(spec: SourceSpec, roots: Roots) -> Iterator[tuple[int, str, Path, str]]:
    """(file set index, root name, root path, relpath) in sha256 order of "source:root:relpath"."""
    keyed = []
    for index, file_set in enumerate(spec.file_sets):
        root = roots.get(file_set.root)
        if root is None:
            continue
        for rel in list_files(root, file_set):
            key = hashlib.sha256(f"{spec.name}:{file_set.root}:{rel}".encode()).digest()
            keyed.append((key, index, file_set.root, root, rel))
    keyed.sort()
    for _, index, root_name, root, rel in keyed:
        yield index, root_name, root, rel


def candidate_files(spec: SourceSpec, roots: Roots) -> list[str]:
    """"root:relpath" of every file `spec` may read, in the order it reads them (the recipe's file list)."""
    return [f"{root_name}:{rel}" for _, root_name, _, rel in _ordered_candidates(spec, roots)]


def collect_source(spec: SourceSpec, roots: Roots, max_document_bytes: int,
                   progress: Callable[[int], None] | None = None) -> SourceDocuments:
    """Read `spec`'s files until `spec.max_bytes` of text is taken; split long texts into chunks."""
    stats = [{"root": fs.root, "path": str(roots.get(fs.root)) if roots.get(fs.root) else None,
                  "patterns": list(fs.patterns), "exclude": list(fs.exclude), "extractor": fs.extractor,
                  "files_matched": 0, "files_used": 0, "files_skipped": 0, "documents": 0, "bytes": 0}
             for fs in spec.file_sets]
    candidates = list(_ordered_candidates(spec, roots))
    for index, *_ in candidates:
        stats[index]["files_matched"] += 1
    documents, total, files = [], 0, {}
    for index, root_name, root, rel in candidates:
        if total >= spec.max_bytes:
            break
        data = _read_text(root / rel)
        texts = EXTRACTORS[spec.file_sets[index].extractor](rel, data) if data is not None else []
        texts = [t for t in texts if len(t.strip()) >= MIN_DOCUMENT_BYTES]
        if not texts:
            stats[index]["files_skipped"] += 1
            continue
        stats[index]["files_used"] += 1
        files[f"{root_name}:{rel}"] = hashlib.sha256(data).hexdigest()[:16]
        for t_index, text in enumerate(texts):
            # All chunks of one text share a split key: a file never straddles train and validation.
            split_key = hashlib.sha256(text).digest()
            for c_index, chunk in enumerate(split_document(text, max_document_bytes)):
                origin = f"{root_name}:{rel}#{t_index}.{c_index}"
                documents.append((origin, chunk, split_key))
                stats[index]["documents"] += 1
                stats[index]["bytes"] += len(chunk)
                total += len(chunk)
        if progress is not None:
            progress(sum(len(t) for t in texts))
    return SourceDocuments(spec.name, documents, stats, total, files)

"""A tiny corpus built from a temporary folder of fake source files (shared by the data tests)."""

from __future__ import annotations

from pathlib import Path

from smelt_jax.data.corpus import BuildConfig, build_corpus
from smelt_jax.data.token_store import TokenStore
from smelt_jax.data.sources import FileSet, Roots, SourceSpec

TINY_SOURCES = (
    SourceSpec("code", "code:python", "fake python files",
               (FileSet("stdlib", ("**/*.py",), ("**/tests/**",)),), max_bytes=1_000_000),
    SourceSpec("words", "prose:english", "fake licences and docstrings",
               (FileSet("licenses", ("*",)),
                FileSet("site_packages", ("**/*.py",), extractor="docstrings")), max_bytes=1_000_000),
    SourceSpec("tables", "structured", "fake json and csv",
               (FileSet("site_packages", ("**/*.json", "**/*.csv")),), max_bytes=1_000_000),
)


def write_fake_tree(root: Path, n_files: int = 24) -> Roots:
    """Fake stdlib / site-packages / licence folders with deterministic, varied text."""
    stdlib, site, licenses = root / "stdlib", root / "site", root / "licenses"
    for folder in (stdlib / "pkg", stdlib / "tests", site / "lib", licenses):
        folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        body = "".join(f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(5 + 7 * (i % 5)))
        (stdlib / "pkg" / f"mod{i:02d}.py").write_text(f"# module {i}\n" + body)
        doc = " ".join(f"word{(i * 7 + j) % 13}" for j in range(20 + 9 * (i % 4)))
        (site / "lib" / f"m{i:02d}.py").write_text(
            f'"""Module {i}: {doc}."""\n\ndef g():\n    """Function docstring number {i}, long enough '
            f'to keep."""\n    return {i}\n')
        rows = "\n".join(f"{i},{j},{i * j}" for j in range(10 + 3 * (i % 6)))
        (site / "lib" / f"t{i:02d}.csv").write_text("a,b,c\n" + rows + "\n")
        (site / "lib" / f"d{i:02d}.json").write_text(
            "{" + ", ".join(f'"k{j}": {i + j}' for j in range(8 + i % 5)) + "}\n")
    for i in range(6):
        (licenses / f"LICENSE-{i}").write_text(f"Licence {i}. " + "Permission is granted. " * (10 + i))
    (stdlib / "tests" / "test_skip.py").write_text("# excluded by pattern\n" * 20)
    (stdlib / "pkg" / "binary.py").write_bytes(b"x = 1\n\x00\x01" * 30)
    (stdlib / "pkg" / "latin1.py").write_bytes(b"# caf\xe9 \xe9\xe9\n" * 30)
    return Roots.of(stdlib=stdlib, site_packages=site, licenses=licenses)


def tiny_config(roots: Roots, **changes) -> BuildConfig:
    return BuildConfig(sources=TINY_SOURCES, roots=roots, val_fraction=0.2, max_document_bytes=512,
                       **changes)


def build_tiny_corpus(root: Path, **changes) -> TokenStore:
    roots = write_fake_tree(root / "src")
    result = build_corpus(root / "corpus", tiny_config(roots, **changes), progress=False)
    return TokenStore(result.folder)

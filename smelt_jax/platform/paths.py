"""Where the package and its checkout are: the one place that knows the repository layout.

`PACKAGE_DIR` is the installed `smelt_jax` folder (package data lives under it: `reference_data/`,
`data/corpus_expected.json`). `checkout_root()` is the folder above it: the repository in a clone or an
editable install, site-packages in a wheel install, so only git-ignored working folders (`data_cache/`)
are placed there by default, each overridable by an environment variable where one is documented.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # smelt_jax/ (this file is smelt_jax/platform/paths.py)
REFERENCE_DATA = PACKAGE_DIR / "reference_data"


def checkout_root() -> Path:
    """The folder that holds the `smelt_jax` package (the repository root in a clone)."""
    return PACKAGE_DIR.parent

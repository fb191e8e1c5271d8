"""Parallelism layouts: parsing `--layout data=2,fsdp=4,expert=8` and the chosen per-run layouts in
experiments/layouts.json (written by `smelt compile-report`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from smelt_jax.descriptors import Parallelism

LAYOUTS_FILE = Path(__file__).resolve().parents[2] / "experiments" / "layouts.json"
AXES = ("data", "fsdp", "expert", "tensor")


def parse_layout(text: str, base: Parallelism | None = None) -> Parallelism:
    """'data=2,fsdp=-1,expert=8' -> Parallelism (unnamed axes keep `base`'s sizes)."""
    base = base if base is not None else Parallelism()
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in AXES:
            raise ValueError(f"layout item {item!r}: want AXIS=SIZE with AXIS in {AXES}")
        try:
            changes[name] = int(value)
        except ValueError:
            raise ValueError(f"layout item {item!r}: size must be an integer (-1 = fill the rest)") from None
    return dataclasses.replace(base, **changes)


def layout_key(scale: str, sparsity_label: str, arch: str) -> str:
    return f"{scale}/{sparsity_label}/{arch}"


def load_layouts(path: Path = LAYOUTS_FILE) -> dict[str, Parallelism]:
    """{'1.6b/s97/smelt': Parallelism(...)} from layouts.json; {} when the file does not exist."""
    if not Path(path).exists():
        return {}
    data = json.loads(Path(path).read_text())
    return {key: Parallelism(**fields) for key, fields in data["layouts"].items()}

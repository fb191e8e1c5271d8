"""Parallelism layouts: parsing `--layout data=2,fsdp=4,expert=8`, writing one back, the key a layout is
filed under (`scale/sparsity/arch[/variant]`) and reading a layouts file (experiments/layouts.json is
written by `smelt compile-report`; which file a suite uses is `experiments/placement.py`'s business)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.platform.errors import UsageError

AXES = ("data", "fsdp", "expert", "tensor")


def parse_layout(text: str, base: Parallelism | None = None) -> Parallelism:
    """'data=2,fsdp=-1,expert=8' -> Parallelism (unnamed axes keep `base`'s sizes)."""
    base = base if base is not None else Parallelism()
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in AXES:
            raise UsageError(f"layout item {item!r}: want AXIS=SIZE with AXIS in {AXES}")
        try:
            changes[name] = int(value)
        except ValueError:
            raise UsageError(f"layout item {item!r}: size must be an integer (-1 = fill the rest)") from None
    return dataclasses.replace(base, **changes)


def format_layout(layout: Parallelism) -> str:
    """The `--layout` text `parse_layout` reads back: 'data=1,fsdp=8,expert=8,tensor=1'."""
    return ",".join(f"{axis}={getattr(layout, axis)}" for axis in AXES)


def layout_key(scale: str, sparsity_label: str, arch: str, variant: str = "") -> str:
    return "/".join([scale, sparsity_label, arch] + ([variant] if variant else []))


def run_key(run: RunSpec) -> str:
    """The key of `run`'s layout in a layouts file: '1.6b/s97/smelt', '200m/s85/looped/span2'."""
    return layout_key(run.scale, run.sparsity_label, run.arch, run.variant)


def load_layouts(path: Path) -> dict[str, Parallelism]:
    """{'1.6b/s97/smelt': Parallelism(...)} from a layouts file; {} when the file does not exist."""
    if not Path(path).exists():
        return {}
    data = json.loads(Path(path).read_text())
    return {key: Parallelism(**fields) for key, fields in data["layouts"].items()}

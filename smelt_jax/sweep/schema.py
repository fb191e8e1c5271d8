"""Offline validation of rendered JobSet manifests against the upstream JobSet CRD.

The CRD ships with the package, at `smelt_jax/reference_data/jobset/jobset.x-k8s.io_jobsets.yaml`
(source, commit and licence in `smelt_jax/reference_data/README.md`). Its `v1alpha2` openAPIV3Schema is
made strict before use: keys with null values are dropped, and every object that lists `properties` (and
says nothing else about extra keys) gets `additionalProperties: false`, so a misspelt field fails here
rather than being pruned silently by the API server.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from smelt_jax.platform.errors import MissingInput
from smelt_jax.platform.paths import REFERENCE_DATA

JOBSET_CRD = REFERENCE_DATA / "jobset" / "jobset.x-k8s.io_jobsets.yaml"
JOBSET_VERSION = "v1alpha2"


def drop_nulls(obj: Any) -> Any:
    """`obj` without dict keys whose value is None (Kubernetes reads null as unset)."""
    if isinstance(obj, dict):
        return {k: drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [drop_nulls(v) for v in obj]
    return obj


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def jobset_schema(crd_path: Path = JOBSET_CRD) -> dict:
    """The strict `v1alpha2` JobSet schema; a clear error when the CRD file is missing."""
    import yaml
    if not crd_path.is_file():
        raise MissingInput(
            f"JobSet CRD not found at {crd_path}; it ships as package data "
            "(smelt_jax/reference_data/jobset/): reinstall the package")
    crd = yaml.safe_load(crd_path.read_text())
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if JOBSET_VERSION not in versions:
        raise ValueError(f"{crd_path} has no {JOBSET_VERSION} version (has {sorted(versions)})")
    return _strict(drop_nulls(versions[JOBSET_VERSION]["schema"]["openAPIV3Schema"]))


@functools.cache
def _validator():
    import jsonschema
    return jsonschema.Draft7Validator(jobset_schema())


def validation_errors(manifest: dict) -> list[str]:
    """Every schema violation of a JobSet manifest, as `path: message` lines ([] = valid)."""
    errors = sorted(_validator().iter_errors(drop_nulls(manifest)), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def validate_jobset(manifest: dict) -> None:
    errors = validation_errors(manifest)
    if errors:
        name = manifest.get("metadata", {}).get("name", "?")
        raise ValueError(f"JobSet {name} fails the {JOBSET_VERSION} schema:\n  " + "\n  ".join(errors))

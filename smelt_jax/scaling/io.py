"""Reading and validating input tables (CSV or parquet) and fit directories."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from smelt_jax.platform.paths import REFERENCE_DATA
from smelt_jax.scaling.laws import LAWS, law_from_dict
from smelt_jax.platform.errors import MissingInput, UsageError

# Columns each law's fit needs; `loss` always, `cell` for the cell bootstrap (optional for Chinchilla and
# the looped law: each row is then its own cell).
REQUIRED = {"smelt": ("arch", "F", "S", "D", "loss", "cell"), "chinchilla": ("N", "D", "loss"),
            "looped": ("N_once", "N_rec", "r", "D", "loss")}
POSITIVE = {"smelt": ("F", "D", "loss"), "chinchilla": ("N", "D", "loss"),
            "looped": ("N_once", "N_rec", "r", "D", "loss")}
# No FLOP count, parameter count or token count of a real run comes near this; beyond it a typo (1e300)
# only overflows inside the fit, far from the column that caused it.
MAX_MAGNITUDE = 1e60


class DuplicateRowsWarning(UserWarning):
    """Rows of a fit's input repeat the same point: each counts once more in the fit."""


def read_table(path) -> pd.DataFrame:
    path = Path(path)
    if not path.exists():
        raise MissingInput(f"input table {path} does not exist")
    if path.suffix == ".csv":
        return pd.read_csv(path)
    if path.suffix in (".parquet", ".pq"):
        return pd.read_parquet(path)
    raise UsageError(f"input table {path}: expected .csv or .parquet")


def validate(table: pd.DataFrame, law_name: str, source: str = "table") -> pd.DataFrame:
    """Check columns, values and size for `law_name`; returns the table with a `cell` column."""
    if law_name not in REQUIRED:
        raise UsageError(f"unknown law {law_name!r}; choose one of {sorted(REQUIRED)}")
    missing = [c for c in REQUIRED[law_name] if c not in table.columns]
    if missing:
        raise UsageError(f"{source}: missing column(s) {missing} for the {law_name} law "
                         f"(needs {list(REQUIRED[law_name])})")
    numeric = [c for c in REQUIRED[law_name] if c not in ("arch", "cell")]
    for col in numeric:
        values = pd.to_numeric(table[col], errors="coerce")
        bad = ~np.isfinite(values.to_numpy(float))
        if bad.any():
            raise UsageError(f"{source}: column {col!r} has NaN, infinite or non-numeric values in "
                             f"rows {np.flatnonzero(bad)[:5].tolist()}")
        huge = np.abs(values.to_numpy(float)) > MAX_MAGNITUDE
        if huge.any():
            raise UsageError(f"{source}: column {col!r} has values beyond {MAX_MAGNITUDE:g} in rows "
                             f"{np.flatnonzero(huge)[:5].tolist()} (e.g. {values[huge].iloc[0]:g}); a typo?")
    for col in POSITIVE[law_name]:
        bad = table[col].to_numpy(float) <= 0
        if bad.any():
            raise UsageError(f"{source}: column {col!r} must be > 0; rows {np.flatnonzero(bad)[:5].tolist()}")
    if law_name == "smelt":
        s = table["S"].to_numpy(float)
        if ((s < 0) | (s >= 1)).any():
            raise UsageError(f"{source}: column 'S' must lie in [0, 1)")
    if law_name == "looped" and (table["r"].to_numpy(float) < 1).any():
        raise UsageError(f"{source}: column 'r' must be >= 1")
    warn_duplicates(table, law_name, source)
    n_params = len(LAWS[law_name].param_names)
    if len(table) <= n_params:
        raise UsageError(f"{source}: {len(table)} rows is too few to fit the {n_params} parameters of the "
                         f"{law_name} law (need more than {n_params})")
    table = table.copy()
    if "cell" not in table.columns:
        table["cell"] = np.arange(len(table))
    return table.reset_index(drop=True)


def warn_duplicates(table: pd.DataFrame, law_name: str, source: str = "table") -> int:
    """Warn (DuplicateRowsWarning) when rows repeat a point of the law's inputs (identical rows, or
    the same inputs with another loss); returns the number of repeated rows."""
    keys = [c for c in REQUIRED[law_name] if c not in ("loss", "cell")]
    repeated = table.duplicated(subset=keys, keep="first")
    count = int(repeated.sum())
    if count:
        identical = int(table.duplicated(subset=keys + ["loss"], keep="first").sum())
        rows = np.flatnonzero(table.duplicated(subset=keys, keep=False).to_numpy())[:8].tolist()
        warnings.warn(f"{source}: {count} row(s) repeat the {'/'.join(keys)} of an earlier row "
                      f"({identical} identical, {count - identical} with another loss; rows {rows}); "
                      "each repeat weighs that point once more in the fit: drop them if unintended",
                      DuplicateRowsWarning, stacklevel=3)
    return count


# Epoch AI's extraction of Chinchilla's Figure 4 points (source and licence: reference_data/README.md).
CHINCHILLA_CSV = REFERENCE_DATA / "chinchilla" / "svg_extracted_data.csv"


def chinchilla_table(csv_path=None, drop_highest: int = 5) -> tuple[pd.DataFrame, np.ndarray, int]:
    """Epoch AI's filtered Chinchilla table: (table with N, D, loss; kept original row numbers; rows read).

    Drops points with loss >= sorted(loss)[-drop_highest] (Epoch's filter; 240 of 245 points) and derives
    D = C / (6 N).
    """
    path = Path(csv_path) if csv_path else CHINCHILLA_CSV
    if not path.exists():
        raise MissingInput(f"Chinchilla data not found at {path} (it ships as package data in "
                           "smelt_jax/reference_data/chinchilla/; see that folder's README)")
    raw = pd.read_csv(path)
    loss = raw["loss"].to_numpy(float)
    kept = np.flatnonzero(loss < np.sort(loss)[-drop_highest]) if drop_highest else np.arange(len(raw))
    n, c = raw["Model Size"].to_numpy(float), raw["Training FLOP"].to_numpy(float)
    table = pd.DataFrame({"N": n[kept], "D": c[kept] / (6.0 * n[kept]), "loss": loss[kept], "cell": kept})
    return table, kept, len(raw)


def load_coefficients(path) -> dict:
    """coefficients.json from a fit directory or a JSON file; must name its law and parameters."""
    path = Path(path)
    if path.is_dir():
        path = path / "coefficients.json"
    if not path.exists():
        raise MissingInput(f"no coefficients at {path} (write them with `smelt fit`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or "law" not in data:
        raise UsageError(f"{path}: missing 'law'")
    data["_law"] = law_from_dict(data["law"], data)
    data["_path"] = str(path)
    return data


def fit_losses(fit) -> list[float] | None:
    """The losses of the points a fit was fitted to (points.csv beside its coefficients.json; `fit`: the
    folder or a `load_coefficients` dict), or None when there is no such file or column: what
    `health.assess_fit` needs to see a constant-loss table."""
    folder = Path(fit["_path"]).parent if isinstance(fit, dict) else Path(fit)
    try:
        points = pd.read_csv(folder / "points.csv")
    except (OSError, ValueError):
        return None
    return [float(v) for v in points["loss"]] if "loss" in points.columns else None

"""Tables (markdown, CSV, LaTeX) and figures (PNG, PDF; matplotlib Agg) from fits and CE-gain rows.

Deterministic output: rows sorted, floats written with fixed formats (CSV: at the precision of
scaling/written.py), figure metadata dates removed.
"""

from __future__ import annotations

import csv
import io as _io
from pathlib import Path

import numpy as np

from smelt_jax.platform.storage import naming
from smelt_jax.scaling import written

# TPP to 0.1 below 1e4 (every frontier the paper's laws give), else 4 significant digits (a degenerate
# fit's optimum runs off to 1e8 tokens per parameter, and its 9th digit is the CPU's)
TPP_FORMAT = "{:.1f}"
TPP_FORMAT_LARGE = "{:.3e}"


class _Tpp:
    @staticmethod
    def format(value) -> str:
        return (TPP_FORMAT if abs(value) < 1e4 else TPP_FORMAT_LARGE).format(value)


# fixed formats per column kind, so regenerated files diff only on real changes
FORMATS = {"C": "{:.0e}", "S": "{:.2f}", "ce_gain": "{:.2%}", "ce_lo": "{:.1%}", "ce_hi": "{:.1%}",
           "tpp_reference": _Tpp, "tpp_target": _Tpp, "loss_target": "{:.4f}",
           "loss_reference": "{:.4f}"}


NOT_FINITE = "n/a"  # a degenerate fit's infinite or undefined value, written as such in every table
MAX_TABLE_VALUE = 1e30  # above this a value is an artefact of a degenerate fit, not a number to read


def fmt(value, column: str = "") -> str:
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if value is None or not np.isfinite(value) or abs(value) > MAX_TABLE_VALUE:
        return NOT_FINITE
    if column in FORMATS:
        return FORMATS[column].format(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.6g}"
    return f"{value:.4e}"


def to_markdown(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> str:
    headers = headers or columns
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c, ""), c) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict], columns: list[str]) -> str:
    buffer = _io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([fmt(row.get(c, ""), c).replace("%", "") if c in FORMATS else
                         (repr(written.rounded(float(row[c]), key=c)) if isinstance(row.get(c), float)
                          else row.get(c, ""))
                         for c in columns])
    return buffer.getvalue()


def to_latex(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> str:
    headers = headers or columns
    escape = lambda s: s.replace("%", r"\%").replace("_", r"\_")
    lines = [r"\begin{tabular}{" + "l" * len(columns) + "}", r"\hline",
             " & ".join(escape(h) for h in headers) + r" \\", r"\hline"]
    for row in rows:
        lines.append(" & ".join(escape(fmt(row.get(c, ""), c)) for c in columns) + r" \\")
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_table(out_dir, stem: str, rows: list[dict], columns: list[str], headers=None) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in ((".md", to_markdown(rows, columns, headers)), (".csv", to_csv(rows, columns)),
                         (".tex", to_latex(rows, columns, headers))):
        path = out_dir / f"{stem}{suffix}"
        with naming(path):  # a full disk says which file (issue 53)
            path.write_text(text)
        paths.append(path)
    return paths


def write_frame(out_dir, stem: str, frame) -> list[Path]:
    """`write_table` of a DataFrame: one row per record, its columns in order."""
    return write_table(out_dir, stem, frame.to_dict("records"), list(frame.columns))


def coefficient_rows(coefficients: dict) -> list[dict]:
    """One row per parameter: estimate, and SE / interval when bootstrapped."""
    law = coefficients["_law"]
    intervals = coefficients.get("intervals", {})
    rows = []
    for name in law.param_names:
        row = {"parameter": name, "estimate": float(getattr(law, name))}
        if name in intervals:
            row.update({"se": intervals[name]["se"], "lo": intervals[name]["lo"], "hi": intervals[name]["hi"]})
        rows.append(row)
    return rows


GAIN_COLUMNS = ["C", "S", "ce_gain", "ce_lo", "ce_hi", "tpp_reference", "tpp_target", "loss_target",
                "extrapolated"]
GAIN_HEADERS = ["C", "S", "CE gain", "CE lo", "CE hi", "TPP ref", "TPP target", "L* target", "extrapolated"]


def gain_columns(rows):
    keep = [c for c in GAIN_COLUMNS if any(c in r for r in rows)]
    return keep, [GAIN_HEADERS[GAIN_COLUMNS.index(c)] for c in keep]

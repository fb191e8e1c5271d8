"""Tables (markdown, CSV, LaTeX) and figures (PNG, PDF; matplotlib Agg) from fits and CE-gain rows.

Deterministic output: rows sorted, floats written with fixed formats, figure metadata dates removed.
"""

from __future__ import annotations

import csv
import io as _io
from pathlib import Path

import numpy as np

# fixed formats per column kind, so regenerated files diff only on real changes
FORMATS = {"C": "{:.0e}", "S": "{:.2f}", "ce_gain": "{:.2%}", "ce_lo": "{:.1%}", "ce_hi": "{:.1%}",
           "tpp_reference": "{:.1f}", "tpp_target": "{:.1f}", "loss_target": "{:.4f}",
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
                         (repr(float(row[c])) if isinstance(row.get(c), float) else row.get(c, ""))
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


# ---------------------------------------------------------------------------------------------------
# figures

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(x, y):
    """The points of a curve that can be drawn on a log-x axis: finite, x > 0, |y| not absurd."""
    x, y = np.broadcast_arrays(np.asarray(x, float), np.asarray(y, float))
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (np.abs(y) < MAX_TABLE_VALUE)
    return x[keep], y[keep]


def _note_missing(ax, missing: list[str]) -> None:
    """Say on the figure which curves a degenerate fit left nothing finite to draw for."""
    if missing:
        ax.text(0.02, 0.02, "no finite values (degenerate fit): " + ", ".join(missing),
                transform=ax.transAxes, fontsize=6, color="firebrick", va="bottom")


def _save(fig, out_dir, stem) -> list[Path]:
    paths = [Path(out_dir) / f"{stem}.png", Path(out_dir) / f"{stem}.pdf"]
    fig.savefig(paths[0], dpi=100, metadata={"Software": None})
    fig.savefig(paths[1], metadata={"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None})
    return paths


def loss_vs_compute_figure(out_dir, laws: dict, points=None, sparsities=(0.85, 0.95, 0.97),
                           compute=(1e18, 1e23)) -> list[Path]:
    """Frontier L*(C, S) per law (solid/dashed per law) and, if given, the fitted points [F*D, loss]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    grid = np.logspace(np.log10(compute[0]), np.log10(compute[1]), 200)
    colours = plt.cm.viridis(np.linspace(0.1, 0.85, len(sparsities)))
    missing = []
    for (name, law), style in zip(sorted(laws.items()), ("-", "--", ":", "-.")):
        for s, colour in zip(sparsities, colours):
            with np.errstate(all="ignore"):
                x, y = _finite(grid, law.frontier_loss(grid, s))
            if x.size:
                ax.plot(x, y, style, color=colour, label=f"{name} S={s:.2f}")
            else:
                missing.append(f"{name} S={s:.2f}")
    if points is not None:
        # measured endpoints: colour = sparsity, marker = architecture (when the table names it)
        archs = points["arch"].astype(str) if "arch" in points.columns else None
        markers = {name: marker for name, marker in zip(sorted(laws), ("o", "x", "^", "s"))}
        for s, colour in zip(sparsities, colours):
            near = np.abs(points["S"].to_numpy(float) - s) < 0.02
            groups = [(None, near)] if archs is None else [
                (name, near & (archs == name).to_numpy()) for name in sorted(laws)]
            for name, keep in groups:
                x, y = _finite(points["F"][keep] * points["D"][keep], points["loss"][keep])
                if x.size:
                    ax.scatter(x, y, s=14, color=colour, marker=markers.get(name, "o"))
    _note_missing(ax, missing)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C = F D (FLOPs)")
    ax.set_ylabel("loss (nats)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths = _save(fig, out_dir, "loss_vs_compute")
    plt.close(fig)
    return paths


def ce_gain_figure(out_dir, reference, target, sparsities=(0.85, 0.95, 0.97), compute=(1e19, 1e23),
                   reference_draws=None, target_draws=None, compute_range=None) -> list[Path]:
    """CE gain vs compute per sparsity, with the 95% bootstrap band when draws are given."""
    from smelt_jax.scaling.gains import ce_gain

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    grid = np.logspace(np.log10(compute[0]), np.log10(compute[1]), 100)
    colours = plt.cm.viridis(np.linspace(0.1, 0.85, len(sparsities)))
    missing = []
    for s, colour in zip(sparsities, colours):
        with np.errstate(all="ignore"):
            x, y = _finite(grid, 100 * ce_gain(reference, target, grid, s))
        if not x.size:
            missing.append(f"S={s:.2f}")
            continue
        ax.plot(x, y, color=colour, label=f"S={s:.2f}")
        if reference_draws is not None and target_draws is not None:
            with np.errstate(all="ignore"):
                draws = np.array([ce_gain(r, t, grid, s) for r, t in zip(reference_draws, target_draws)])
            draws = np.where(np.isfinite(draws), draws, np.nan)
            ok = np.isfinite(draws).sum(0) > 0
            if ok.any():
                lo = np.nanpercentile(draws[:, ok], 2.5, axis=0)
                hi = np.nanpercentile(draws[:, ok], 97.5, axis=0)
                ax.fill_between(grid[ok], 100 * lo, 100 * hi, color=colour, alpha=0.2)
    _note_missing(ax, missing)
    if compute_range is not None:
        ax.axvspan(*compute_range, color="grey", alpha=0.1, label="fitted compute range")
    ax.set_xscale("log")
    ax.set_xlabel("target compute C (FLOPs)")
    ax.set_ylabel("compute-equivalent gain (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = _save(fig, out_dir, "ce_gain")
    plt.close(fig)
    return paths

"""Figures of fits (`smelt tables`, `fit-suite`, `fits-all`): loss against compute per law with its
endpoints, the CE gain against compute with its interval, each drawn over the data's compute range (solid)
and beyond it (dashed), a degenerate fit titled as such; PNG and PDF with no date metadata. Split from
tables.py (issue 52): tables and figures are two outputs of one fit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from smelt_jax.platform.storage import naming
from smelt_jax.scaling.gains import ce_gain, fitted_compute_range
from smelt_jax.scaling.tables import MAX_TABLE_VALUE


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


SPARSITY_TOLERANCE = 0.02  # endpoints within this of a drawn sparsity level are shown at that level
AXIS_MARGIN = 3.0  # the axis reaches this factor beyond the data's compute range (drawn as extrapolation)
EXTRAPOLATED = "extrapolated (outside the data's compute range)"
DATA_RANGE = "data's compute range"


def point_sparsities(points) -> list[float]:
    """The sparsity levels of a table of fitted points, to 0.01: mean S per `sparsity_label` where the
    table has one, else the means of runs of sorted S values that lie within SPARSITY_TOLERANCE."""
    if "sparsity_label" in points.columns:
        return sorted({round(float(s), 2) for s in points.groupby("sparsity_label")["S"].mean()})
    levels, group = [], []
    for s in sorted(float(v) for v in points["S"].unique()):
        if group and s - group[0] >= SPARSITY_TOLERANCE:
            levels.append(round(float(np.mean(group)), 2))
            group = []
        group.append(s)
    return sorted({*levels, round(float(np.mean(group)), 2)})


def compute_axis(compute_range, compute=None) -> tuple[float, float]:
    """The x extent of a figure: the data's compute range, widened to cover `compute` (e.g. the
    tabulated computes) where given, and AXIS_MARGIN beyond that each side."""
    low, high = compute_range
    if compute is not None:
        low, high = min(low, min(compute)), max(high, max(compute))
    return float(low / AXIS_MARGIN), float(high * AXIS_MARGIN)


def _segments(ax, grid, values, compute_range, colour, label) -> bool:
    """Draw one curve: solid inside compute_range (labelled `label`), dashed outside it (labelled
    '_extrapolated LABEL', kept out of the legend). Returns False when nothing finite was drawn."""
    x, y = _finite(grid, values)
    if not x.size:
        return False
    if compute_range is None:
        ax.plot(x, y, "-", color=colour, label=label)
        return True
    # the dashed pieces share their end points with the solid one (the grid holds the range's ends)
    pieces = (((x >= compute_range[0]) & (x <= compute_range[1]), "-", 1.2, label),
              (x <= compute_range[0], "--", 0.9, f"_extrapolated {label}"),
              (x >= compute_range[1], "--", 0.9, f"_extrapolated {label}"))
    for keep, style, width, name in pieces:
        if keep.sum() >= 2:
            ax.plot(x[keep], y[keep], style, color=colour, linewidth=width, label=name)
    return True


def _mark_problems(ax, problems) -> None:
    """A fit that health.assess_fit found wanting says so on the figure: a red title naming the kind of
    problem, and each problem (without its explanation in brackets) in a box on the axes."""
    problems = list(problems or ())
    if not problems:
        return
    kind = "degenerate fit" if any("degenerate" in p for p in problems) else "fit problem"
    short = [p.split(" (")[0].replace(": degenerate:", ":") for p in problems]
    ax.set_title(f"{kind}: not a measurement", color="firebrick", fontsize=9)
    ax.text(0.98, 0.98, "\n".join(short), transform=ax.transAxes, fontsize=6, color="firebrick",
            ha="right", va="top", bbox={"facecolor": "white", "edgecolor": "firebrick", "alpha": 0.85})


def _note_missing(ax, missing: list[str]) -> None:
    """Say on the figure which curves a degenerate fit left nothing finite to draw for."""
    if missing:
        ax.text(0.02, 0.02, "no finite values (degenerate fit): " + ", ".join(missing),
                transform=ax.transAxes, fontsize=6, color="firebrick", va="bottom")


def save_figure(fig, out_dir, stem) -> list[Path]:
    """`stem`.png and `stem`.pdf with no date or software metadata (the same bytes on every run)."""
    paths = [Path(out_dir) / f"{stem}.png", Path(out_dir) / f"{stem}.pdf"]
    with naming(paths[0]):
        fig.savefig(paths[0], dpi=100, metadata={"Software": None})
    with naming(paths[1]):
        fig.savefig(paths[1], metadata={"CreationDate": None, "ModDate": None, "Producer": None,
                                        "Creator": None})
    return paths


FAMILIES = ("Blues", "Oranges", "Greens", "Purples")  # one colour family per law, shade = sparsity
MARKERS = ("o", "x", "^", "s")  # one point marker per law
STYLE_OF = {"baseline": 0, "smelt": 1}  # the suites' two architectures look the same in every figure


def _style_index(names: list[str], name: str) -> int:
    """The colour family / marker of law `name` among `names`: STYLE_OF's where it has one, else the
    free ones in order."""
    if name in STYLE_OF:
        return STYLE_OF[name]
    free = [i for i in range(len(FAMILIES)) if i not in {STYLE_OF[n] for n in names if n in STYLE_OF}]
    others = [n for n in names if n not in STYLE_OF]
    return free[others.index(name) % len(free)]


def _shades(plt, family: str, n: int):
    return plt.get_cmap(family)(np.linspace(0.55, 0.95, n) if n > 1 else [0.8])


def _legend_extras(plt, compute_range) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    extras = []
    if compute_range is not None:
        extras += [Line2D([], [], linestyle="--", color="grey", linewidth=0.9, label=EXTRAPOLATED),
                   Patch(color="grey", alpha=0.12, label=f"{DATA_RANGE} {compute_range[0]:.1e}-{compute_range[1]:.1e}")]
    return extras


def loss_vs_compute_plot(laws: dict, points=None, sparsities=None, compute=None, compute_range=None,
                         problems=()):
    """The loss-vs-compute figure (a matplotlib Figure): each law's frontier L*(C, S) at each sparsity
    (colour family = law, shade = sparsity), solid over the data's compute range and dashed, labelled
    extrapolated, beyond it; the fitted endpoints [F*D, loss] (marker = law, in the legend); a fit
    problem (health.assess_fit sentences in `problems`) in a red title and box.

    sparsities: levels to draw (default: the points', `point_sparsities`). compute_range: (C_min, C_max)
    of the fitted data (default: the points'). compute: computes the x axis must also reach (e.g. the
    tabulated ones); the axis is the data range widened by AXIS_MARGIN (`compute_axis`).
    """
    from matplotlib.lines import Line2D

    if sparsities is None:
        if points is None:
            raise ValueError("loss_vs_compute_plot needs sparsities or points to take them from")
        sparsities = point_sparsities(points)
    if compute_range is None and points is not None:
        compute_range = fitted_compute_range(points["F"], points["D"])
    if compute_range is None and compute is None:
        raise ValueError("loss_vs_compute_plot needs a data range, points or a compute extent")
    extent = compute_axis(compute_range, compute) if compute_range is not None else (min(compute), max(compute))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    grid = np.logspace(np.log10(extent[0]), np.log10(extent[1]), 240)
    if compute_range is not None:
        grid = np.unique(np.concatenate([grid, compute_range]))  # the solid piece ends exactly at the data
        ax.axvspan(*compute_range, color="grey", alpha=0.12, linewidth=0)
    names = sorted(laws)
    shades = {name: _shades(plt, FAMILIES[_style_index(names, name)], len(sparsities)) for name in names}
    missing, handles = [], []
    for name in names:
        for s, colour in zip(sparsities, shades[name]):
            with np.errstate(all="ignore"):
                values = laws[name].frontier_loss(grid, s)
            if _segments(ax, grid, values, compute_range, colour, f"{name} S={s:.2f}"):
                handles.append(Line2D([], [], color=colour, label=f"{name} frontier S={s:.2f}"))
            else:
                missing.append(f"{name} S={s:.2f}")
    if points is not None:
        # colour = the law's family at the point's sparsity, marker = the law (the table's arch column);
        # without one, or with a single law, every point is that law's
        archs = points["arch"].astype(str).to_numpy() if "arch" in points.columns else None
        single = archs is None or len(names) == 1
        for name in names:
            marker, drawn = MARKERS[_style_index(names, name)], False
            for s, colour in zip(sparsities, shades[name]):
                keep = np.abs(points["S"].to_numpy(float) - s) < SPARSITY_TOLERANCE
                if not single:
                    keep &= archs == name
                x, y = _finite(points["F"][keep] * points["D"][keep], points["loss"][keep])
                if x.size:
                    ax.scatter(x, y, s=14, color=colour, marker=marker, label=f"_{name} endpoints S={s:.2f}")
                    drawn = True
            if drawn:
                handles.append(Line2D([], [], linestyle="none", marker=marker, color=shades[name][-1],
                                      label=f"{name} endpoints"))
    handles += _legend_extras(plt, compute_range)
    _note_missing(ax, missing)
    _mark_problems(ax, problems)
    ax.set_xscale("log")
    ax.set_xlim(*extent)
    ax.set_xlabel("training compute C = F D (FLOPs)")
    ax.set_ylabel("loss (nats)")
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    fig.tight_layout()
    return fig


def loss_vs_compute_figure(out_dir, laws: dict, points=None, sparsities=None, compute=None, compute_range=None,
                           problems=()) -> list[Path]:
    """`loss_vs_compute_plot` written to OUT_DIR/loss_vs_compute.{png,pdf}."""
    plt = _pyplot()
    fig = loss_vs_compute_plot(laws, points, sparsities, compute, compute_range, problems)
    paths = save_figure(fig, out_dir, "loss_vs_compute")
    plt.close(fig)
    return paths


def fd_loss_vs_compute_figure(out_dir, laws: dict, points, problems=()) -> list[Path]:
    """The pre-registered analysis's figure (OUT_DIR/loss_vs_compute.{png,pdf}): each architecture's
    fitted frontier L*(C) of L(F, D) = E + A / F^a + K / D^c (ChinchillaLaw in N = F / 6), solid over
    the data's compute range and dashed beyond it, and its endpoints [F*D, loss] (`points`: arch, F, D,
    loss; marker = architecture); fits that do not count are named in a red box (`problems`)."""
    from matplotlib.lines import Line2D

    compute = points["F"].to_numpy(float) * points["D"].to_numpy(float)
    compute_range = (float(compute.min()), float(compute.max()))
    extent = compute_axis(compute_range)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    grid = np.unique(np.concatenate([np.logspace(np.log10(extent[0]), np.log10(extent[1]), 240), compute_range]))
    ax.axvspan(*compute_range, color="grey", alpha=0.12, linewidth=0)
    names, handles, missing = sorted(laws), [], []
    for name in names:
        index = _style_index(names, name)
        colour = _shades(plt, FAMILIES[index], 1)[0]
        with np.errstate(all="ignore"):
            values = laws[name].frontier_loss(grid)
        if _segments(ax, grid, values, compute_range, colour, f"{name} frontier"):
            handles.append(Line2D([], [], color=colour, label=f"{name} frontier"))
        else:
            missing.append(name)
        keep = points["arch"].astype(str).to_numpy() == name
        for n_value in sorted(set(points["N"][keep])):  # the fit through each width's horizons
            d = np.geomspace(points["D"][keep].min(), points["D"][keep].max(), 60)
            with np.errstate(all="ignore"):
                fx, fy = _finite(6.0 * n_value * d, laws[name].predict(n_value, d))
            ax.plot(fx, fy, ":", color=colour, linewidth=0.8, label=f"_{name} fit at N={n_value:.3g}")
        x, y = _finite(compute[keep], points["loss"].to_numpy(float)[keep])
        if x.size:
            ax.scatter(x, y, s=14, color=colour, marker=MARKERS[index], label=f"_{name} endpoints")
            handles.append(Line2D([], [], linestyle="none", marker=MARKERS[index], color=colour,
                                  label=f"{name} endpoints"))
    handles.append(Line2D([], [], linestyle=":", color="grey", linewidth=0.8, label="fit at each width, L(F, D)"))
    handles += _legend_extras(plt, compute_range)
    _note_missing(ax, missing)
    _mark_problems(ax, [textwrap.fill(p, 70) for p in problems])
    ax.set_xscale("log")
    ax.set_xlim(*extent)
    ax.set_xlabel("training compute C = F D (FLOPs)")
    ax.set_ylabel("validation loss (nats)")
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    paths = save_figure(fig, out_dir, "loss_vs_compute")
    plt.close(fig)
    return paths


CLIP_SPAN = 3.0  # clip the y axis when the drawn values span more than this times those inside the range


def _clip_to_range(ax, drawn, drawn_inside) -> None:
    """Fit the y axis to what is drawn inside the data's compute range when the extrapolated part
    (typically a bootstrap band that widens without bound) would otherwise flatten it, and say on the
    figure how far the clipped part reaches."""
    values = np.concatenate([np.ravel(v) for v in drawn]) if drawn else np.array([])
    inner = np.concatenate([np.ravel(v) for v in drawn_inside]) if drawn_inside else np.array([])
    values, inner = values[np.isfinite(values)], inner[np.isfinite(inner)]
    if not inner.size:
        return
    low, high = float(inner.min()), float(inner.max())
    pad = max(0.1 * (high - low), 1.0)
    low, high = low - pad, high + pad
    if float(values.max() - values.min()) > CLIP_SPAN * (high - low):
        ax.set_ylim(low, high)
        ax.text(0.02, 0.06, f"y axis fitted to the data's compute range; outside it the drawn values reach "
                f"{values.min():.3g}% to {values.max():.3g}% (clipped)", transform=ax.transAxes, fontsize=6,
                color="dimgrey", va="bottom")


def ce_gain_plot(reference, target, sparsities, compute=None, reference_draws=None, target_draws=None,
                 compute_range=None, problems=()):
    """The CE-gain figure (a matplotlib Figure): gain vs compute per sparsity, solid over the data's
    compute range (shaded) and dashed, labelled extrapolated, beyond it; the 95% bootstrap band where
    draws are given; a fit problem in a red title and box. compute / compute_range as in
    `loss_vs_compute_plot` (one of them is needed)."""
    if compute_range is None and compute is None:
        raise ValueError("ce_gain_plot needs a data range or a compute extent")
    extent = compute_axis(compute_range, compute) if compute_range is not None else (min(compute), max(compute))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    grid = np.logspace(np.log10(extent[0]), np.log10(extent[1]), 120)
    if compute_range is not None:
        grid = np.unique(np.concatenate([grid, compute_range]))
        ax.axvspan(*compute_range, color="grey", alpha=0.12, linewidth=0)
    colours = plt.cm.viridis(np.linspace(0.1, 0.85, len(sparsities)))
    inside = np.ones(grid.shape, bool) if compute_range is None else (
        (grid >= compute_range[0]) & (grid <= compute_range[1]))
    missing, drawn, drawn_inside = [], [], []  # every finite y value drawn, and those inside the range
    for s, colour in zip(sparsities, colours):
        with np.errstate(all="ignore"):
            values = 100 * ce_gain(reference, target, grid, s)
        if not _segments(ax, grid, values, compute_range, colour, f"S={s:.2f}"):
            missing.append(f"S={s:.2f}")
            continue
        drawn.append(values), drawn_inside.append(values[inside])
        if reference_draws is not None and target_draws is not None:
            with np.errstate(all="ignore"):
                draws = np.array([ce_gain(r, t, grid, s) for r, t in zip(reference_draws, target_draws)])
            draws = np.where(np.isfinite(draws), draws, np.nan)
            ok = np.isfinite(draws).sum(0) > 0
            if ok.any():
                lo = np.nanpercentile(draws[:, ok], 2.5, axis=0)
                hi = np.nanpercentile(draws[:, ok], 97.5, axis=0)
                ax.fill_between(grid[ok], 100 * lo, 100 * hi, color=colour, alpha=0.2,
                                label=f"_95% band S={s:.2f}")
                drawn += [100 * lo, 100 * hi]
                drawn_inside += [100 * lo[inside[ok]], 100 * hi[inside[ok]]]
    _clip_to_range(ax, drawn, drawn_inside)
    _note_missing(ax, missing)
    _mark_problems(ax, problems)
    ax.set_xscale("log")
    ax.set_xlim(*extent)
    ax.set_xlabel("target compute C (FLOPs)")
    ax.set_ylabel("compute-equivalent gain (%)")
    handles, _ = ax.get_legend_handles_labels()
    if reference_draws is not None and target_draws is not None:
        from matplotlib.patches import Patch

        handles.append(Patch(color="grey", alpha=0.3, label="95% bootstrap band"))
    ax.legend(handles=handles + _legend_extras(plt, compute_range), fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    fig.tight_layout()
    return fig


def ce_gain_figure(out_dir, reference, target, sparsities, compute=None, reference_draws=None,
                   target_draws=None, compute_range=None, problems=()) -> list[Path]:
    """`ce_gain_plot` written to OUT_DIR/ce_gain.{png,pdf}."""
    plt = _pyplot()
    fig = ce_gain_plot(reference, target, sparsities, compute, reference_draws, target_draws, compute_range,
                       problems)
    paths = save_figure(fig, out_dir, "ce_gain")
    plt.close(fig)
    return paths

"""The loss-vs-compute and CE-gain figures, read back from their matplotlib objects: frontiers solid over
the data's compute range and dashed beyond it, sparsities from the data, point markers in the legend, a
degenerate fit named on the figure."""

import matplotlib
import numpy as np
import pandas as pd
import pytest
from scaling_synthetic import paper_pair_table

from smelt_jax.design import paper
from smelt_jax.scaling import figures, health
from smelt_jax.scaling.laws import replace

matplotlib.use("Agg")

LAWS = {"baseline": paper.BASELINE_LAW, "smelt": paper.SMELT_LAW}
RANGE = (2e19, 8e20)


def _curves(ax):
    """(solid lines, dashed extrapolation lines) of an axes, by their labels."""
    solid = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    dashed = [line for line in ax.get_lines() if line.get_label().startswith("_extrapolated")]
    return solid, dashed


def _assert_solid_inside_dashed_outside(ax, compute_range, n_solid):
    solid, dashed = _curves(ax)
    assert len(solid) == n_solid
    for line in solid:
        x = np.asarray(line.get_xdata(), float)
        assert line.get_linestyle() == "-"
        assert x.min() == pytest.approx(compute_range[0]) and x.max() == pytest.approx(compute_range[1])
    assert dashed, "no extrapolated segment drawn"
    for line in dashed:
        x = np.asarray(line.get_xdata(), float)
        assert line.get_linestyle() == "--"
        assert np.all((x <= compute_range[0] * (1 + 1e-12)) | (x >= compute_range[1] * (1 - 1e-12)))


def _problems(law, arch="smelt"):
    return health.assess_fit({"arch": arch, "n_points": 72, **law.to_dict()})


def test_frontiers_span_the_data_range_and_extrapolate_dashed():
    points = paper_pair_table(noise=0.0)
    fig = figures.loss_vs_compute_plot(LAWS, points, compute_range=RANGE, compute=[1e22])
    ax = fig.axes[0]
    _assert_solid_inside_dashed_outside(ax, RANGE, n_solid=6)   # 2 laws x the points' 3 sparsities
    assert ax.get_xlim() == pytest.approx((RANGE[0] / figures.AXIS_MARGIN, 1e22 * figures.AXIS_MARGIN))
    assert {line.get_label() for line in _curves(ax)[0]} == {
        f"{arch} S={s}" for arch in LAWS for s in ("0.85", "0.95", "0.97")}
    assert ax.get_title() == ""  # a healthy fit carries no warning


def test_legend_shows_the_point_markers_and_the_extrapolation():
    fig = figures.loss_vs_compute_plot(LAWS, paper_pair_table(noise=0.0), compute_range=RANGE)
    legend = fig.axes[0].get_legend()
    by_label = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
    assert by_label["baseline endpoints"].get_marker() == "o"
    assert by_label["smelt endpoints"].get_marker() == "x"
    assert by_label["baseline endpoints"].get_linestyle() == "None"
    assert by_label[figures.EXTRAPOLATED].get_linestyle() == "--"
    assert any(label.startswith(figures.DATA_RANGE) for label in by_label)
    # the scatter markers drawn are the legend's
    markers = {c.get_label().split()[0].lstrip("_"): c for c in fig.axes[0].collections
               if "endpoints" in c.get_label()}
    assert set(markers) == {"baseline", "smelt"}


def test_without_a_given_range_the_points_set_range_and_sparsities():
    points = paper_pair_table(noise=0.0)
    points = points[points["S"] != 0.97].assign(S=lambda t: t["S"] + np.where(t["arch"] == "smelt", 0.004, 0))
    fig = figures.loss_vs_compute_plot(LAWS, points)
    compute = points["F"] * points["D"]
    _assert_solid_inside_dashed_outside(fig.axes[0], (compute.min(), compute.max()), n_solid=4)
    assert {line.get_label().split("=")[1] for line in _curves(fig.axes[0])[0]} == {"0.85", "0.95"}


def test_point_sparsities_by_label_or_by_gaps():
    table = pd.DataFrame({"S": [0.843, 0.846, 0.951, 0.949, 0.0]})
    assert figures.point_sparsities(table) == [0.0, 0.84, 0.95]
    labelled = table.assign(sparsity_label=["s85", "s85", "s95", "s95", "s0"])
    assert figures.point_sparsities(labelled) == [0.0, 0.84, 0.95]
    assert figures.point_sparsities(pd.DataFrame({"S": [0.5, 0.51, 0.515, 0.6]})) == [0.51, 0.6]


def test_a_degenerate_fit_is_named_on_both_figures():
    degenerate = replace(paper.SMELT_LAW, E=0.0)
    problems = _problems(degenerate)
    assert problems  # health.assess_fit finds it
    laws = {"baseline": paper.BASELINE_LAW, "smelt": degenerate}
    for fig in (figures.loss_vs_compute_plot(laws, sparsities=[0.95], compute_range=RANGE, problems=problems),
                figures.ce_gain_plot(paper.BASELINE_LAW, degenerate, [0.95], compute_range=RANGE,
                                    problems=problems)):
        ax = fig.axes[0]
        assert ax.get_title().startswith("degenerate fit")
        texts = [t.get_text() for t in ax.texts]
        assert any("smelt: irreducible loss E = 0" in t for t in texts), texts
    assert not _problems(paper.SMELT_LAW)


def test_ce_gain_solid_over_the_data_range_with_the_paper_range():
    fig = figures.ce_gain_plot(paper.BASELINE_LAW, paper.SMELT_LAW, paper.SPARSITIES, compute=paper.COMPUTES,
                              compute_range=paper.COMPUTE_RANGE)
    ax = fig.axes[0]
    _assert_solid_inside_dashed_outside(ax, paper.COMPUTE_RANGE, n_solid=3)
    assert ax.get_xlim() == pytest.approx((paper.COMPUTE_RANGE[0] / figures.AXIS_MARGIN,
                                           1e22 * figures.AXIS_MARGIN))
    # the solid curve at 1e21 is the tabulated gain (15.7% at S 0.95)
    solid = {line.get_label(): line for line in _curves(ax)[0]}["S=0.95"]
    x, y = np.asarray(solid.get_xdata(), float), np.asarray(solid.get_ydata(), float)
    assert np.interp(21, np.log10(x), y) == pytest.approx(15.7, abs=0.1)


def test_y_axis_clipped_only_when_the_extrapolation_would_flatten_the_data_range():
    plt = figures._pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [0, 10, -1e4])
    figures._clip_to_range(ax, [np.array([0.0, 10.0, -1e4])], [np.array([0.0, 10.0])])
    assert ax.get_ylim() == pytest.approx((-1.0, 11.0))
    assert any("clipped" in t.get_text() and "-1e+04" in t.get_text() for t in ax.texts)
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [0, 10, 20])
    before = ax.get_ylim()
    figures._clip_to_range(ax, [np.array([0.0, 10.0, 20.0])], [np.array([0.0, 10.0])])
    assert ax.get_ylim() == before and not ax.texts

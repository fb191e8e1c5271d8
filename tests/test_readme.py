"""The front page (issue 52): what the suite has found comes before the first command, and every number in
its findings table is recomputed here from the file it comes from (links are checked by test_docs_truth)."""

from __future__ import annotations

import re
from math import comb
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from smelt_jax.design import paper

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FITS = ROOT / "fits"


def _findings() -> str:
    start = README.index("## What it has found so far")
    return README[start:README.index("\n## ", start + 1)]


def _generated_tables(doc: Path) -> list[list[list[str]]]:
    """Every markdown table inside a doc's generated pair-cost block, as rows of cells."""
    text = doc.read_text()
    block = text[text.index("<!-- pair-cost:begin"):text.index("<!-- pair-cost:end")]
    tables, rows = [], []
    for line in block.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _table(header_word: str) -> pd.DataFrame:
    for rows in _generated_tables(ROOT / "docs" / "tpu-quickstart.md"):
        if any(header_word in cell for cell in rows[0]):
            return pd.DataFrame(rows[1:], columns=rows[0])
    raise AssertionError(f"no generated table with a {header_word!r} column")


def _percent(cell: str) -> float:
    """The leading signed percentage of a cell such as "-10.3% [-12.8%, -7.2%]"."""
    return float(re.match(r"[+-]?\d+(\.\d+)?", cell).group(0))


def test_findings_come_before_the_first_command_and_link_their_records():
    first_command = README.index("make demo")
    assert README.index("## What it has found so far") < first_command
    assert README.index("## What it has found so far") < README.index("make test")
    for record in ("results-micro.md", "results-nano.md", "results-nano2.md", "results-ladder.md",
                   "tpu-quickstart.md"):
        assert f"(docs/{record})" in _findings(), record
    figure = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", _findings())
    assert figure and (ROOT / figure.group(1)).is_file()


def test_tpu_pricing_numbers_are_the_generated_tables():
    savings = _table("chip-hour saving")
    measured = savings[savings.iloc[:, 0].isin(["1e+20", "1e+21"])]
    flop = [paper.CE_GAIN[(c, s)][0] for c in (1e20, 1e21) for s in paper.SPARSITIES]
    chip = [_percent(cell) for cell in measured["chip-hour saving [range]"]]
    text = _findings()
    assert f"{min(flop):.1f}-{max(flop):.1f}% fewer FLOPs" in text
    assert f"{min(chip):+.1f}% to {max(chip):+.1f}% chip-hours" in text  # signed: a saving reads +
    ratios = _table("SMELT / Baseline")
    sparse = ratios[~ratios["pair"].str.endswith("S0")]["SMELT / Baseline"].astype(float)
    assert f"{sparse.min():.2f}-{sparse.max():.2f}x" in text
    total = _table("chip-hours >=")
    assert total[total["pair"] == "**all**"]["chip-hours >="].iloc[0].strip("*") in text
    limit = ratios[~ratios["pair"].str.endswith("S0") & ~ratios["pair"].str.startswith("1.6B")]
    floor, per_op = zip(*(map(float, cell.split("/")) for cell in limit["at the physical limit: floor / per-op"]))
    assert f"{min(floor):.2f}-{max(floor):.2f} (floor) to {min(per_op):.2f}-{max(per_op):.2f} (per op) up to 600M" in text


def test_cpu_scale_numbers_are_the_committed_results():
    text = _findings()
    wins = pd.read_csv(FITS / "micro" / "wins.csv")
    sparse = wins[wins["sparsity_label"] != "s0"]
    last, first = sparse[sparse["branch"] == sparse["branch"].max()], sparse[sparse["branch"] == 0]
    won = int(last["win"].sum())
    p_one_sided = sum(comb(len(last), k) for k in range(won, len(last) + 1)) / 2 ** len(last)
    assert f"**{won} of {len(last)}**" in text and f"p = {p_one_sided:.3f}" in text
    assert int(first["win"].sum()) == 0 and f"all {len(first)} at the first" in text

    nano = pd.read_csv(FITS / "nano" / "results.csv")
    nano = nano[~nano["pair_id"].str.contains("seed")]
    pairs = nano.pivot_table(index=["pair_id", "branch"], columns="arch", values="val_loss")
    behind = int((pairs["smelt"] > pairs["baseline"]).sum())
    assert f"**{behind} of {len(pairs)}**" in text
    long = pairs[pairs.index.get_level_values("branch") >= 3]  # the 4, 7 and 10M branches
    assert (long["smelt"] > long["baseline"]).all() and "every horizon of 4M tokens and more" in text
    widths = long.index.get_level_values("pair_id").nunique()  # the independent units: one run pair each
    assert f"over its {widths} pairs, sign test p = {2 / 2 ** widths:.3f}" in text
    at_10m = pairs.xs(5, level="branch")
    gaps = at_10m["smelt"] - at_10m["baseline"]
    assert f"{gaps['nano-d24-s95']:.3f} -> {gaps['nano-d96-s95']:.3f} nats" in text

    geometry = pd.read_csv(FITS / "nano2" / "geometry.csv")
    at_4m = geometry[geometry["tokens"] == 4e6].set_index("variant")["gap"]
    assert f"{at_4m['gqa2']:+.3f} -> {at_4m['gqa4']:+.3f}" in text
    ablations = pd.read_csv(FITS / "nano2" / "ablations.csv").set_index("point")["minus_r1"].drop("r1")
    assert f"{ablations.min():+.3f} to {ablations.max():+.3f} nats" in text
    assert np.isfinite(ablations).all()

    standing = pd.read_csv(FITS / "ladder" / "standing.csv").set_index("width")
    for width in (96, 160):
        assert standing.loc[width, "verdict"] == "SMELT trails"
        assert f"d{width} (+{standing.loc[width, 'gap_10M']:.3f}" in text
    assert standing.loc[128, "verdict"] == "tie"
    gqa4 = pd.read_csv(FITS / "ladder" / "gqa4.csv").set_index("pair")
    assert (f"+{gqa4.loc['d128 gqa4', 'gap_4M']:.3f} at d128 and +{gqa4.loc['d160 gqa4', 'gap_4M']:.3f} at d160"
            in text and f"+{gqa4.loc['d160 gqa4', 'multi_head_gap_4M']:.3f} there" in text)
    assert f"ties at d128 ({standing.loc[128, 'gap_10M']:+.3f}" in text


@pytest.mark.parametrize("command", ["make demo", "make test"])
def test_the_two_commands_say_what_they_do_and_how_long(command):
    line = next(line for line in README.splitlines() if line.startswith(command))
    assert "#" in line and re.search(r"\d+-\d+ min on 2 cores", line)

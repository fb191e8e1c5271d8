"""The HBM walk by category and its largest instructions: what `smelt compile ID --breakdown` prints.

    b = breakdown(hlo_text, overflow_passes=(expected, worst), n_top=25)
    b.by_category  # {category: bytes per device per step}; sums to b.total exactly (overflow at expected)
    b.top          # the n_top largest instructions: TopRow(name, op, shape, op_name, category, times, bytes)
    format_breakdown(b) -> text; category_header(), category_row(key, ...) -> the compile report's markdown table

Categories and the rules that file an instruction: `walk_categories`; the walk itself: `hbm_traffic`.
The MoE overflow loop (a loop of data-dependent trip count) is charged at its expected passes from
measured load (`overflow.step_overflow_passes`); the worst case is shown beside it.
"""

from __future__ import annotations

import dataclasses

from smelt_jax.compile.hbm_traffic import _walk
from smelt_jax.compile.walk_categories import CATEGORIES, OVERFLOW


@dataclasses.dataclass(frozen=True)
class TopRow:
    name: str
    op: str
    shape: str
    op_name: str
    category: str
    times: float  # executions per step (loops x trip count)
    bytes: float  # per step: times x bytes per execution


@dataclasses.dataclass(frozen=True)
class Breakdown:
    total: float  # per device per step, overflow loop at `overflow_passes`
    by_category: dict[str, float]  # CATEGORIES -> bytes; sums to total
    overflow_per_trip: float  # bytes one pass of the overflow loops adds (all layers, fwd + bwd)
    overflow_passes: float  # expected passes per layer (what total charges)
    overflow_passes_worst: float
    top: tuple[TopRow, ...]
    # walked bytes per execution of each instruction by name (`exchange_exposure` weighs async windows)
    bytes_by_name: dict[str, float] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def total_worst(self) -> float:
        return self.total + (self.overflow_passes_worst - self.overflow_passes) * self.overflow_per_trip

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "bytes_by_name"}


def breakdown(text: str, overflow_passes: tuple[float, float] = (1.0, 1.0), n_top: int = 25) -> Breakdown:
    """The walk of a compiled HLO module by category, with its `n_top` largest instructions."""
    expected, worst = overflow_passes
    charges, _, per_trip = _walk(text, expected)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for charge in charges:
        by_category[charge.category] += charge.total
    largest = sorted(charges, key=lambda c: c.total, reverse=True)[:n_top]
    top = tuple(TopRow(c.name, c.op, c.shape, c.op_name, c.category, c.times, c.total) for c in largest)
    return Breakdown(total=float(sum(by_category.values())), by_category=by_category,
                     overflow_per_trip=per_trip, overflow_passes=expected, overflow_passes_worst=worst,
                     top=top, bytes_by_name={c.name: c.bytes for c in charges})


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_breakdown(b: Breakdown, ideal: dict[str, float] | None = None) -> str:
    """Lines: bytes by category (GB, or MB for a small program, and share), beside them the ideal step's
    (`ideal`, `compile.ideal_step`: same categories) when given, the overflow loop's expected and worst
    case, the top rows."""
    unit, scale = ("GB", 1e9) if b.total >= 10e9 else ("MB", 1e6)
    gb = lambda value: f"{value / scale:,.1f}"
    head = f"  HBM walked by category ({unit} per device per step; total {gb(b.total)}"
    if ideal is not None:
        head += f"; ideal total {gb(sum(ideal.values()))}, walked / ideal in the last column"
    lines = [head + "):"]
    for category in CATEGORIES:
        value = b.by_category.get(category, 0.0)
        share = value / b.total if b.total else 0.0
        cell = ""
        if ideal is not None:
            want = ideal.get(category, 0.0)
            cell = f"  ideal {gb(want):>8}" + (f"  x{value / want:.1f}" if want else "         ")
        note = ""
        if category == OVERFLOW:
            note = (f"  ({b.overflow_passes:g} passes per layer expected, {gb(b.overflow_per_trip)} {unit} a pass; "
                    f"worst case {b.overflow_passes_worst:g} passes: "
                    f"{gb(b.overflow_passes_worst * b.overflow_per_trip)} {unit}, total {gb(b.total_worst)})")
        lines.append(f"    {category:<34} {gb(value):>10} {100 * share:5.1f}%{cell}{note}")
    lines.append(f"  top {len(b.top)} instructions ({unit} per step = times x bytes per execution):")
    lines.append(f"    {unit:>8} {'times':>7}  {'category':<20} {'instruction':<28} {'op':<14} shape | op_name")
    for row in b.top:
        lines.append(f"    {gb(row.bytes):>8} {row.times:>7g}  {_short(row.category, 20):<20} "
                     f"{_short(row.name, 28):<28} {row.op:<14} {_short(row.shape, 60)} | {_short(row.op_name, 110)}")
    return "\n".join(lines)


SHORT = {"expert exchange": "exchange", "permutations / gathers / scatters": "gather/scatter",
         "expert kernels": "expert kernels", "residual stacks": "stacks", "copies": "copies",
         "attention": "attention", "loss": "loss", "optimizer": "optimizer",
         "other collectives": "collectives", "other": "other", OVERFLOW: "overflow (worst)"}


def category_header() -> str:
    cells = " | ".join(SHORT[c] for c in CATEGORIES)
    return f"| config | total | {cells} |\n|---|---|" + "---|" * len(CATEGORIES)


def category_row(key: str, by_category: dict[str, float] | None, overflow_worst: float | None) -> str:
    """One markdown row, GB per device per step; the overflow cell adds the worst case in brackets."""
    if not by_category:
        return f"| {key} | ? |" + " ? |" * len(CATEGORIES)
    cells = []
    for category in CATEGORIES:
        cell = f"{by_category.get(category, 0.0) / 1e9:,.0f}"
        if category == OVERFLOW and overflow_worst is not None:
            cell += f" ({overflow_worst / 1e9:,.0f})"
        cells.append(cell)
    return f"| {key} | {sum(by_category.values()) / 1e9:,.0f} | " + " | ".join(cells) + " |"

"""An HLO module's text, parsed: its computations, their instructions, and how often each runs.

    entry, computations = parse_module(compiled.as_text())   # {computation: [Instruction, ...]}
    runs, trips = execution_counts(entry, computations)      # {computation: runs per step}, loop trips

The ENTRY computation runs once; a `while` body runs its trip count times (read from its condition:
`compare(get-tuple-element(param, 0), constant(N)), direction=LT`, the shape JAX's `scan` and
`fori_loop` lower to; a loop counter starting at 0 is assumed), unless the compiler states it
(`known_trip_count` in the loop's backend_config); fusions, calls and async wrappers run as often as
their caller. Read by `hlo_stats` (collectives), `hlo_async` (their async forms) and `hbm_traffic`
(the HBM walk).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2,
               "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
               "c64": 8, "c128": 16}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-permute")

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# The later halves of an async op (`async-update`, `async-done`, `all-gather-done`, ...): they name the
# computation their start runs (`calls=`) but do not run it again.
_ASYNC_FOLLOWERS = ("-done", "-update")
# A computation of another execution thread closes with its attributes: `}, execution_thread="sparsecore"`.
_CLOSE_WITH_ATTRIBUTES = "}, execution_thread="


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    op: str
    rest: str


def shape_bytes(shape: str) -> float:
    """Bytes of every array in an HLO shape string (tuples summed; layouts ignored)."""
    total = 0.0
    for dtype, dims in ARRAY.findall(shape):
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def parse_module(text: str) -> tuple[str, dict[str, list[Instruction]]]:
    """(entry computation name, {computation name: instructions}) of an HLO module's text.

    An instruction may span lines (a Mosaic custom call's `kernel_metadata={...}` does, and its
    continuation lines start with `}`): lines are continuation while the instruction's braces are
    open, and only a line that is `}` alone (or `}, execution_thread="..."`: a SparseCore computation),
    outside an instruction, closes the computation."""
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current: list[Instruction] | None = None
    open_braces = 0
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                name = header.group(2)
                if header.group(1):
                    entry = name
                current = computations.setdefault(name, [])
            continue
        if open_braces > 0:
            open_braces += line.count("{") - line.count("}")
            continue
        if line.rstrip() == "}" or line.startswith(_CLOSE_WITH_ATTRIBUTES):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            current.append(Instruction(*match.groups()))
            open_braces = max(line.count("{") - line.count("}"), 0)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, computations


def _trip_count(condition: list[Instruction]) -> int | None:
    constants = {i.name: i for i in condition if i.op == "constant"}
    root = next((i for i in reversed(condition) if i.op == "compare"), None)
    if root is None or "direction=LT" not in root.rest:
        return None
    operands = re.findall(r"%([\w.\-]+)", root.rest.split(")", 1)[0])
    if len(operands) != 2 or operands[1] not in constants:
        return None
    value = re.match(r"(-?\d+)\)", constants[operands[1]].rest)
    return int(value.group(1)) if value else None


def callees(instruction: Instruction) -> list[tuple[str, str]]:
    out = _CALLEE.findall(instruction.rest)
    for group in _BRANCHES.findall(instruction.rest):
        out += [("branch", name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
    return out


def trip_count(instruction: Instruction, computations: dict[str, list[Instruction]]) -> int | None:
    """Iterations of a `while` instruction: the compiler's `known_trip_count` in its backend_config,
    else the constant its condition compares the counter against (None when neither is there)."""
    known = _KNOWN_TRIPS.search(instruction.rest)
    if known:
        return int(known.group(1))
    return _trip_count(computations.get(dict(callees(instruction)).get("condition", ""), []))


def execution_counts(entry: str, computations: dict[str, list[Instruction]], unknown_trips: float = 1.0
                     ) -> tuple[dict[str, float], list[int | None]]:
    """({computation: times it runs per execution of the module}, the trip count of every `while` in
    visiting order). ENTRY runs once; a `while` body runs its trip count times (`unknown_trips` when the
    text does not state it) and its condition once more; fusions, calls, branches and async wrappers run
    as often as their caller."""
    runs: dict[str, float] = defaultdict(float)
    trips: list[int | None] = []

    def visit(name: str, times: float) -> None:
        runs[name] += times
        for instruction in computations.get(name, ()):
            if instruction.op.endswith(_ASYNC_FOLLOWERS):  # its start already led to the callee
                continue
            called = callees(instruction)
            trip = None
            if instruction.op == "while":
                trip = trip_count(instruction, computations)
                trips.append(trip)
            for role, callee in called:
                factor = 1.0
                if instruction.op == "while" and role in ("body", "condition"):
                    factor = float(trip if trip is not None else unknown_trips) + (1.0 if role == "condition" else 0.0)
                visit(callee, times * factor)

    visit(entry, 1.0)
    return runs, trips


def data_dependent_computations(entry: str, computations: dict[str, list[Instruction]]) -> set[str]:
    """Computations inside a `while` whose trip count the text does not state (no `known_trip_count`, no
    constant bound): data-dependent loops such as the MoE overflow passes (`execution_counts`: once)."""
    found: set[str] = set()
    seen: set[tuple[str, bool]] = set()

    def visit(name: str, inside: bool) -> None:
        if (name, inside) in seen:
            return
        seen.add((name, inside))
        if inside:
            found.add(name)
        for instruction in computations.get(name, ()):
            unknown = instruction.op == "while" and trip_count(instruction, computations) is None
            for role, callee in callees(instruction):
                visit(callee, inside or (unknown and role in ("body", "condition")))

    visit(entry, False)
    return found

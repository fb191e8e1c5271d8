"""HBM bytes a compiled (per-device, scheduled) HLO module moves per execution, walked from its text.

    hbm_bytes(compiled.as_text()) -> HbmTraffic(total, by_op, loops)

The method (docs/roofline.md): every *top-level* instruction -- one of a computation that runs as a
program step (ENTRY, a `while` body or condition, a conditional branch, a called computation), not one
inside a fusion -- reads its operands from HBM and writes its result there. Its bytes are operand bytes
+ result bytes, times the number of times its computation runs (`hlo_stats.execution_counts`: a `while`
body x its trip count, from `known_trip_count` in the loop's backend_config, else the condition's
constant). That is the convention of XLA's own `cost_analysis()["bytes accessed"]`, which however counts
each loop body once (tests/test_program_costs.py checks the two agree on a loop-free program).

Refinements, also those of XLA's cost analysis, so that a loop over stacked layers is not charged the
whole stack per iteration:
- a fusion operand that the fused computation only slices (`dynamic-slice`, `slice`, `gather`) is
  charged the bytes of the slices, not the whole operand;
- an in-place update (`dynamic-update-slice`) is charged the update read and written, not the buffer it
  updates (as a fusion's root on one of the fusion's operands, or as an element of a multi-output
  fusion's tuple root, the form a scan's stacked residuals take on TPU: that operand is free and that
  output is charged the update's bytes);
- instructions that move nothing are free: parameter, constant, get-tuple-element, tuple, bitcast,
  the `while` / `conditional` / `call` / `async-start` wrappers (the computations they run are walked),
  after-all, partition-id; reducers (`to_apply`) and fused computations are parts of one instruction.
Async pairs (`*-start` / `*-done`) are charged once: operands at the start, result at the done.
Mosaic kernels (`custom-call`) are charged their operands and results: a lower bound for kernels that
re-read an operand (splash reads each key block once per query block it meets).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from smelt_jax.compile.hlo_stats import Instruction, execution_counts, parse_module, shape_bytes

FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                      "conditional", "call", "after-all", "partition-id", "replica-id", "add-dependency",
                      "opt-barrier", "domain"})
# Wrappers whose called computation is walked itself (charging both would count the op twice).
ASYNC_WRAPPERS = frozenset({"async-start", "async-update", "async-done", "call-start", "call-done"})
SLICING_OPS = frozenset({"dynamic-slice", "slice", "gather"})
_NAME = re.compile(r"%([\w.\-]+)")
_PARAMETER = re.compile(r"^(\d+)\)")


@dataclasses.dataclass(frozen=True)
class HbmTraffic:
    total: float  # bytes per execution of the module (per device)
    by_op: dict[str, float]  # the same split by instruction kind (fusions by kind "fusion")
    loops: tuple[int | None, ...]  # trip counts of the `while` loops, in visiting order

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def operands(instruction: Instruction) -> list[str]:
    """Names of an instruction's operands: the `%name`s inside its top-level parentheses."""
    depth, end = 1, len(instruction.rest)
    for i, ch in enumerate(instruction.rest):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
            if depth == 0:
                end = i
                break
    return _NAME.findall(instruction.rest[:end])


def _fused_charges(fused: list[Instruction]) -> tuple[dict[int, float], float | None]:
    """For a fused computation: ({parameter index: bytes charged instead of the whole operand}, bytes
    charged for the result instead of its shape when the root updates a parameter in place)."""
    by_name = {i.name: i for i in fused}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for instruction in fused:
        for name in operands(instruction):
            users[name].append(instruction)
    params = {}
    for instruction in fused:
        if instruction.op == "parameter":
            match = _PARAMETER.match(instruction.rest)
            if match:
                params[instruction.name] = int(match.group(1))
    charges: dict[int, float] = {}
    for name, index in params.items():
        uses = users.get(name, [])
        if uses and all(u.op in SLICING_OPS and operands(u)[:1] == [name] for u in uses):
            charges[index] = sum(shape_bytes(u.shape) for u in uses)
    root = fused[-1] if fused else None
    if root is None or root.op not in ("dynamic-update-slice", "tuple"):
        return charges, None
    # The root, or each element of a multi-output fusion's tuple root, that updates a parameter in
    # place writes only its update (and does not read the rest of the buffer).
    outputs = [root] if root.op == "dynamic-update-slice" else [by_name.get(n) for n in operands(root)]
    result, in_place = 0.0, False
    for output in outputs:
        if output is None:
            return charges, None  # an element the walk cannot see: charge the whole result
        if output.op == "dynamic-update-slice":
            target, update = operands(output)[:2]
            if target in params and update in by_name:
                charges[params[target]] = 0.0
                result += shape_bytes(by_name[update].shape)
                in_place = True
                continue
        result += shape_bytes(output.shape)
    return charges, (result if in_place else None)


def instruction_bytes(instruction: Instruction, shapes: dict[str, str],
                      computations: dict[str, list[Instruction]]) -> float:
    """HBM bytes one execution of a top-level instruction moves (see the module docstring)."""
    op = instruction.op
    if op in FREE_OPS or op in ASYNC_WRAPPERS:
        return 0.0
    names = operands(instruction)
    operand_bytes = [shape_bytes(shapes.get(name, "")) for name in names]
    result = shape_bytes(instruction.shape)
    if op.endswith("-start"):
        return float(sum(operand_bytes))
    if op.endswith("-done"):
        return result
    if op == "dynamic-update-slice":
        return 2.0 * (operand_bytes[1] if len(operand_bytes) > 1 else 0.0)
    if op in ("dynamic-slice", "slice"):
        return 2.0 * result
    if op == "fusion":
        called = re.search(r"\bcalls=%([\w.\-]+)", instruction.rest)
        charges, in_place = _fused_charges(computations.get(called.group(1), [])) if called else ({}, None)
        operand_bytes = [charges.get(i, b) for i, b in enumerate(operand_bytes)]
        if in_place is not None:
            result = in_place
    return float(sum(operand_bytes)) + result


def hbm_bytes(text: str) -> HbmTraffic:
    """HBM bytes per execution of a compiled per-device HLO module (`compiled.as_text()`)."""
    entry, computations = parse_module(text)
    runs, trips = execution_counts(entry, computations)
    inner = set()  # fused computations and reducers: parts of one instruction, not program steps
    for instructions in computations.values():
        for instruction in instructions:
            inner.update(re.findall(r"\bto_apply=%([\w.\-]+)", instruction.rest))
            if instruction.op in ("fusion", "custom-call"):
                inner.update(re.findall(r"\bcalls=%([\w.\-]+)", instruction.rest))
    by_op: dict[str, float] = defaultdict(float)
    for name, instructions in computations.items():
        times = runs.get(name, 0.0)
        if not times or name in inner:
            continue
        shapes = {i.name: i.shape for i in instructions}
        for instruction in instructions:
            moved = instruction_bytes(instruction, shapes, computations)
            if moved:
                by_op[instruction.op] += times * moved
    return HbmTraffic(total=float(sum(by_op.values())), by_op=dict(sorted(by_op.items())),
                      loops=tuple(trips))

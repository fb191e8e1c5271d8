"""HBM bytes a compiled (per-device, scheduled) HLO module moves per execution, walked from its text.

    walk(compiled.as_text(), overflow_trips=1.0) -> [Charge(name, op, shape, op_name, category, times,
                                                      bytes, data_dependent), ...]
    hbm_bytes(compiled.as_text(), overflow_trips=1.0) -> HbmTraffic(total, by_op, loops, by_category,
                                                                    overflow_per_trip)

The method (docs/roofline.md): every *top-level* instruction -- one of a computation that runs as a
program step (ENTRY, a `while` body or condition, a conditional branch, a called computation), not one
inside a fusion -- reads its operands from HBM and writes its result there. Its bytes are operand bytes
+ result bytes, times the number of times its computation runs (`hlo_module.execution_counts`: a `while`
body x its trip count, from `known_trip_count` in the loop's backend_config, else the condition's
constant). That is the convention of XLA's own `cost_analysis()["bytes accessed"]`, which however counts
each loop body once (tests/test_program_costs.py checks the two agree on loop-free programs).

Bytes of a shape are its HBM bytes (`hlo_layout.hbm_shape_bytes`): padded to whole TPU tiles
(`{1,0:T(8,128)}` pads the last two dims to 8 x 128), and 0 for a buffer the compiler placed in on-chip
memory (`S(1)`, VMEM). So an async copy between HBM and VMEM (`copy-start` / `copy-done`, a prefetch or an
eviction) is charged its HBM side once, and whoever reads the VMEM buffer reads it for free.

Refinements, also those of XLA's cost analysis, so that an op is charged what it touches:
- a fusion operand that the fused computation only slices (`dynamic-slice`, `slice`, `gather`) is
  charged the bytes of the slices, not the whole operand;
- an in-place update (`dynamic-update-slice`, `scatter`) is charged the update, not the buffer it
  updates (alone, as a fusion's root on one of the fusion's operands, as an element of a
  multi-output fusion's tuple root, the form a scan's stacked residuals take on TPU, or as the root of
  a fusion nested at the root, the form of TPU's `scatter_custom_fusion`);
- a `gather` reads the rows it gathers (its result) and its indices, and writes its result; a
  `scatter` reads its indices and updates and writes the rows it updates (the updates' size);
- instructions that move nothing are free: parameter, constant, get-tuple-element, tuple, bitcast,
  the `while` / `conditional` / `call` / `async-start` / `call-start` wrappers (the computations they run
  are walked: a SparseCore offload's too, since issue 50; walks before left them out, 0.39 of 244.7 GB
  in the 100M S95 SMELT program),
  after-all, partition-id, and the `AllocateBuffer` custom-call (an uninitialised buffer: what XLA:TPU
  makes of a scan's zero-filled output stack when no other scan's stacks share its shape); reducers
  (`to_apply`) and fused computations are parts of one instruction.
Async pairs (`*-start` / `*-done`) are charged once: operands at the start, result at the done; so are
multi-step chains (`hlo_async.Chain`), whose continuation fusions are charged only the work fused in.
Mosaic kernels (`custom-call`) are charged their operands and results: a lower bound for kernels that
re-read an operand (splash reads each key block once per query block it meets).

A `while` whose trip count the text does not state (the MoE exchange's overflow passes: as many as the
fullest block needs, `hlo_module.data_dependent_computations`) runs `overflow_trips` times: its charges
are flagged `data_dependent` and filed under the category `overflow loop`, and `overflow_per_trip` is
what one more trip adds. Every other instruction is filed by `walk_categories.classify`; the categories
sum to the total exactly.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from smelt_jax.compile import hlo_async
from smelt_jax.compile.hlo_layout import hbm_shape_bytes
from smelt_jax.compile.hlo_module import (COLLECTIVE_KINDS, Instruction, data_dependent_computations,
                                          execution_counts, parse_module)
from smelt_jax.compile.walk_categories import CATEGORIES, OVERFLOW, classify, kind_of, op_name

FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                      "conditional", "call", "after-all", "partition-id", "replica-id", "add-dependency",
                      "opt-barrier", "domain"})
# Wrappers whose called computation is walked itself (charging both would count the op twice).
ASYNC_WRAPPERS = frozenset({"async-start", "async-update", "async-done", "call-start", "call-done"})
SLICING_OPS = frozenset({"dynamic-slice", "slice", "gather"})
IN_PLACE_OPS = frozenset({"dynamic-update-slice", "scatter"})
_NAME = re.compile(r"%([\w.\-]+)")
# An uninitialised buffer (a scan's stacked outputs, from its zero fill: model/layer.py,
# `distinct_scan_lengths`): the compiler allocates it, nothing reads or writes HBM.
_ALLOCATE = 'custom_call_target="AllocateBuffer"'
_PARAMETER = re.compile(r"^(\d+)\)")


@dataclasses.dataclass(frozen=True)
class Charge:
    """One top-level instruction's HBM bytes: `bytes` per execution, `times` executions per step."""

    name: str
    op: str
    shape: str
    op_name: str
    category: str
    times: float
    bytes: float
    data_dependent: bool = False  # inside a loop of data-dependent trip count (times at overflow_trips)

    @property
    def total(self) -> float:
        return self.times * self.bytes


@dataclasses.dataclass(frozen=True)
class HbmTraffic:
    total: float  # bytes per execution of the module (per device), overflow loops at overflow_trips
    by_op: dict[str, float]  # the same split by instruction kind (fusions by kind "fusion")
    loops: tuple[int | None, ...]  # trip counts of the `while` loops, in visiting order
    by_category: dict[str, float] = dataclasses.field(default_factory=dict)  # sums to total (CATEGORIES)
    overflow_per_trip: float = 0.0  # bytes one more trip of every data-dependent loop adds
    overflow_trips: float = 1.0  # the trips the total charges them

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


def _fused_charges(fused: list[Instruction], computations: dict[str, list[Instruction]] | None = None,
                   ) -> tuple[dict[int, float], float | None]:
    """For a fused computation: ({parameter index: bytes charged instead of the whole operand}, bytes
    charged for the result instead of its shape when the root updates a parameter in place).
    `computations` (name -> instructions) lets a root that is itself a fusion be looked into."""
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
            charges[index] = sum(hbm_shape_bytes(u.shape) for u in uses)
    root = fused[-1] if fused else None
    if root is None or (root.op not in IN_PLACE_OPS and root.op not in ("tuple", "fusion")):
        return charges, None
    # The root, or each element of a multi-output fusion's tuple root, that updates a parameter in
    # place writes only its update (and does not read the rest of the buffer).
    outputs = [root] if root.op != "tuple" else [by_name.get(n) for n in operands(root)]
    result, in_place = 0.0, False
    for output in outputs:
        if output is None:
            return charges, None  # an element the walk cannot see: charge the whole result
        nested = _nested_in_place(output, params, computations)
        if nested is not None:
            target_index, update_bytes = nested
            charges[target_index] = 0.0
            result += update_bytes
            in_place = True
            continue
        if output.op in IN_PLACE_OPS:
            names = operands(output)
            target = names[0] if names else None
            update = names[1] if output.op == "dynamic-update-slice" else (names[2] if len(names) > 2 else None)
            if target in params and update in by_name:
                charges[params[target]] = 0.0
                result += hbm_shape_bytes(by_name[update].shape)
                in_place = True
                continue
        result += hbm_shape_bytes(output.shape)
    return charges, (result if in_place else None)


def _nested_in_place(output: Instruction, params: dict[str, int],
                     computations: dict[str, list[Instruction]] | None) -> tuple[int, float] | None:
    """(the outer parameter index, the update's bytes) when `output` is a fusion whose own root updates
    one of its operands in place and that operand is a parameter of the enclosing fusion; else None."""
    if output.op != "fusion" or computations is None:
        return None
    called = re.search(r"\bcalls=%([\w.\-]+)", output.rest)
    inner = computations.get(called.group(1), []) if called else []
    inner_charges, update_bytes = _fused_charges(inner, computations)
    if update_bytes is None:
        return None
    names = operands(output)
    targets = [names[i] for i, charge in inner_charges.items() if charge == 0.0 and i < len(names)]
    if len(targets) != 1 or targets[0] not in params:
        return None
    return params[targets[0]], update_bytes


def _chain_step_bytes(instruction: Instruction, fused: list[Instruction], operand_bytes: list[float],
                      result: float) -> float:
    """HBM bytes of one step of a multi-step collective chain (`hlo_async.Chain`): the start reads the
    collective's input, the done writes its result (as a `*-start` / `*-done` pair), and a continuation
    step moves only the work fused into it: the collective's state (its input, its result buffer, sync
    words), which each step takes and hands on, is not read or written by the step."""
    target = hlo_async.root_target(fused)
    if target == hlo_async.CHAIN_START:
        return float(sum(operand_bytes))
    if target == hlo_async.CHAIN_DONE:
        return result
    by_name = {i.name: i for i in fused}
    root = fused[-1] if fused else None
    state: set[str] = set()
    for inner in fused:
        if hlo_async.collective_kind(inner.op) in COLLECTIVE_KINDS:
            state.add(inner.name)
            state.update(operands(inner))
    params = {}
    for inner in fused:
        if inner.op == "parameter" and _PARAMETER.match(inner.rest):
            params[int(_PARAMETER.match(inner.rest).group(1))] = inner.name
    used = {n for i in fused if i is not root and i.name not in state for n in operands(i)}
    moved = sum(b for index, b in enumerate(operand_bytes) if params.get(index) in used)
    if root is not None and root.op == "tuple":
        moved += sum(hbm_shape_bytes(by_name[n].shape) for n in operands(root)
                     if n in by_name and n not in state and by_name[n].op != "parameter")
    return float(moved)


def instruction_bytes(instruction: Instruction, shapes: dict[str, str],
                      computations: dict[str, list[Instruction]], chain_steps: frozenset[str] = frozenset(),
                      ) -> float:
    """HBM bytes one execution of a top-level instruction moves (see the module docstring); `chain_steps`:
    the computations of multi-step collective chains' fusions (`hlo_async.collective_chains`)."""
    op = instruction.op
    if op in FREE_OPS or op in ASYNC_WRAPPERS or (op == "custom-call" and _ALLOCATE in instruction.rest):
        return 0.0
    names = operands(instruction)
    operand_bytes = [hbm_shape_bytes(shapes.get(name, "")) for name in names]
    result = hbm_shape_bytes(instruction.shape)
    if op.endswith("-start"):
        return float(sum(operand_bytes))
    if op.endswith("-done"):
        return result
    if op == "dynamic-update-slice":
        return 2.0 * (operand_bytes[1] if len(operand_bytes) > 1 else 0.0)
    if op in ("dynamic-slice", "slice"):
        return 2.0 * result
    if op == "gather":  # the gathered rows read, the indices read, the result written
        return 2.0 * result + (operand_bytes[1] if len(operand_bytes) > 1 else 0.0)
    if op == "scatter":  # indices and updates read, the updated rows written
        indices, updates = (operand_bytes + [0.0, 0.0, 0.0])[1:3]
        return indices + 2.0 * updates
    if op == "fusion":
        called = re.search(r"\bcalls=%([\w.\-]+)", instruction.rest)
        if called and called.group(1) in chain_steps:
            return _chain_step_bytes(instruction, computations[called.group(1)], operand_bytes, result)
        charges, in_place = (_fused_charges(computations.get(called.group(1), []), computations) if called
                             else ({}, None))
        operand_bytes = [charges.get(i, b) for i, b in enumerate(operand_bytes)]
        if in_place is not None:
            result = in_place
    return float(sum(operand_bytes)) + result


def walk(text: str, overflow_trips: float = 1.0) -> list[Charge]:
    """Every top-level instruction that moves bytes, with its category and executions per step."""
    return _walk(text, overflow_trips)[0]


def _walk(text: str, overflow_trips: float) -> tuple[list[Charge], list[int | None], float]:
    """(charges, loop trip counts, bytes one more trip of the data-dependent loops adds)."""
    entry, computations = parse_module(text)
    runs, trips = execution_counts(entry, computations, overflow_trips)
    one_more, _ = execution_counts(entry, computations, overflow_trips + 1.0)
    dependent = data_dependent_computations(entry, computations)
    inner = set()  # fused computations and reducers: parts of one instruction, not program steps
    for instructions in computations.values():
        for instruction in instructions:
            if instruction.op != "call-start":  # a call-start's to_apply is a program (a SparseCore's)
                inner.update(re.findall(r"\bto_apply=%([\w.\-]+)", instruction.rest))
            if instruction.op in ("fusion", "custom-call"):
                inner.update(re.findall(r"\bcalls=%([\w.\-]+)", instruction.rest))
    chain_steps = frozenset(hlo_async.collective_chains(computations))
    out: list[Charge] = []
    per_trip = 0.0
    for name, instructions in computations.items():
        times = runs.get(name, 0.0)
        if name in inner or (not times and name not in dependent):
            continue
        shapes = {i.name: i.shape for i in instructions}
        for instruction in instructions:
            moved = instruction_bytes(instruction, shapes, computations, chain_steps)
            if not moved:
                continue
            label = op_name(instruction, computations)
            category = (OVERFLOW if name in dependent
                        else classify(kind_of(instruction, computations), label))
            out.append(Charge(instruction.name, instruction.op, instruction.shape, label, category, times,
                              moved, data_dependent=name in dependent))
            per_trip += (one_more.get(name, 0.0) - times) * moved
    return out, trips, per_trip


def hbm_bytes(text: str, overflow_trips: float = 1.0) -> HbmTraffic:
    """HBM bytes per execution of a compiled per-device HLO module (`compiled.as_text()`), loops of
    data-dependent trip count run `overflow_trips` times."""
    charges, trips, per_trip = _walk(text, overflow_trips)
    by_op: dict[str, float] = defaultdict(float)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for charge in charges:
        by_op[charge.op] += charge.total
        by_category[charge.category] += charge.total
    return HbmTraffic(total=float(sum(by_category.values())), by_op=dict(sorted(by_op.items())),
                      loops=tuple(trips), by_category=by_category, overflow_per_trip=per_trip,
                      overflow_trips=overflow_trips)

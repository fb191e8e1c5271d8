"""The async forms XLA:TPU gives a collective, read from a scheduled HLO module: where each is counted
once, and the window in which other work can overlap it (docs/roofline.md, "Async collectives").

    counted_source(instruction, by_name, computations) -> (source, window start) or None
    async_owners(computations) -> {computation an async op runs: (holder, start)}
    async_windows(instructions) -> {start: instructions between it and its done}; exchange_overlap
    collective_chains(computations) -> {step computation: Chain}; chain_overlap(chain, computations)

Forms: a plain collective (also inside a fusion or an async computation); `*-start` / `*-done` pairs;
`async-start` / `async-update` / `async-done` around a computation; an async collective fusion (a fusion
holding the `*-start`, a `*-done` outside waiting for it); a SparseCore offload (`call-start` /
`call-done` on the "sparsecore" thread around a computation holding the collective); a multi-step chain
(`xla_tpu_enable_async_collective_fusion_multiple_steps`: a start fusion, continuation fusions with other
work fused in, a done fusion, each holding a copy of the collective).
"""

from __future__ import annotations

import dataclasses
import re

from smelt_jax.compile.hlo_module import COLLECTIVE_KINDS, Instruction, callees

_PASS_THROUGH = ("get-tuple-element", "bitcast")
COMPUTE_OPS = ("fusion", "convolution", "dot", "custom-call")


def first_operand(instruction: Instruction) -> str | None:
    names = re.findall(r"%([\w.\-]+)", instruction.rest.split(")", 1)[0])
    return names[0] if names else None


def start_of(done: Instruction, by_name: dict[str, Instruction]) -> Instruction | None:
    """The start of the async op `done` (a `*-done` / `*-update`) ends: its first operand, through
    get-tuple-element, bitcast and updates: a `*-start`, an `async-start`, or an async collective fusion
    (XLA:TPU fuses a collective's start with its producers, a `*-done` waits for it); None if elsewhere."""
    name = first_operand(done)
    for _ in range(len(by_name) + 1):
        found = by_name.get(name) if name else None
        if found is None or not (found.op in _PASS_THROUGH or found.op.endswith("-update")):
            return found
        name = first_operand(found)
    return None


def inner_collectives(instruction: Instruction, computations: dict[str, list[Instruction]]) -> list[Instruction]:
    """Collectives (plain, `*-start`, `*-done`) in what `instruction` runs (`calls=`), nested included."""
    out: list[Instruction] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for inner in computations.get(name, ()):
            if collective_kind(inner.op) in COLLECTIVE_KINDS:
                out.append(inner)
            called = dict(callees(inner)).get("calls")
            if called:
                visit(called)

    called = dict(callees(instruction)).get("calls")
    if called:
        visit(called)
    return out


def collective_kind(op: str) -> str:  # all-gather-start -> all-gather
    return op.removesuffix("-start").removesuffix("-done")


def async_windows(instructions: list[Instruction]) -> dict[str, tuple[str, ...]]:
    """{an async op's start (`start_of`): the instructions scheduled strictly between it and its done},
    for one computation in schedule order; a synchronous collective has no entry."""
    by_name = {i.name: i for i in instructions}
    position = {i.name: n for n, i in enumerate(instructions)}
    out: dict[str, tuple[str, ...]] = {}
    for index, instruction in enumerate(instructions):
        if not instruction.op.endswith("-done"):
            continue
        start = start_of(instruction, by_name)
        if start is not None and start.name in position:
            out[start.name] = tuple(i.name for i in instructions[position[start.name] + 1:index])
    return out


def exchange_overlap(instructions: list[Instruction], windows: dict[str, tuple[str, ...]]) -> dict[str, bool]:
    """{an async op's start: whether the schedule runs compute (a fusion, convolution, dot or custom call)
    between it and its done}, from this computation's `async_windows`; a synchronous collective has no
    entry (exposed)."""
    ops = {i.name: i.op for i in instructions}
    return {start: any(ops[name] in COMPUTE_OPS for name in window) for start, window in windows.items()}


def async_owners(computations: dict[str, list[Instruction]]) -> dict[str, tuple[str, str]]:
    """{computation an async op runs: (the computation holding its start, the start's name)}: the callee of
    an `async-start` or a `call-start` (a SparseCore offload: `to_apply=`), and of a fusion whose result a
    `*-done` waits for (an async collective fusion), nested fusions included. A collective inside is
    overlapped as its wrapper is."""
    owners: dict[str, tuple[str, str]] = {}
    for name, instructions in computations.items():
        by_name = {i.name: i for i in instructions}
        starts = {i.name for i in instructions if i.op in ("async-start", "call-start")}
        starts |= {s.name for i in instructions if i.op.endswith("-done")
                   for s in [start_of(i, by_name)] if s is not None and s.op == "fusion"}
        for start in starts:
            wrapper = dict(callees(by_name[start]))
            pending = [wrapper.get("calls") or wrapper.get("to_apply")]
            while pending:
                called = pending.pop()
                if called and called not in owners:
                    owners[called] = (name, start)
                    pending += [dict(callees(i)).get("calls") for i in computations.get(called, ())
                                if i.op == "fusion"]
    return owners


CHAIN_START, CHAIN_DONE = "AsyncCollectiveStart", "AsyncCollectiveDone"  # roots of a chain's ends


@dataclasses.dataclass(frozen=True)
class Chain:
    """One collective XLA:TPU split over several fusions (`xla_tpu_enable_async_collective_fusion_
    multiple_steps`): a start fusion (root custom-call AsyncCollectiveStart), continuation fusions with
    other work fused in, a done fusion (root AsyncCollectiveDone), each holding a copy of the collective.
    Counted once, at the done; its window runs from the start to the done."""

    holder: str  # the computation whose schedule holds the fusions
    first: str  # the start fusion's name
    last: str  # the done fusion's name
    steps: tuple[str, ...]  # the computations the fusions call, start to done


def root_target(computation: list[Instruction]) -> str:
    root = computation[-1] if computation else None
    found = re.search(r'custom_call_target="([^"]+)"', root.rest) if root and root.op == "custom-call" else None
    return found.group(1) if found else ""


def collective_chains(computations: dict[str, list[Instruction]]) -> dict[str, Chain]:
    """{a step's computation: its chain} for every multi-step async collective in the module, followed
    from each done fusion back through its first operand (get-tuple-element) to the start fusion."""
    chains: dict[str, Chain] = {}
    for holder, instructions in computations.items():
        by_name = {i.name: i for i in instructions}
        for done in instructions:
            called = dict(callees(done)).get("calls") if done.op == "fusion" else None
            if not called or root_target(computations.get(called, [])) != CHAIN_DONE:
                continue
            steps, step = [called], done
            for _ in range(len(instructions)):
                previous = start_of(step, by_name)
                callee = dict(callees(previous)).get("calls") if previous is not None else None
                if previous is None or previous.op != "fusion" or not callee:
                    break
                steps.insert(0, callee)
                step = previous
                if root_target(computations.get(callee, [])) == CHAIN_START:
                    break
            chain = Chain(holder, step.name, done.name, tuple(steps))
            chains.update(dict.fromkeys(steps, chain))
    return chains


def does_compute(computation: list[Instruction], computations: dict[str, list[Instruction]]) -> bool:
    """Whether a fused computation does arithmetic work: a dot, a convolution, a Mosaic kernel, a reduce,
    or a nested fusion (not just a collective and data movement)."""
    for instruction in computation:
        if instruction.op in ("dot", "convolution", "reduce") or 'custom_call_target="tpu_custom_call"' in instruction.rest:
            return True
        if instruction.op == "fusion" and does_compute(computations.get(dict(callees(instruction)).get("calls", ""), []), computations):
            return True
    return False


def chain_window(chain: Chain, computations: dict[str, list[Instruction]]) -> tuple[str, ...]:
    """The instructions scheduled strictly between a chain's start and done, its continuation steps
    included (the walk charges those only the work fused into them)."""
    names = [i.name for i in computations[chain.holder]]
    return tuple(names[names.index(chain.first) + 1:names.index(chain.last)])


def chain_overlap(chain: Chain, computations: dict[str, list[Instruction]]) -> bool:
    """Whether work overlaps a chain: a compute instruction scheduled between its start and its done (a
    fusion of the chain itself counts when it fuses work in, as continuation steps do)."""
    by_name = {i.name: i for i in computations[chain.holder]}
    for name in chain_window(chain, computations):
        instruction = by_name[name]
        called = dict(callees(instruction)).get("calls", "")
        if instruction.op == "fusion" and called in chain.steps:
            if does_compute(computations[called], computations):
                return True
        elif instruction.op in COMPUTE_OPS:
            return True
    return False


def counted_source(instruction: Instruction, by_name: dict[str, Instruction],
                    computations: dict[str, list[Instruction]]) -> tuple[Instruction, Instruction] | None:
    """(what carries the collective's replica groups and metadata, the start of its async window here)
    when `instruction` is where a collective is counted, else None. Counted once: a plain one where it
    is; an async pair at its `*-done`, with its start's groups; never at a `*-start`, nor at a `*-done`
    waiting for a fusion or async computation that holds the plain collective (counted inside)."""
    op = instruction.op
    if collective_kind(op) not in COLLECTIVE_KINDS or op.endswith("-start"):
        return None
    if not op.endswith("-done"):
        return instruction, instruction
    start = start_of(instruction, by_name)
    if start is None:
        return instruction, instruction
    if start.op.endswith("-start") and collective_kind(start.op) in COLLECTIVE_KINDS:
        return start, start
    inner = inner_collectives(start, computations)
    if any(not i.op.endswith("-start") for i in inner):
        return None  # the plain collective inside is counted
    source = next((i for i in inner if collective_kind(i.op) == collective_kind(op)), start)
    return source, start

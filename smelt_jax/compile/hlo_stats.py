"""What a compiled (optimized, SPMD-partitioned) HLO module executes, read from its text.

`compiled.cost_analysis()` counts each `while` body once and gives no per-collective figures, so this
module walks the module's call graph itself: the ENTRY computation runs once, a `while` body runs its
trip count times (read from its condition: `compare(get-tuple-element(param, 0), constant(N)),
direction=LT`, the shape JAX's `scan` and `fori_loop` lower to; a loop counter starting at 0 is
assumed), unless the compiler states it (`known_trip_count` in the loop's backend_config), and fusions,
calls and async wrappers run as often as their caller. It reports, per device:

- executed collectives by kind, with the bytes of their results, and an estimate of the bytes each
  device sends: result bytes for all-gather / all-to-all / permutes, twice them for all-reduce (ring:
  reduce-scatter then all-gather), result bytes for reduce-scatter (an underestimate: the input is
  group-size times larger); the ring exchange's all-gathers and reduce-scatters (n-1)/n of the array
  gathered or scattered over a group of n (a ring passes n - 1 of its n shards);
- each collective once, whatever async form XLA gave it (`_counted_source`): a plain one where it is
  (in a fusion or an async computation too), a `*-start` / `*-done` pair at its done, an async
  collective fusion (a fusion holding the `*-start`, waited for by a `*-done` outside) at its done,
  an `async-start` / `async-update` / `async-done` wrapper by the computation it runs, visited once;
- SparseCore offloads (`call-start` on the "sparsecore" thread): the TPU compiler's `optimal_seconds`
  carries -1 for each (tests/test_compile_tpu.py), which made it negative for every train step;
- the `while` loops with their trip counts (None when the condition has another shape);
- the bytes sent per replica-group size (the ICI term divides each by the bandwidth of the torus axes
  such a group spans: `hardware.Slice.ici_bytes_per_second_for_group`), and the expert exchange's
  bytes that are *exposed*: every all-to-all unless the schedule (the module's instruction order,
  `is_scheduled=true`) runs it asynchronously with compute between its start and its done. The
  ring-of-experts exchange (model/ring_exchange.py) moves tokens with all-gather / reduce-scatter
  instead: those collectives count as the exchange when their op_name carries RING_MARK.
XLA:TPU emits many reduce-scatters as a fusion around an all-reduce (emitter `AllReduceScatterFusion`,
no metadata): that all-reduce is counted as the reduce-scatter it implements (its result the fusion's
shard), and as the ring's (synchronous, so exposed) when it scatters an array shaped like a ring
all-gather's result.
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
# Bytes a device sends per byte of the collective's result, for ring/direct algorithms.
SEND_FACTOR = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0,
               "ragged-all-to-all": 1.0, "collective-permute": 1.0}

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"\breplica_groups=\[(\d+),(\d+)\]<=")
_LISTED_GROUPS = re.compile(r"\breplica_groups=\{\{([\d,\s]*)\}")
EXCHANGE_KINDS = ("all-to-all", "ragged-all-to-all")  # how the MoE layer moves tokens between devices
# The ring exchange's collectives: these kinds under the named scope model.ring_exchange.RING_SCOPE.
RING_KINDS = ("all-gather", "reduce-scatter")
RING_MARK = "ring_exchange"
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# The later halves of an async op (`async-update`, `async-done`, `all-gather-done`, ...): they name the
# computation their start runs (`calls=`) but do not run it again.
_ASYNC_FOLLOWERS = ("-done", "-update")
_PASS_THROUGH = ("get-tuple-element", "bitcast")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    op: str
    rest: str


@dataclasses.dataclass(frozen=True)
class HloStats:
    static_counts: dict[str, int]  # collective instructions in the module's text, by kind
    collective_counts: dict[str, int]  # executed, per device
    collective_bytes: dict[str, float]  # result bytes of the executed collectives, per device
    send_bytes: float  # estimated bytes each device sends (SEND_FACTOR-weighted)
    sparsecore_offloads: int  # static count (each adds -1 to the compiler's optimal_seconds)
    loop_trip_counts: tuple[int | None, ...]  # one per `while` instruction, in text order
    # (kind, replica group size or None for all devices, estimated bytes sent), executed, per device
    send_bytes_by_group: tuple[tuple[str, int | None, float], ...] = ()
    # bytes the expert exchange (all-to-all kinds) sends that the schedule does not overlap with compute
    exchange_exposed_bytes: float = 0.0
    # (kind, group size, estimated bytes sent) of the expert exchange's collectives alone (ring included)
    exchange_send_bytes_by_group: tuple[tuple[str, int | None, float], ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def shape_bytes(shape: str) -> float:
    """Bytes of every array in an HLO shape string (tuples summed; layouts ignored)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def parse_module(text: str) -> tuple[str, dict[str, list[Instruction]]]:
    """(entry computation name, {computation name: instructions}) of an HLO module's text.

    An instruction may span lines (a Mosaic custom call's `kernel_metadata={...}` does, and its
    continuation lines start with `}`): lines are continuation while the instruction's braces are
    open, and only a line that is `}` alone, outside an instruction, closes the computation."""
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
        if line.rstrip() == "}":
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


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
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
    return _trip_count(computations.get(dict(_callees(instruction)).get("condition", ""), []))


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
            callees = _callees(instruction)
            trip = None
            if instruction.op == "while":
                trip = trip_count(instruction, computations)
                trips.append(trip)
            for role, callee in callees:
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
            for role, callee in _callees(instruction):
                visit(callee, inside or (unknown and role in ("body", "condition")))

    visit(entry, False)
    return found


def group_size(instruction: Instruction) -> int | None:
    """Devices in one replica group of a collective (None: every device, `replica_groups={}` or none
    stated); a collective-permute counts 2 (each device sends to one peer)."""
    if instruction.op.startswith("collective-permute"):
        return 2
    iota = _IOTA_GROUPS.search(instruction.rest)
    if iota:
        return int(iota.group(2))
    listed = _LISTED_GROUPS.search(instruction.rest)
    if listed:
        return len([d for d in listed.group(1).split(",") if d.strip()])
    return None


_COMPUTE_OPS = ("fusion", "convolution", "dot", "custom-call")


def is_exchange(instruction: Instruction) -> bool:
    """An expert-exchange collective (or its -start / -done): any all-to-all kind, or an all-gather /
    reduce-scatter of the ring exchange (RING_MARK in its metadata)."""
    kind = instruction.op.removesuffix("-start").removesuffix("-done")
    return kind in EXCHANGE_KINDS or (kind in RING_KINDS and RING_MARK in instruction.rest)


def _first_operand(instruction: Instruction) -> str | None:
    names = re.findall(r"%([\w.\-]+)", instruction.rest.split(")", 1)[0])
    return names[0] if names else None


def start_of(done: Instruction, by_name: dict[str, Instruction]) -> Instruction | None:
    """The start of the async op `done` (a `*-done` / `*-update`) ends: its first operand, through
    get-tuple-element, bitcast and updates: a `*-start`, an `async-start`, or an async collective fusion
    (XLA:TPU fuses a collective's start with its producers, a `*-done` waits for it); None if elsewhere."""
    name = _first_operand(done)
    for _ in range(len(by_name) + 1):
        found = by_name.get(name) if name else None
        if found is None or not (found.op in _PASS_THROUGH or found.op.endswith("-update")):
            return found
        name = _first_operand(found)
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
            if _kind(inner.op) in COLLECTIVE_KINDS:
                out.append(inner)
            called = dict(_callees(inner)).get("calls")
            if called:
                visit(called)

    called = dict(_callees(instruction)).get("calls")
    if called:
        visit(called)
    return out


def _kind(op: str) -> str:  # all-gather-start -> all-gather
    return op.removesuffix("-start").removesuffix("-done")


def _exchange_overlap(instructions: list[Instruction]) -> dict[str, bool]:
    """{an async op's start (`start_of`): whether the schedule runs compute (a fusion, convolution, dot
    or custom call) between it and its done}, for one computation in schedule order; a synchronous
    collective has no entry (exposed)."""
    by_name = {i.name: i for i in instructions}
    position = {i.name: n for n, i in enumerate(instructions)}
    compute_before = [0]  # compute ops among the first n instructions
    for instruction in instructions:
        compute_before.append(compute_before[-1] + (instruction.op in _COMPUTE_OPS))
    out: dict[str, bool] = {}
    for index, instruction in enumerate(instructions):
        if not instruction.op.endswith("-done"):
            continue
        start = start_of(instruction, by_name)
        if start is not None and start.name in position:
            out[start.name] = compute_before[index] - compute_before[position[start.name] + 1] > 0
    return out


def _async_owners(computations: dict[str, list[Instruction]]) -> dict[str, tuple[str, str]]:
    """{computation an async op runs: (the computation holding its start, the start's name)}: the callee of
    an `async-start`, and of a fusion whose result a `*-done` waits for (an async collective fusion),
    nested fusions included. A collective inside is overlapped as its wrapper is."""
    owners: dict[str, tuple[str, str]] = {}
    for name, instructions in computations.items():
        by_name = {i.name: i for i in instructions}
        starts = {i.name for i in instructions if i.op == "async-start"}
        starts |= {s.name for i in instructions if i.op.endswith("-done")
                   for s in [start_of(i, by_name)] if s is not None and s.op == "fusion"}
        for start in starts:
            pending = [dict(_callees(by_name[start])).get("calls")]
            while pending:
                called = pending.pop()
                if called and called not in owners:
                    owners[called] = (name, start)
                    pending += [dict(_callees(i)).get("calls") for i in computations.get(called, ())
                                if i.op == "fusion"]
    return owners


def _counted_source(instruction: Instruction, by_name: dict[str, Instruction],
                    computations: dict[str, list[Instruction]]) -> tuple[Instruction, Instruction] | None:
    """(what carries the collective's replica groups and metadata, the start of its async window here)
    when `instruction` is where a collective is counted, else None. Counted once: a plain one where it
    is; an async pair at its `*-done`, with its start's groups; never at a `*-start`, nor at a `*-done`
    waiting for a fusion or async computation that holds the plain collective (counted inside)."""
    op = instruction.op
    if _kind(op) not in COLLECTIVE_KINDS or op.endswith("-start"):
        return None
    if not op.endswith("-done"):
        return instruction, instruction
    start = start_of(instruction, by_name)
    if start is None:
        return instruction, instruction
    if start.op.endswith("-start") and _kind(start.op) in COLLECTIVE_KINDS:
        return start, start
    inner = inner_collectives(start, computations)
    if any(not i.op.endswith("-start") for i in inner):
        return None  # the plain collective inside is counted
    source = next((i for i in inner if _kind(i.op) == _kind(op)), start)
    return source, start


_SCATTER_FUSION = "AllReduceScatterFusion"  # XLA:TPU's emitter of a reduce-scatter as a fused all-reduce


def _signature(shape: str) -> tuple[str, str] | None:
    """(dtype, dims) of an array shape, layout left out: bf16[131072,1280]{1,0:T(8,128)} -> ('bf16', '131072,1280')."""
    found = _ARRAY.search(shape)
    return (found.group(1), found.group(2)) if found else None


def _scatter_fusions(computations: dict[str, list[Instruction]]) -> dict[str, Instruction]:
    """{called computation: the fusion} of every reduce-scatter XLA:TPU emitted as a fusion around an
    all-reduce (backend_config emitter `...AllReduceScatterFusion`; its result is the device's shard).
    The all-reduce inside is that reduce-scatter, not an all-reduce of the padded input."""
    found = {}
    for instructions in computations.values():
        for instruction in instructions:
            if instruction.op == "fusion" and _SCATTER_FUSION in instruction.rest:
                called = dict(_callees(instruction)).get("calls")
                if called and any(i.op.startswith("all-reduce") for i in computations.get(called, ())):
                    found[called] = instruction
    return found


def _ring_gathers(computations: dict[str, list[Instruction]]) -> set[tuple[str, str] | None]:
    """(dtype, dims) of the ring exchange's all-gather results: a reduce-scatter of such an array is the
    ring's reduce-scatter (the all-gather's transpose), also when XLA emitted it as a fusion without the
    exchange's metadata."""
    found = set()
    for instructions in computations.values():
        for instruction in instructions:
            if instruction.op in ("all-gather", "all-gather-done") and is_exchange(instruction):
                found.add(_signature(instruction.shape))
    return found


def _send_factor(kind: str, group: int | None, partitions: int, exchange: bool) -> float:
    """Bytes a device sends per byte of a collective's result. The ring exchange's all-gather and
    reduce-scatter send (n-1)/n of the gathered (scattered) array over a group of n: a ring passes
    n - 1 of its n shards; the reduce-scatter's input is n times its result."""
    factor = SEND_FACTOR[kind]
    if exchange and kind in RING_KINDS:
        n = group or partitions
        factor *= (n - 1) / n if n > 1 else 0.0
        if kind == "reduce-scatter":
            factor *= n
    return factor


def hlo_stats(text: str) -> HloStats:
    """Executed collectives, SparseCore offloads and loop trip counts of a compiled HLO module."""
    entry, computations = parse_module(text)
    scatter_fusions = _scatter_fusions(computations)
    ring_gathered = _ring_gathers(computations) - {None}
    runs, trips = execution_counts(entry, computations)
    static: dict[str, int] = defaultdict(int)
    counts: dict[str, float] = defaultdict(float)
    result_bytes: dict[str, float] = defaultdict(float)
    by_group: dict[tuple[str, int | None], float] = defaultdict(float)
    exchange_by_group: dict[tuple[str, int | None], float] = defaultdict(float)
    exposed = send = 0.0
    sparsecore = 0
    partitions = int((re.search(r"\bnum_partitions=(\d+)", text) or [0, 1])[1])  # a group of "all devices"
    owners = _async_owners(computations)
    overlap = {name: _exchange_overlap(instructions) for name, instructions in computations.items()}
    for name, instructions in computations.items():
        times = runs.get(name, 0.0)
        by_name = {i.name: i for i in instructions}
        fusion = scatter_fusions.get(name)
        for instruction in instructions:
            if instruction.op == "call-start" and 'async_execution_thread="sparsecore"' in instruction.rest:
                sparsecore += 1
            counted = _counted_source(instruction, by_name, computations)
            if counted is None:
                continue
            source, start = counted
            kind, result = _kind(instruction.op), instruction.shape
            group = group_size(source)
            exchange = is_exchange(source) or is_exchange(instruction) or (
                start.op == "fusion" and RING_MARK in start.rest and kind in RING_KINDS)
            if fusion is not None and kind == "all-reduce":  # a reduce-scatter emitted as a fusion
                kind, result = "reduce-scatter", fusion.shape
                operand = next((i.shape for i in instructions if i.op == "parameter"), "")
                exchange = exchange or _signature(operand) in ring_gathered
            static[kind] += 1
            if not times:
                continue
            sent = times * shape_bytes(result)
            counts[kind] += times
            result_bytes[kind] += sent
            bytes_sent = _send_factor(kind, group, partitions, exchange) * sent
            by_group[(kind, group)] += bytes_sent
            send += bytes_sent
            if exchange:
                exchange_by_group[(kind, group)] += bytes_sent
                owner, start_name = owners.get(name, (name, start.name))
                if fusion is not None or not overlap.get(owner, {}).get(start_name, False):
                    exposed += bytes_sent  # a fusion is synchronous: nothing overlaps it
    return HloStats(static_counts=dict(sorted(static.items())), collective_counts={k: int(round(v)) for k, v in sorted(counts.items())},
                    collective_bytes=dict(sorted(result_bytes.items())), send_bytes=send,
                    sparsecore_offloads=sparsecore, loop_trip_counts=tuple(trips),
                    send_bytes_by_group=tuple((k, g, b) for (k, g), b in sorted(by_group.items(), key=str)),
                    exchange_exposed_bytes=exposed,
                    exchange_send_bytes_by_group=tuple(
                        (k, g, b) for (k, g), b in sorted(exchange_by_group.items(), key=str)))

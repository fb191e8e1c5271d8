"""What a compiled (optimized, SPMD-partitioned) HLO module executes, read from its text.

`compiled.cost_analysis()` counts each `while` body once and gives no per-collective figures, so this
module walks the module's call graph itself (`hlo_module.execution_counts`: loops x trip
count). It reports, per device:

- executed collectives by kind, with the bytes of their results, and an estimate of the bytes each
  device sends: result bytes for all-gather / all-to-all / permutes, twice them for all-reduce (ring:
  reduce-scatter then all-gather), result bytes for reduce-scatter (an underestimate: the input is
  group-size times larger); the ring exchange's all-gathers and reduce-scatters (n-1)/n of the array
  gathered or scattered over a group of n (a ring passes n - 1 of its n shards);
- each collective once, whatever async form XLA gave it (`hlo_async.counted_source`: plain, start /
  done pairs, async wrappers and collective fusions, SparseCore offloads, multi-step chains);
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
all-gather's result; so is a plain reduce-scatter of such an array that lost the exchange's metadata
(the forward's, offloaded to a SparseCore).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from smelt_jax.compile.hlo_async import (async_owners, async_windows, chain_overlap, chain_window,
                                         collective_chains, collective_kind, counted_source, exchange_overlap,
                                         first_operand)
from smelt_jax.compile.hlo_module import ARRAY, Instruction, callees, execution_counts, parse_module, shape_bytes

# Bytes a device sends per byte of the collective's result, for ring/direct algorithms.
SEND_FACTOR = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0,
               "ragged-all-to-all": 1.0, "collective-permute": 1.0}
_IOTA_GROUPS = re.compile(r"\breplica_groups=\[(\d+),(\d+)\]<=")
_LISTED_GROUPS = re.compile(r"\breplica_groups=\{\{([\d,\s]*)\}")
EXCHANGE_KINDS = ("all-to-all", "ragged-all-to-all")  # how the MoE layer moves tokens between devices
# The ring exchange's collectives: these kinds under the named scope model.ring_exchange.RING_SCOPE.
RING_KINDS = ("all-gather", "reduce-scatter")
RING_MARK = "ring_exchange"


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
    # bytes the expert exchange sends with no compute scheduled beside it (synchronous, or nothing in
    # its async window)
    exchange_exposed_bytes: float = 0.0
    # the exchange's async collectives with compute in their window: (kind, group size, bytes sent per
    # step, executions per step, the instructions scheduled in the window); the report weighs each
    # window's work against the collective's time (`report.exposed_exchange_seconds`)
    exchange_windows: tuple[tuple[str, int | None, float, float, tuple[str, ...]], ...] = ()
    # (kind, group size, estimated bytes sent) of the expert exchange's collectives alone (ring included)
    exchange_send_bytes_by_group: tuple[tuple[str, int | None, float], ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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


def is_exchange(instruction: Instruction) -> bool:
    """An expert-exchange collective (or its -start / -done): any all-to-all kind, or an all-gather /
    reduce-scatter of the ring exchange (RING_MARK in its metadata)."""
    kind = instruction.op.removesuffix("-start").removesuffix("-done")
    return kind in EXCHANGE_KINDS or (kind in RING_KINDS and RING_MARK in instruction.rest)


_SCATTER_FUSION = "AllReduceScatterFusion"  # XLA:TPU's emitter of a reduce-scatter as a fused all-reduce


def _signature(shape: str) -> tuple[str, str] | None:
    """(dtype, dims) of an array shape, layout left out: bf16[131072,1280]{1,0:T(8,128)} -> ('bf16', '131072,1280')."""
    found = ARRAY.search(shape)
    return (found.group(1), found.group(2)) if found else None


def _scatter_fusions(computations: dict[str, list[Instruction]]) -> dict[str, Instruction]:
    """{called computation: the fusion} of every reduce-scatter XLA:TPU emitted as a fusion around an
    all-reduce (backend_config emitter `...AllReduceScatterFusion`; its result is the device's shard).
    The all-reduce inside is that reduce-scatter, not an all-reduce of the padded input."""
    found = {}
    for instructions in computations.values():
        for instruction in instructions:
            if instruction.op == "fusion" and _SCATTER_FUSION in instruction.rest:
                called = dict(callees(instruction)).get("calls")
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
    owners = async_owners(computations)
    windows = {name: async_windows(instructions) for name, instructions in computations.items()}
    overlap = {name: exchange_overlap(instructions, windows[name]) for name, instructions in computations.items()}
    exchange_windows: list[tuple[str, int | None, float, float, tuple[str, ...]]] = []
    chains = collective_chains(computations)
    for name, instructions in computations.items():
        times = runs.get(name, 0.0)
        chain = chains.get(name)
        if chain is not None and name != chain.steps[-1]:
            continue  # a chain's collective is counted once, in its done step
        by_name = {i.name: i for i in instructions}
        fusion = scatter_fusions.get(name)
        for instruction in instructions:
            if instruction.op == "call-start" and 'async_execution_thread="sparsecore"' in instruction.rest:
                sparsecore += 1
            counted = counted_source(instruction, by_name, computations)
            if counted is None:
                continue
            source, start = counted
            kind, result = collective_kind(instruction.op), instruction.shape
            group = group_size(source)
            exchange = is_exchange(source) or is_exchange(instruction) or (
                start.op == "fusion" and RING_MARK in start.rest and kind in RING_KINDS)
            if kind == "reduce-scatter" and not exchange:  # a ring scatter that lost its metadata
                operand = by_name.get(first_operand(source) or "")
                exchange = operand is not None and _signature(operand.shape) in ring_gathered
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
                if chain is not None:
                    overlapped, window = chain_overlap(chain, computations), chain_window(chain, computations)
                else:
                    owner, start_name = owners.get(name, (name, start.name))
                    overlapped = fusion is None and overlap.get(owner, {}).get(start_name, False)
                    window = windows.get(owner, {}).get(start_name, ())
                if overlapped:
                    exchange_windows.append((kind, group, bytes_sent, times, window))
                else:
                    exposed += bytes_sent  # a synchronous fusion (AllReduceScatterFusion) overlaps nothing
    return HloStats(static_counts=dict(sorted(static.items())), collective_counts={k: int(round(v)) for k, v in sorted(counts.items())},
                    collective_bytes=dict(sorted(result_bytes.items())), send_bytes=send,
                    sparsecore_offloads=sparsecore, loop_trip_counts=tuple(trips),
                    send_bytes_by_group=tuple((k, g, b) for (k, g), b in sorted(by_group.items(), key=str)),
                    exchange_exposed_bytes=exposed, exchange_windows=tuple(exchange_windows),
                    exchange_send_bytes_by_group=tuple(
                        (k, g, b) for (k, g), b in sorted(exchange_by_group.items(), key=str)))

"""Where a compiled CPU program's time goes, per op kind and per model part (issue 28, item 3).

XLA:CPU records one profiler event per executed thunk, named after its HLO instruction. We trace a few
calls of a jitted function (`jax.profiler`, Perfetto JSON), look each event's name up in the compiled
module's text, and sum the time by

- **kind**: `matmul` (a fusion or op holding a dot or convolution), `gather / scatter` (gather, scatter,
  dynamic-slice, dynamic-update-slice), `sort`, `reduction`, `copies` (copy, transpose, concatenate,
  slice, pad, broadcast, reshape only), `elementwise` (the rest), and
- **part**: the innermost of the model's named scopes in its JAX `op_name` metadata (attention, expert
  FFN, router, unembedding + loss, optimizer, ...; `PARTS`), or `other`.

Loops (`while`, `conditional`, `call`) are containers: their bodies' thunks are counted, the container
itself is not. Each part's executed thunks a call are counted too (a loop body's once per trip): at the
nano shapes the expert FFN's earlier walk spent its time on that count more than on its FLOPs
(docs/performance.md, "The `tiled` walk by bits"), so `run` profiles the nano-d96 matched pair beside the
issue-17 step. Thunk times are
summed over threads, so with 2 threads the sum can exceed the wall time; the wall time of a call is
reported beside it.

    python -m benchmarks.run ops                                         # issue-17 step, nano-d96 pair
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python -m benchmarks.run ops        # as on an AVX2-only CPU
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass

KINDS = ("matmul", "gather / scatter", "sort", "reduction", "copies", "elementwise")
CONTAINERS = {"while", "conditional", "call"}
_GATHER = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}
_COPY = {"copy", "transpose", "concatenate", "slice", "pad", "broadcast", "reshape", "bitcast", "parameter",
         "constant", "tuple", "get-tuple-element", "iota", "bitcast-convert"}
# the model's named scopes (jax.named_scope in smelt_jax/model and train/step.py) -> part; the innermost
# scope of an op's op_name wins (an expert matmul is `experts`, not `moe`)
PARTS = {"optimizer": "optimizer", "unembedding_loss": "unembedding + loss", "router": "router",
         "experts": "expert FFN", "moe": "MoE dispatch / combine", "attention": "attention",
         "norm": "norms", "embedding": "embedding"}

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


@dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    calls: tuple[str, ...]   # called computations (fusion bodies)
    op_name: str             # JAX metadata op_name, '' if none


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict[str, list[Instruction]]]:
    """Instructions by name and the instructions of each computation, from `compiled.as_text()`."""
    instructions, computations, current = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        comp = _COMP.match(line)
        if comp and "=" not in line.split("{")[0].split("(")[0]:
            current = comp.group(1)
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        name, _, opcode, rest = m.groups()
        calls = tuple(re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", rest))
        op_name = re.search(r'op_name="([^"]*)"', rest)
        ins = Instruction(name, opcode, calls, op_name.group(1) if op_name else "")
        instructions[name] = ins
        computations[current].append(ins)
    return instructions, computations


def _opcodes(ins: Instruction, computations, seen=None) -> set[str]:
    seen = set() if seen is None else seen
    ops = {ins.opcode}
    if ins.opcode == "fusion":
        for comp in ins.calls:
            if comp in seen:
                continue
            seen.add(comp)
            for inner in computations.get(comp, ()):
                ops |= _opcodes(inner, computations, seen)
    return ops


def kind_of(ins: Instruction, computations) -> str:
    """One of KINDS for a non-container instruction (see the module docstring)."""
    ops = _opcodes(ins, computations) - {"fusion"}
    if ops & {"dot", "convolution"} or (ins.opcode == "custom-call" and "matmul" in ins.op_name.lower()):
        return "matmul"
    if ops & _GATHER:
        return "gather / scatter"
    if "sort" in ops:
        return "sort"
    if ops & {"reduce", "reduce-window", "select-and-scatter"}:
        return "reduction"
    if ops <= _COPY:
        return "copies"
    return "elementwise"


def part_of(op_name: str) -> str:
    """The part of the innermost named scope in `op_name`, e.g. 'jit(train_step)/transpose(jvp(attention))/
    dot_general' -> 'attention'; 'other' (residual adds, loss scalars, the scan's own bookkeeping) else."""
    scopes = re.findall(r"[\w.]+", op_name)
    for scope in reversed(scopes):
        if scope in PARTS:
            return PARTS[scope]
    return "other"


def _fusion_op_name(ins: Instruction, computations) -> str:
    """A fusion's own op_name, or failing that the longest op_name inside it."""
    if ins.op_name or ins.opcode != "fusion":
        return ins.op_name
    names = [i.op_name for c in ins.calls for i in computations.get(c, ())]
    return max(names, key=len, default="")


@dataclass(frozen=True)
class Profile:
    wall_ms: float                          # median wall time of one call
    by_kind: dict[str, float]               # ms per call, summed over threads
    by_part: dict[str, dict[str, float]]    # part -> kind -> ms per call
    top: list[tuple[str, str, str, float]]  # (instruction, kind, part, ms per call), largest first
    thunks: dict[str, float]                # part -> executed thunks per call (a loop body's, once per trip)


def profile(fn, *args, calls: int = 3) -> Profile:
    """Trace `calls` executions of the jitted `fn(*args)` (compiled first, untimed) and split their time."""
    import jax

    compiled = fn.lower(*args).compile()
    instructions, computations = parse_hlo(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        for _ in range(calls):
            started = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            walls.append(time.perf_counter() - started)
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_instr: dict[str, float] = collections.Counter()
    executed: dict[str, float] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in instructions:
            per_instr[e["name"]] += e.get("dur", 0.0) / 1e3 / calls
            executed[e["name"]] += 1 / calls
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_part: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(KINDS, 0.0))
    thunks: dict[str, float] = collections.Counter()
    top = []
    for name, ms in per_instr.items():
        ins = instructions[name]
        if ins.opcode in CONTAINERS:
            continue
        kind, part = kind_of(ins, computations), part_of(_fusion_op_name(ins, computations))
        by_kind[kind] += ms
        by_part[part][kind] += ms
        thunks[part] += executed[name]
        top.append((name, kind, part, ms))
    top.sort(key=lambda t: -t[3])
    return Profile(statistics.median(walls) * 1e3, by_kind, dict(by_part), top, dict(thunks))


def table(prof: Profile, title: str, n_top: int = 12) -> str:
    total = sum(prof.by_kind.values()) or float("nan")
    n_thunks = sum(prof.thunks.values())
    lines = [f"**{title}**: {prof.wall_ms:.0f} ms a call (wall, median); thunk time summed over threads "
             f"{total:.0f} ms; {n_thunks:,.0f} thunks executed a call.", "",
             "| part | " + " | ".join(KINDS) + " | all | share | thunks |",
             "|---|" + "---:|" * (len(KINDS) + 3)]
    for part, kinds in sorted(prof.by_part.items(), key=lambda kv: -sum(kv[1].values())):
        row = sum(kinds.values())
        lines.append(f"| {part} | " + " | ".join(f"{kinds[k]:.1f}" for k in KINDS)
                     + f" | {row:.1f} | {row / total:.0%} | {prof.thunks.get(part, 0):,.0f} |")
    lines.append("| **all** | " + " | ".join(f"**{prof.by_kind[k]:.1f}**" for k in KINDS)
                 + f" | **{total:.1f}** | 100% | **{n_thunks:,.0f}** |")
    lines.append("| share | " + " | ".join(f"{prof.by_kind[k] / total:.0%}" for k in KINDS) + " | | | |")
    lines += ["", "| largest thunks | kind | part | ms |", "|---|---|---|---:|"]
    lines += [f"| `{n}` | {k} | {p} | {ms:.1f} |" for n, k, p, ms in prof.top[:n_top]]
    return "\n".join(lines) + "\n"


PAIR = ("nano", "d96", "s95")  # (suite, scale, sparsity) of the matched pair profiled beside the issue-17 step


def run() -> str:
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_peer import matched_pair_specs, step_inputs
    from benchmarks.bench_step_parts import issue_step_inputs
    from benchmarks.cpu_info import cpu_line
    from smelt_jax.train.step import make_train_step

    cfg, graphdef, params, tx, opt, batch = issue_step_inputs()
    prof = profile(jax.jit(make_train_step(graphdef, cfg, tx)), params, opt, batch, jnp.float32(1e-3))
    out = [cpu_line() + f"; jax {jax.__version__}.\n", table(prof, "issue-17 train step, expert_impl auto")]
    for spec in matched_pair_specs():
        if (spec.suite, spec.scale, spec.sparsity_label) == PAIR:
            step, args = step_inputs(spec.model, spec.schedule.batch_size)
            out.append(table(profile(step, *args), f"{spec.id} train step", n_top=6))
    return "\n".join(out)


if __name__ == "__main__":
    print(run())

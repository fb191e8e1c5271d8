"""Which part of a train step a top-level HLO instruction belongs to, for the HBM walk's breakdown.

    kind_of(instruction, computations) -> 'exchange' | 'collective' | 'kernel' | 'matmul' | 'gather'
                                          | 'stack' | 'copy' | 'compute'
    scope_of(op_name) -> the innermost named scope of the model in a JAX op_name ('' when none)
    classify(kind, op_name) -> one of CATEGORIES

The kind comes from the instruction's opcode and, for a fusion, the opcodes of its fused computation
(nested fusions included: a fusion holding a Mosaic kernel, `custom_call_target="tpu_custom_call"`,
as XLA:TPU's async collective fusions may, is a kernel (not the compiler's own custom-calls); one
holding only a collective's `*-start` and data movement, that collective; the synchronous
`AllReduceScatterFusion` stays as before, in other, so the ledger's walks stay comparable);
the scope from its `metadata={op_name="..."}`: JAX writes the name stack, e.g.
`jit(train_step)/transpose(jvp(moe))/experts/dot_general`, and the model names its parts with
`jax.named_scope` (model/*.py, train/step.py). Rules, first match wins (`classify`):

1. an all-to-all (the MoE layer's token exchange, padded or ragged)   -> expert exchange
2. any other collective (FSDP gathers, gradient reductions)           -> other collectives
3. an in-place update of a stack or a slice of one (dynamic-update-slice alone or as a fusion's root,
   dynamic-slice alone or with data movement only; no matmul): the layer scan's saved residuals and
   stacked weights                                                      -> residual stacks
4. scope optimizer / unembedding_loss / attention, or a splash kernel -> optimizer / loss / attention
5. a matmul or custom kernel inside the `experts` scope                -> expert kernels
6. a gather, scatter or sort (a fusion holding one)                   -> permutations / gathers / scatters
7. only data movement (copy, transpose, pad, slice, concatenate, convert, broadcast, ...) -> copies
8. the rest (norms, router, residual adds, elementwise)               -> other

The walk puts everything inside a loop of data-dependent trip count (the MoE overflow passes) in
`OVERFLOW`, charged at the expected number of passes (`compile.overflow`).
"""

from __future__ import annotations

import re

from smelt_jax.compile.hlo_module import COLLECTIVE_KINDS, Instruction
from smelt_jax.compile.hlo_stats import EXCHANGE_KINDS

OVERFLOW = "overflow loop"
CATEGORIES = ("expert exchange", "permutations / gathers / scatters", "expert kernels", "residual stacks",
              "copies", "attention", "loss", "optimizer", "other collectives", "other", OVERFLOW)
SCOPES = ("optimizer", "unembedding_loss", "attention", "experts", "moe", "router", "norm", "embedding")
_BY_SCOPE = {"optimizer": "optimizer", "unembedding_loss": "loss", "attention": "attention"}
_MOVES = frozenset({"copy", "copy-start", "copy-done", "transpose", "bitcast", "reshape", "broadcast", "pad",
                    "slice", "concatenate", "convert", "bitcast-convert", "parameter", "constant", "tuple",
                    "get-tuple-element", "iota", "reverse"})
_STACK_OPS = frozenset({"dynamic-update-slice", "dynamic-slice"})
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_MOSAIC = 'custom_call_target="tpu_custom_call"'


def op_name(instruction: Instruction, computations: dict[str, list[Instruction]] | None = None) -> str:
    """The instruction's metadata op_name; for a fusion without one, the longest inside it (of its custom
    calls, when it holds any); for a custom call without one, its instruction name (Mosaic kernels are
    named after the kernel: splash_mha_fwd...)."""
    found = _OP_NAME.search(instruction.rest)
    if found:
        return found.group(1)
    if instruction.op == "custom-call":
        return instruction.name
    if instruction.op != "fusion" or not computations:
        return ""
    called = _CALLS.search(instruction.rest)
    fused = computations.get(called.group(1), []) if called else []
    kernels = [i for i in fused if _is_kernel(i)]  # a kernel fused into an async block names it
    return max((op_name(i) for i in kernels or fused), key=len, default="")


def _fused_ops(name: str, computations: dict[str, list[Instruction]], seen: set[str]) -> set[str]:
    ops: set[str] = set()
    if name in seen:
        return ops
    seen.add(name)
    for inner in computations.get(name, ()):
        ops.add(inner.op)
        called = _CALLS.search(inner.rest) if inner.op == "fusion" else None
        if called:
            ops |= _fused_ops(called.group(1), computations, seen)
    return ops - {"fusion"}


def _is_kernel(instruction: Instruction) -> bool:
    """A Mosaic (Pallas) kernel; not the compiler's own custom-calls (AllocateBuffer, AssumeGather...)."""
    return instruction.op == "custom-call" and _MOSAIC in instruction.rest


def _holds_kernel(name: str, computations: dict[str, list[Instruction]], seen: set[str]) -> bool:
    if name in seen:
        return False
    seen.add(name)
    for inner in computations.get(name, ()):
        called = _CALLS.search(inner.rest) if inner.op == "fusion" else None
        if _is_kernel(inner) or (called and _holds_kernel(called.group(1), computations, seen)):
            return True
    return False


def _base(op: str) -> str:
    return op.removesuffix("-start").removesuffix("-done")


def kind_of(instruction: Instruction, computations: dict[str, list[Instruction]]) -> str:
    """What a top-level instruction does, from its opcode and (a fusion) its fused opcodes."""
    op = instruction.op
    if _base(op) in EXCHANGE_KINDS:
        return "exchange"
    if _base(op) in COLLECTIVE_KINDS:
        return "collective"
    if op == "custom-call":
        return "kernel"
    if op in _STACK_OPS:
        return "stack"
    if op != "fusion":
        ops = {op}
    else:
        called = _CALLS.search(instruction.rest)
        fused = computations.get(called.group(1), []) if called else []
        ops = _fused_ops(called.group(1), computations, set()) if called else set()
        root = fused[-1] if fused else None
        updates = root is not None and (root.op == "dynamic-update-slice"
                                        or (root.op == "tuple" and "dynamic-update-slice" in ops))
        only_slices = bool(ops & _STACK_OPS) and ops - _MOVES <= _STACK_OPS
        if (updates or only_slices) and not ops & {"dot", "convolution"}:
            return "stack"
        if called and _holds_kernel(called.group(1), computations, set()):  # fused into an async block
            return "kernel"
        started = {_base(o) for o in ops if o.endswith("-start")} & set(COLLECTIVE_KINDS)
        if started and ops - _MOVES <= {o for o in ops if _base(o) in COLLECTIVE_KINDS}:  # async collective fusion
            return "exchange" if started & set(EXCHANGE_KINDS) else "collective"
    if ops & {"dot", "convolution"}:
        return "matmul"
    if ops & {"gather", "scatter", "sort"}:
        return "gather"
    if ops <= _MOVES:
        return "copy"
    return "compute"


def scope_of(name: str) -> str:
    """The innermost of the model's named scopes (SCOPES) in an op_name, '' when it holds none."""
    for word in reversed(re.findall(r"[\w.]+", name)):
        if word in SCOPES:
            return word
    return ""


def classify(kind: str, name: str) -> str:
    """The breakdown category (CATEGORIES) of an instruction of `kind` (`kind_of`) and op_name `name`."""
    if kind == "exchange":
        return "expert exchange"
    if kind == "collective":
        return "other collectives"
    if kind == "stack":
        return "residual stacks"
    scope = scope_of(name)
    if kind == "kernel" and "splash" in name:  # a Mosaic attention kernel, named but often without metadata
        return "attention"
    if scope in _BY_SCOPE:
        return _BY_SCOPE[scope]
    if scope == "experts" and kind in ("matmul", "kernel"):
        return "expert kernels"
    if kind == "gather":
        return "permutations / gathers / scatters"
    if kind == "copy":
        return "copies"
    return "other"

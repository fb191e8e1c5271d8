"""One train step of a matched pair on this machine's accelerator, timed, against the same step's walk.

The prepared device check of issue 50 (item 8): the compile report prices TPU steps from a walk of the
compiled program (operands + results of every top-level op, `compile.hbm_traffic`) and the matmul FLOPs
it executes (`compile.program_flops`), never from a run. On a machine with a GPU this script runs both
members of one pair for real and sets the measured step beside the same roofline, built from that
GPU's own compiled program and data sheet:

    roofline step = max(program FLOPs / peak bf16 FLOP/s, walked HBM bytes / HBM bandwidth)
    efficiency    = roofline step / measured step (1.0: the program runs at its walk's limit)

and the pair's SMELT/Baseline step per budget FLOP, measured and walked. A measured step far above the
walk's says the walk misses what that chip pays (kernel launches, a small model's latency); the
measured pair ratio against the walked one says whether the walk ranks the two members as the chip does.

    python -m benchmarks.device_step                       # micro l, S95, on the default device
    python -m benchmarks.device_step --scale m --steps 30 --json-out /tmp/device_step.json
    python -m benchmarks.device_step --chip H100           # price a CPU dry run with H100 numbers

One device, no mesh axes beyond it; compute in bfloat16 (the TPU suite's compute dtype), parameters
in float32; random tokens (the walk and the time do not depend on them). On a CPU (no chip numbers)
the roofline columns say 'n/a' unless --chip names one: that dry run is what the tests exercise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class MemberStep:
    """One member's step on the local device (per device, per step)."""

    run_id: str
    arch: str
    tokens: int                # batch x sequence of the step
    budget_flops: float        # the budget's FLOPs of those tokens (6N + attention at 400 keys)
    program_flops: float       # matmul FLOPs the traced step executes
    walked_bytes: float        # HBM bytes of the compiled program's walk
    compile_seconds: float
    step_seconds: float        # median of the timed steps
    step_seconds_all: tuple[float, ...]
    compute_seconds: float | None  # program FLOPs / peak (None: no chip numbers)
    hbm_seconds: float | None      # walked bytes / HBM bandwidth

    @property
    def roofline_seconds(self) -> float | None:
        terms = [t for t in (self.compute_seconds, self.hbm_seconds) if t is not None]
        return max(terms) if terms else None

    @property
    def efficiency(self) -> float | None:
        roofline = self.roofline_seconds
        return None if roofline is None else roofline / self.step_seconds


def chip_for(device_kind: str, override: str | None = None):
    """The `platform.hardware` chip of `device_kind` (or the named one), None for a device not in the
    table (a CPU)."""
    from smelt_jax.platform import hardware

    if override:
        chips = {**hardware.GPU_CHIPS, **hardware.TPU_CHIPS}
        if override not in chips:
            raise SystemExit(f"--chip {override!r}: not one of {sorted(chips)}")
        return chips[override]
    found = hardware.chip_for_device_kind(device_kind)
    return None if found is None else found[1]


def _batch(batch_size: int, seq_len: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch_size, seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len))
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((batch_size, seq_len), np.int32), "positions": np.array(positions),
            "loss_mask": np.ones((batch_size, seq_len), np.float32)}


def measure(run, *, steps: int = 20, batch_size: int | None = None, chip=None,
            compute_dtype: str = "bfloat16") -> MemberStep:
    """Compile `run`'s train step for one local device, walk the compiled program, time `steps` steps
    (after two untimed ones) and price the walk with `chip` (a `platform.hardware.Chip` or None)."""
    import jax
    import jax.numpy as jnp

    from smelt_jax.compile.hbm_traffic import hbm_bytes
    from smelt_jax.compile.program_flops import program_flops
    from smelt_jax.design import budget as budget_lib
    from smelt_jax.design.descriptors import Parallelism
    from smelt_jax.parallel import sharding
    from smelt_jax.train import state as train_state
    from smelt_jax.train.step import optimizer

    cfg = run.model.replace(compute_dtype=compute_dtype)
    sched = run.schedule
    batch_size = batch_size or sched.batch_size
    tx = optimizer(sched)
    mesh = sharding.make_mesh(Parallelism(data=1), jax.devices()[:1])
    plan = train_state.plan_training(cfg, tx, mesh)
    params, opt_state = train_state.init_state(plan, tx, seed=0)
    step = train_state.jit_train_step(plan, tx, batch_size, sched.seq_len)
    batches = [_batch(batch_size, sched.seq_len, cfg.vocab, seed) for seed in range(steps + 2)]
    lr = jnp.float32(1e-4)
    with jax.set_mesh(mesh):
        started = time.perf_counter()
        compiled = step.lower(params, opt_state, batches[0], lr).compile()
        compile_seconds = time.perf_counter() - started
        flops = program_flops(jax.make_jaxpr(step)(params, opt_state, batches[0], lr)).total
        walked = hbm_bytes(compiled.as_text()).total
        times = []
        for n, batch in enumerate(batches):
            started = time.perf_counter()
            params, opt_state, metrics = compiled(params, opt_state, batch, lr)
            jax.block_until_ready(metrics["loss"])
            if n >= 2:
                times.append(time.perf_counter() - started)
    tokens = batch_size * sched.seq_len
    return MemberStep(
        run_id=run.id, arch=run.arch, tokens=tokens,
        budget_flops=budget_lib.train_flops_per_token(cfg) * tokens, program_flops=flops,
        walked_bytes=walked, compile_seconds=compile_seconds, step_seconds=statistics.median(times),
        step_seconds_all=tuple(times),
        compute_seconds=flops / chip.peak_flops if chip else None,
        hbm_seconds=walked / chip.hbm_bytes_per_second if chip and chip.hbm_bytes_per_second else None)


def pair_runs(suite: str, scale: str, sparsity: str) -> tuple[Any, Any]:
    """(Baseline, SMELT) of one pair of a suite."""
    import experiments

    members = {r.arch: r for r in experiments.load_suite(suite)
               if r.scale == scale and r.sparsity_label == sparsity}
    if set(members) != {"baseline", "smelt"}:
        raise SystemExit(f"no {scale} {sparsity} pair in suite {suite!r} (found {sorted(members) or 'nothing'})")
    return members["baseline"], members["smelt"]


def _per_budget(member: MemberStep, seconds: float | None) -> float | None:
    return None if seconds is None else seconds / member.budget_flops


def report(members: tuple[MemberStep, MemberStep], device: str, chip_name: str | None) -> str:
    """The markdown table of both members and the pair's SMELT/Baseline ratios."""
    def ms(value):
        return "n/a" if value is None else f"{value * 1e3:.3f}"

    rows = []
    for m in members:
        eff = "n/a" if m.efficiency is None else f"{m.efficiency:.3f}"
        rows.append(f"| {m.arch} | {m.tokens:,} | {m.program_flops / 1e9:.2f} | {m.walked_bytes / 1e9:.3f} | "
                    f"{ms(m.compute_seconds)} | {ms(m.hbm_seconds)} | {ms(m.roofline_seconds)} | "
                    f"{ms(m.step_seconds)} | {eff} |")
    base, smelt = members
    measured = _per_budget(smelt, smelt.step_seconds) / _per_budget(base, base.step_seconds)
    walked = (None if base.roofline_seconds is None else
              _per_budget(smelt, smelt.roofline_seconds) / _per_budget(base, base.roofline_seconds))
    steps = len(base.step_seconds_all)
    return (f"## One train step on {device}, measured against its walk\n\n"
            f"Chip numbers: {chip_name or 'none (roofline n/a)'}. Median of {steps} steps after 2 untimed; "
            "compute bf16, parameters f32, one device.\n\n"
            "| member | tokens | program GFLOP | walked GB | compute ms | HBM ms | roofline ms | measured ms "
            "| roofline / measured |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) +
            f"\n\nSMELT / Baseline step per budget FLOP: measured {measured:.3f}, walked "
            f"{'n/a' if walked is None else f'{walked:.3f}'}.\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_step", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="micro")
    parser.add_argument("--scale", default="l")
    parser.add_argument("--sparsity", default="s95")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, help="override the run's batch (a larger model on one device)")
    parser.add_argument("--chip", help="price with this chip's numbers (platform.hardware), e.g. H100")
    parser.add_argument("--json-out", help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")

    import jax

    device = jax.devices()[0]
    chip = chip_for(device.device_kind, args.chip)
    members = []
    for run in pair_runs(args.suite, args.scale, args.sparsity):
        print(f"== {run.id}: compiling and timing {args.steps} steps on {device.device_kind}", file=sys.stderr,
              flush=True)
        members.append(measure(run, steps=args.steps, batch_size=args.batch_size, chip=chip))
    text = report(tuple(members), device.device_kind, chip.name if chip else None)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"device": device.device_kind, "chip": chip.name if chip else None,
                       "members": [dataclasses.asdict(m) | {"roofline_seconds": m.roofline_seconds,
                                                            "efficiency": m.efficiency} for m in members]},
                      out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

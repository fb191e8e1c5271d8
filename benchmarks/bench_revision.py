"""Before -> after a code change, in one process: every step of the peer and pair tables (bench_peer's
issue-17 step and the matched pairs' members) built once with named functions taken from an earlier git
revision and once with the working tree's, timed in interleaved rounds.

    SMELT_BENCH_BEFORE=fd58a5b JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.run revision
    SMELT_BENCH_BEFORE=... SMELT_BENCH_SWAP=smelt_jax/model/dispatch.py:dispatch@smelt_jax.model.moe ...

`SMELT_BENCH_SWAP` lists `file:function@module` entries (comma-separated): `function` is loaded from
`file` as it was at the revision and bound in `module` (where the caller looks it up) while the "before"
steps are traced. The default swaps the two functions issue 28's third step changed. Without
`SMELT_BENCH_BEFORE` (e.g. in `make bench`) it prints one line and times nothing. Only functions whose
signature did not change can be swapped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROUNDS = int(os.environ.get("SMELT_BENCH_REVISION_ROUNDS", "5"))
DEFAULT_SWAP = ("smelt_jax/model/attention.py:causal_blocked_attention@smelt_jax.model.attention,"
                "smelt_jax/model/dispatch.py:dispatch@smelt_jax.model.moe")
ROOT = Path(__file__).resolve().parent.parent


def _old_function(revision: str, path: str, function: str, tmp: str):
    """`function` from `path` as of `revision`, loaded as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = f"_before_{Path(path).stem}"
    file = Path(tmp) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return getattr(module, function)


def run() -> str:
    import jax

    from benchmarks import bench_peer as bp
    from benchmarks.cpu_info import cpu_line

    revision = os.environ.get("SMELT_BENCH_BEFORE")
    if not revision:
        return "bench_revision: set SMELT_BENCH_BEFORE=<git revision> to time a change's before -> after.\n"
    swaps = []  # (consumer module, attribute, before, after)
    with tempfile.TemporaryDirectory() as tmp:
        for entry in os.environ.get("SMELT_BENCH_SWAP", DEFAULT_SWAP).split(","):
            target, consumer = entry.split("@")
            path, function = target.split(":")
            module = importlib.import_module(consumer)
            swaps.append((module, function, _old_function(revision, path, function, tmp),
                          getattr(module, function)))
        rows = []
        steps = [("issue-17 step", bp.issue_config(), bp.BATCH)] + [
            (spec.id, spec.model, spec.schedule.batch_size) for spec in bp.matched_pair_specs()]
        for name, cfg, batch in steps:
            for module, function, before, _ in swaps:
                setattr(module, function, before)
            try:
                old = bp.our_candidate("before", name, cfg, batch)
            finally:
                for module, function, _, after in swaps:
                    setattr(module, function, after)
            rows.append((name, cfg, old, bp.our_candidate("after", name, cfg, batch)))
    bp.measure([c for *_, old, new in rows for c in (old, new)], rounds=ROUNDS, steps=1)

    swapped = ", ".join(f"`{m.__name__}.{f}`" for m, f, *_ in swaps)
    out = [cpu_line() + f"; jax {jax.__version__}; before = {swapped} as of `{revision}`, after = the working "
           f"tree; {ROUNDS} interleaved rounds, one step each, after one compiling step.\n",
           "| step | before s | after s | after / before, paired median |", "|---|---:|---:|---:|"]
    for name, _, old, new in rows:
        if old.error or new.error:
            out.append(f"| {name} | failed: {old.error or new.error} | | |")
            continue
        out.append(f"| {name} | {old.median_s:.3f} | {new.median_s:.3f} | {bp.paired_ratio(new, old, 1):.3f} |")
    members = {}
    for name, cfg, old, new in rows:
        pair, arch = name.rsplit("-", 2)[0], name.rsplit("-", 2)[-2]
        members.setdefault(pair, {})[arch] = (cfg, old, new)
    out += ["", "| pair | SMELT / Baseline time per token over FLOP ratio, before | after |", "|---|---:|---:|"]
    for pair, arch in members.items():
        if {"baseline", "smelt"} <= arch.keys() and not any(c.error for _, *cs in arch.values() for c in cs):
            (cfg_b, old_b, new_b), (cfg_s, old_s, new_s) = arch["baseline"], arch["smelt"]
            flops = bp.step_flops_per_token(cfg_s) / bp.step_flops_per_token(cfg_b)
            out.append(f"| {pair} | {bp.paired_ratio(old_s, old_b, 1) / flops:.2f} | "
                       f"{bp.paired_ratio(new_s, new_b, 1) / flops:.2f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(run())

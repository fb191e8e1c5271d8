"""The lines `smelt train` prints when a phase ends (also with --quiet): where its outputs are and
the command that comes next."""

from __future__ import annotations

from pathlib import Path

from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files.rundir import run_dir


def finish_lines(run: RunSpec, branch: int | None, root: Path | None, *, stopped: bool = False,
                 runs_dir_flag: str = "") -> list[str]:
    """`stopped`: the phase saved and exited 42 (resume it); else it is done. `runs_dir_flag`: the
    `--runs-dir DIR` the user gave, repeated in the next command."""
    rd = run_dir(run.suite, run.id, root)
    phase = "stable" if branch is None else f"branch{branch}"
    extra = f" {runs_dir_flag}" if runs_dir_flag else ""
    lines = [f"{run.id} {phase}: outputs in {rd.phase(branch)} (metrics.jsonl, checkpoints/, "
             "tensorboard/)"]
    if stopped:
        again = "" if branch is None else f" --branch {branch}"
        lines.append(f"next: smelt train {run.id}{again}{extra}  (resumes from the last checkpoint)")
    elif branch is None and run.schedule.fork_steps:
        last = len(run.schedule.fork_steps) - 1
        branches = "--branch 0" if last == 0 else f"--branch K (K = 0..{last})"
        lines.append(f"next: smelt train {run.id} {branches}{extra}  (the decay branches), "
                     f"or smelt eval {run.id}{extra}")
    else:
        target = "" if branch is None else f" --branch {branch}"
        lines.append(f"next: smelt eval {run.id}{target}{extra}, or smelt results collect --suite "
                     f"{run.suite}{extra}")
    return lines

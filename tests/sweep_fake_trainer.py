"""A stand-in for `python -m smelt_jax train RUN_ID [--branch K]` in the sweep tests.

It writes the artifacts the real trainer writes, in the same order and the same way, without
training: the stable phase commits a checkpoint folder per fork step (written under an orbax-style
temporary name, then renamed, so a kill never leaves a committed half checkpoint) and resumes after
the last committed one, after moving aside (`<step>.damaged`) any step `checkpoint_format.checkpoint_damage`
finds damaged, as the real trainer does; a branch checks its fork checkpoint, writes `endpoint.json`
atomically, then appends the row to the results store.

Environment knobs (all optional):
    FAKE_TRAINER_LOG        append "start|end <run id> <phase>" lines here
    FAKE_TRAINER_SLEEP      seconds per checkpoint / per branch (default 0.05)
    FAKE_TRAINER_INTERRUPT  "<run id>:<phase>": the first attempt of that job exits 42 after its
                            first checkpoint (a marker file next to the log remembers it)
    FAKE_TRAINER_FAIL       "<run id>:<phase>": that job exits 3 at once
    FAKE_TRAINER_NO_ROW     "<run id>:<phase>": write endpoint.json but die before the row is appended
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import find_run
from smelt_jax.run_files.checkpoint_format import (
    DAMAGED_SUFFIX,
    checkpoint_committed,
    checkpoint_damage,
    committed_steps,
)
from smelt_jax.run_files.rundir import results_dir, run_dir


def log(line: str) -> None:
    path = os.environ.get("FAKE_TRAINER_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(line + "\n")


def matches(knob: str, run_id: str, phase: str) -> bool:
    return os.environ.get(knob, "") == f"{run_id}:{phase}"


def commit_checkpoint(folder: Path, step: int) -> None:
    temp = folder / f"{step}.orbax-checkpoint-tmp-0"
    temp.mkdir(parents=True, exist_ok=True)
    (temp / "state").write_text(f"step {step}\n")
    os.replace(temp, folder / str(step))


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4) or argv[0] != "train" or (len(argv) == 4 and argv[2] != "--branch"):
        print(f"usage: train RUN_ID [--branch K], got {argv}", file=sys.stderr)
        return 2
    run = find_run(argv[1])
    branch = int(argv[3]) if len(argv) == 4 else None
    phase = "stable" if branch is None else f"b{branch}"
    rdir = run_dir(run.suite, run.id)
    sleep = float(os.environ.get("FAKE_TRAINER_SLEEP", "0.05"))
    log(f"start {run.id} {phase}")
    if matches("FAKE_TRAINER_FAIL", run.id, phase):
        print("fake failure", file=sys.stderr)
        return 3
    if branch is None:
        folder = rdir.checkpoints(None)
        marker = Path(os.environ.get("FAKE_TRAINER_LOG", "/nonexistent")).with_suffix(".interrupted")
        for step in committed_steps(folder):
            if checkpoint_damage(folder, step):
                os.rename(folder / str(step), folder / f"{step}{DAMAGED_SUFFIX}")
                log(f"moved-aside {run.id} {step}")
        for step in sorted(set(run.schedule.fork_steps) | {run.schedule.stable_steps}):
            if checkpoint_committed(folder, step):
                continue
            time.sleep(sleep)
            commit_checkpoint(folder, step)
            if matches("FAKE_TRAINER_INTERRUPT", run.id, phase) and not marker.exists():
                marker.write_text("interrupted once\n")
                log(f"interrupted {run.id} {phase}")
                return 42
    else:
        fork = run.schedule.fork_steps[branch]
        if not checkpoint_committed(rdir.checkpoints(None), fork):
            print(f"no committed checkpoint at step {fork}", file=sys.stderr)
            return 4
        if checkpoint_damage(rdir.checkpoints(None), fork):
            print(f"the checkpoint at step {fork} is damaged", file=sys.stderr)
            return 2
        time.sleep(sleep)
        from smelt_jax.run_files.results import EndpointResult, append_result
        budget = run.budget()
        result = EndpointResult(
            run_id=run.id, branch=branch, pair_id=run.pair_id, suite=run.suite, arch=run.arch,
            scale=run.scale, sparsity_label=run.sparsity_label, sparsity=budget.sparsity,
            flops_per_token=budget.train_flops_per_token, params=budget.params_total,
            tokens=run.schedule.branch_tokens(branch),
            cumulative_flops=budget.train_flops_per_token * run.schedule.branch_tokens(branch),
            val_loss=5.0 - 0.1 * branch, losses_by_source={"web": 5.1 - 0.1 * branch},
            git_commit="fake", time="2026-01-01T00:00:00Z")
        endpoint = rdir.endpoint(branch)
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        temp = endpoint.with_suffix(".json.tmp")
        temp.write_text(json.dumps(result.to_row(), sort_keys=True))
        os.replace(temp, endpoint)
        if matches("FAKE_TRAINER_NO_ROW", run.id, phase):
            log(f"died-before-row {run.id} {phase}")
            return 9
        append_result(result, results_dir(run.suite))
    log(f"end {run.id} {phase}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

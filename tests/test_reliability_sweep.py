"""Issue 15 item 1 in the sweep: a damaged checkpoint is told from a done one (`sweep status`), the
stable job that must provide it runs again, and its branches wait for it."""

from __future__ import annotations

import json

from smelt_jax.cli import main
from smelt_jax.run_files.checkpoint_format import CHECKSUM_FILE
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.sweep.graph import JobStatus, artifact_statuses
from smelt_jax.sweep.local import failure_summary, local_statuses, run_local
from tests.test_sweep_local import env, events, graph, settings  # noqa: F401 (fixture)


def _claim_size(step_dir, size: int) -> None:
    """Damage a fake checkpoint: its checksum file records another size than the file has."""
    (step_dir / CHECKSUM_FILE).write_text(json.dumps(
        {"version": 2, "files": {"state": {"sha256": "0" * 64, "size": size}}}))


def test_damaged_final_checkpoint_is_not_done_and_the_sweep_retrains_it(env, capsys):  # noqa: F811
    root, log = env
    g = graph()
    assert set(run_local(g, settings(root)).values()) == {JobStatus.DONE}
    stable = g.jobs[0]
    folder = run_dir(g.suite, stable.run.id, root).checkpoints(None)
    final = stable.run.schedule.stable_steps
    _claim_size(folder / str(final), 10 ** 6)
    statuses = local_statuses(g, root)
    # before: a committed folder counted as done whatever its state
    assert statuses[stable.name] == JobStatus.DAMAGED
    assert "damaged" in failure_summary(g, statuses, root)
    assert main(["sweep", "status", "--suite", "smoke", "--runs-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "damaged=1" in out and f"damaged: {stable.name}" in out
    log.unlink()
    assert set(run_local(g, settings(root)).values()) == {JobStatus.DONE}
    assert ("moved-aside", stable.run.id, str(final)) in events(log)
    assert [e for e in events(log) if e[0] == "start"] == [("start", stable.run.id, "stable")]
    assert (folder / f"{final}.damaged").is_dir()


def test_branch_of_a_damaged_fork_checkpoint_is_pending(env):  # noqa: F811
    root, _log = env
    g = graph()
    stable, b0 = g.jobs[0], g.jobs[1]
    folder = run_dir(g.suite, stable.run.id, root).checkpoints(None)
    for step in stable.run.schedule.fork_steps:  # a stable run as the fake trainer leaves it
        (folder / str(step)).mkdir(parents=True)
        (folder / str(step) / "state").write_text(f"step {step}\n")
        _claim_size(folder / str(step), len(f"step {step}\n"))
    assert artifact_statuses(g, root)[b0.name] == JobStatus.READY
    assert artifact_statuses(g, root)[stable.name] == JobStatus.DONE
    (folder / str(b0.fork_step) / "state").write_text("")  # truncated
    statuses = artifact_statuses(g, root)
    assert statuses[b0.name] == JobStatus.PENDING and not statuses[b0.name].runnable
    assert statuses[stable.name] == JobStatus.DAMAGED and statuses[stable.name].runnable

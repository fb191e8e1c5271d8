"""Results that cannot lie (issue 53, item 6): `smelt eval` refuses a damaged final checkpoint unless told
which step to use and says which step it evaluated; fits the data cannot identify are flagged; every write
error names its path; a symlink loop in the runs root and an unwritable `analyze --out` are one line.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from smelt_jax.cli import main
from smelt_jax.design.config import ModelConfig, Schedule
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.run_files import checkpoint_format as fmt
from smelt_jax.run_files.rundir import run_dir

MODEL = ModelConfig(vocab=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                    n_experts=4, top_k=2, expert_ffn=32, loop_start=1, loop_length=1,
                    loop_repeats=2, seq_len=32)
SCHEDULE = Schedule(batch_size=4, seq_len=32, stable_steps=4, fork_steps=(4,), decay_steps=2,
                    warmup_steps=1, peak_lr=3e-3)
RUN = RunSpec(suite="unit", scale="tiny", sparsity_label="s50", arch="smelt", model=MODEL,
              schedule=SCHEDULE, control=MODEL.replace(n_experts=2), pair_id="unit-tiny")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "Warning" not in err and len(lines) == 1, err
    return lines[0]


# eval -------------------------------------------------------------------------------------------------
def _fake_checkpoints(root: Path, steps=(2, 4)) -> Path:
    """run.json and sealed (checksummed) step folders that only the damage check reads."""
    from smelt_jax.train.endpoint import write_spec

    rd = run_dir(RUN.suite, RUN.id, root)
    rd.root.mkdir(parents=True)
    write_spec(RUN, rd)
    folder = rd.checkpoints(None)
    for step in steps:
        (folder / str(step) / "state").mkdir(parents=True)
        (folder / str(step) / "state" / "data").write_bytes(bytes(range(256)) * 8)
        (folder / str(step) / fmt.ORBAX_COMMIT_FILE).write_text("{}")
        fmt.seal(folder / str(step))
    return folder


def test_eval_refuses_a_damaged_newest_checkpoint_and_names_the_whole_ones(tmp_path, capsys):
    """Before: the damaged step 4 was skipped with a raw Python warning and an older step evaluated."""
    folder = _fake_checkpoints(tmp_path / "runs")
    data = folder / "4" / "state" / "data"
    data.write_bytes(data.read_bytes()[:100])  # truncated
    assert main(["eval", RUN.id, "--runs-dir", str(tmp_path / "runs"), "--no-validation"]) == 2
    line = _one_line(capsys)
    assert f"the newest checkpoint, step 4 in {folder}, is damaged (state/data has 100 bytes" in line
    assert "nothing evaluated: evaluate an older one with --step N (whole: 2)" in line


@pytest.mark.integration
def test_eval_says_its_step_and_a_same_size_damage_is_refused_unless_a_step_is_named(tmp_path, capsys):
    """A real run (checkpoints at steps 2 and 4): the damaged newest is refused, `--step 2` evaluates
    step 2 and says so."""
    from smelt_jax.train.trainer import TrainOptions, train
    from tests.data_helpers import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus")
    runs = tmp_path / "runs"
    train(RUN, root=runs, corpus=corpus,
          options=TrainOptions(log_every=1, checkpoint_every=2, progress=False, peak_flops=1e12, devices=1))
    folder = run_dir(RUN.suite, RUN.id, runs).checkpoints(None)
    assert fmt.committed_steps(folder)[-2:] == [2, 4]
    args = ["eval", RUN.id, "--runs-dir", str(runs), "--data-dir", str(corpus.root), "--eval-tokens", "64"]
    assert main(args) == 0
    assert f"evaluating {RUN.id} stable step 4" in capsys.readouterr().err
    biggest = max((p for p in (folder / "4").rglob("*") if p.is_file() and p.name != fmt.CHECKSUM_FILE),
                  key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the same size: only the checksums see it
    biggest.write_bytes(bytes(raw))
    assert main(args) == 2
    line = _one_line(capsys)
    assert "step 4" in line and "changed since the save" in line, line
    assert main(args + ["--step", "2"]) == 0
    captured = capsys.readouterr()
    assert f"evaluating {RUN.id} stable step 2" in captured.err and "Warning" not in captured.err

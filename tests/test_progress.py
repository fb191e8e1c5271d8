"""Progress off a terminal is plain lines (one per log interval), and `smelt train --quiet` still says
where the outputs are and what to run next (issue 26 D)."""

import io

import pytest

from smelt_jax.platform.progress import LineProgress, progress_bar
from smelt_jax.run_files.rundir import run_dir
from tests.data_helpers import build_tiny_corpus
from tests.test_trainer import _run


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_progress_writes_one_whole_line_per_postfix():
    out = io.StringIO()
    bar = progress_bar(10, initial=2, desc="run stable", unit="step", file=out)
    assert isinstance(bar, LineProgress)
    for step in range(3, 11):
        bar.update(1)
        if step % 4 == 0:
            bar.set_postfix(loss="3.210", tok_s="100")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3  # steps 4 and 8, then the close at 10
    assert lines[0].startswith("run stable: 4/10 step (40%)") and "loss=3.210 tok_s=100" in lines[0]
    assert "eta" in lines[0] and "eta" not in lines[-1]
    assert lines[-1].startswith("run stable: 10/10 step (100%)")


def test_line_progress_close_repeats_nothing_and_disable_is_silent():
    out = io.StringIO()
    bar = LineProgress(3, desc="x", file=out)
    bar.update(3)
    bar.set_postfix_str("running - failed 0")
    bar.close()
    bar.close()
    assert len(out.getvalue().splitlines()) == 1
    quiet = io.StringIO()
    bar = LineProgress(3, desc="x", file=quiet, disable=True)
    bar.update(2)
    bar.set_postfix(a=1)
    bar.close()
    assert quiet.getvalue() == ""


def test_a_terminal_gets_tqdm():
    out = _Tty()
    bar = progress_bar(4, desc="t", file=out)
    assert not isinstance(bar, LineProgress)
    bar.update(2)
    bar.close()
    assert "\r" in out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.integration
def test_smelt_train_off_a_terminal_logs_lines_and_quiet_keeps_the_summary(tmp_path, corpus,
                                                                           monkeypatch, capsys):
    import experiments
    import smelt_jax.train.trainer as trainer
    from smelt_jax.cli import main

    run = _run()
    monkeypatch.setattr(experiments, "find_run", lambda run_id: run)
    monkeypatch.setattr(trainer, "_load_corpus", lambda: corpus)
    assert main(["train", run.id, "--runs-dir", str(tmp_path), "--log-every", "2",
                 "--stop-after", "6", "--no-tensorboard"]) == 42
    err = capsys.readouterr().err
    assert "\r" not in err
    progress = [line for line in err.splitlines() if line.startswith(f"{run.id} stable: ")
                and " step (" in line]
    assert [line.split(":")[1].split()[0] for line in progress] == ["2/12", "4/12", "6/12"]
    rd = run_dir(run.suite, run.id, tmp_path)
    assert f"outputs in {rd.phase(None)}" in err
    assert f"next: smelt train {run.id} --runs-dir {tmp_path}" in err

    assert main(["train", run.id, "--runs-dir", str(tmp_path), "--quiet", "--no-tensorboard"]) == 0
    captured = capsys.readouterr()
    assert " step (" not in captured.err  # no progress lines
    assert f"outputs in {rd.phase(None)}" in captured.err
    assert f"next: smelt train {run.id} --branch" in captured.err
    assert captured.out.strip().startswith("{")  # stdout stays the one JSON line

"""TensorBoard event files (written through tensorboardX) and profiler traces of a training phase,
read back with TensorBoard's own reader (`tensorboard` is a test-only dependency), hparams included;
and the optional W&B log, read back from its offline run files."""

import math
import shutil
import struct
import warnings

import pytest

from smelt_jax.cli.train import parse_profile
from smelt_jax.platform import storage as gcs
from smelt_jax.run_files.rundir import run_dir
from smelt_jax.train import tensorboard as tb
from smelt_jax.train.metrics_log import latest_per_step, read_metrics
from smelt_jax.train.trainer import Preempted, TrainOptions, train
from tests.data_helpers import build_tiny_corpus
from tests.test_trainer import OPTIONS, _run

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _load(folder) -> event_accumulator.EventAccumulator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
    return acc


def _series(acc, tag) -> dict[int, float]:
    return {event.step: event.value for event in acc.Scalars(tag)}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30) or float(struct.unpack(
        "<f", struct.pack("<f", b))[0]) == a


def test_event_protocol_reads_back_with_tensorboard(tmp_path):
    with tb.EventWriter(tmp_path) as writer:
        writer.write({"step": 1, "loss": 2.5, "lr": 1e-3, "time": 5.0, "peak_flops_source": "x",
                      "bad": float("nan")})
        writer.write({"step": 2, "eval": {"web": 3.25, "overall": 3.0}})
    acc = _load(tmp_path)
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/lr", "eval/web", "eval/overall"}
    assert _series(acc, "train/loss") == {1: 2.5}
    assert _close(_series(acc, "train/lr")[1], 1e-3)
    assert _series(acc, "eval/web") == {2: 3.25}
    assert acc.Scalars("train/loss")[0].wall_time == 5.0


def _hparams(acc) -> dict:
    """What TensorBoard's hparams plugin reads from a run: its experiment (hparam and metric names)
    and its session's hparam values."""
    from tensorboard.plugins.hparams import metadata
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    values = {}
    for key, value in start.hparams.items():
        kind = value.WhichOneof("kind")
        values[key] = getattr(value, kind)
    return {"hparams": sorted(h.name for h in experiment.hparam_infos),
            "metrics": sorted(m.name.tag for m in experiment.metric_infos), "values": values}


def test_hparams_read_back_with_tensorboard(tmp_path):
    run = _run()
    with tb.EventWriter(tmp_path, hparams=tb.run_hparams(run, 1)) as writer:
        writer.write({"step": 1, "loss": 2.5})
    hp = _hparams(_load(tmp_path))
    assert hp["hparams"] == ["arch", "id", "pair", "phase", "scale", "sparsity", "suite"]
    assert hp["metrics"] == ["eval/overall", "train/loss"]
    assert hp["values"] == {"id": run.id, "suite": "unit", "scale": "tiny", "sparsity": "s50",
                            "arch": "smelt", "pair": "unit-tiny", "phase": "branch1"}
    with tb.EventWriter(tmp_path / "none") as writer:  # no hparams given: none written
        writer.write({"step": 1, "loss": 2.5})
    with pytest.raises(KeyError, match="hparams"):
        _load(tmp_path / "none").PluginTagToContent("hparams")


def test_resumed_phase_event_files_match_metrics_jsonl(tmp_path, corpus):
    """A stable phase stopped at step 5 (its checkpoint) and resumed, then a decay branch: TensorBoard's
    curves are metrics.jsonl's, the steps logged twice shown once (the resumed values)."""
    run = _run()
    with pytest.raises(Preempted):
        train(run, root=tmp_path, corpus=corpus,
              options=TrainOptions(**{**OPTIONS.__dict__, "stop_after": 5}))
    rd = run_dir(run.suite, run.id, tmp_path)
    # As if killed before the save at step 5 committed: the resumed run logs step 5 again.
    shutil.rmtree(rd.checkpoints(None) / "5")
    first_run = {r["step"]: r for r in read_metrics(rd.metrics(None))}
    train(run, root=tmp_path, corpus=corpus, options=OPTIONS)
    relogged = [r for r in read_metrics(rd.metrics(None)) if r.get("step") == 5]
    assert len(relogged) == 2 and relogged[1]["tokens_per_s"] != first_run[5]["tokens_per_s"]
    train(run, 0, root=tmp_path, corpus=corpus, options=OPTIONS)
    for branch in (None, 0):
        records = read_metrics(rd.metrics(branch))
        acc = _load(rd.tensorboard(branch))
        tags = set(acc.Tags()["scalars"])
        for key in ("loss", "ce", "lr", "grad_norm", "tokens_per_s", "mfu", "expert_max_over_mean",
                    "expert_dropped_fraction", "load_balance_loss", "tokens"):
            assert f"train/{key}" in tags, key
            want = {r["step"]: r[key] for r in latest_per_step(records)}
            got = _series(acc, f"train/{key}")
            assert sorted(got) == sorted(want), (branch, key)
            assert len(acc.Scalars(f"train/{key}")) == len(want)  # a step logged twice shows once
            assert all(_close(got[s], want[s]) for s in want), (branch, key, got, want)
    evals = [r for r in read_metrics(rd.metrics(0)) if "eval" in r]
    assert evals and evals[-1]["eval"]["overall"] > 0
    acc = _load(rd.tensorboard(0))
    for source, value in evals[-1]["eval"].items():
        assert _close(_series(acc, f"eval/{source}")[evals[-1]["step"]], value), source
    # Two trainer processes (stopped, resumed) wrote two files; TensorBoard shows the first one's
    # steps 1-4 and the resumed one's from step 5 on (tokens_per_s above differs at step 5).
    assert len(gcs.list_files(rd.tensorboard(None))) == 2
    # Each phase carries the run's hparams, so runs compare by arch and sparsity.
    for branch, phase in ((None, "stable"), (0, "branch0")):
        values = _hparams(_load(rd.tensorboard(branch)))["values"]
        assert values["phase"] == phase and values["arch"] == run.arch and values["id"] == run.id
        assert values["sparsity"] == run.sparsity_label


def test_smelt_train_profile_writes_a_trace_for_a_three_step_run(tmp_path, corpus, monkeypatch,
                                                                  capsys):
    """`smelt train ID --stop-after 3 --profile 1:3`: a jax.profiler trace of steps 1-2 in
    <phase>/profile/, next to metrics.jsonl and the TensorBoard files."""
    import experiments
    import smelt_jax.train.trainer as trainer
    from smelt_jax.cli import main

    run = _run()
    monkeypatch.setattr(experiments, "find_run", lambda run_id: run)
    monkeypatch.setattr(trainer, "_load_corpus", lambda: corpus)
    monkeypatch.setenv("SMELT_RUNS_DIR", str(tmp_path))
    assert main(["train", run.id, "--quiet", "--log-every", "1", "--stop-after", "3",
                 "--profile", "1:3"]) == 42
    rd = run_dir(run.suite, run.id, tmp_path)
    traces = gcs.list_files(rd.profile(None))
    assert any(f.endswith(".xplane.pb") for f in traces), traces
    assert len(read_metrics(rd.metrics(None))) == 3 and gcs.list_files(rd.tensorboard(None))
    capsys.readouterr()
    assert main(["train", run.id, "--profile", "2:x"]) == 2
    assert capsys.readouterr().err.startswith("smelt: error: --profile")


def test_profile_option_is_checked_before_start():
    assert parse_profile("2:5") == (2, 5) and parse_profile("3") == 3 and parse_profile(None) is None
    for bad in ("x", "1:y"):
        with pytest.raises(ValueError, match="--profile"):
            parse_profile(bad)
    for bad in ((5, 2), 0, (1,), True):
        with pytest.raises(ValueError, match="--profile"):
            TrainOptions(profile=bad)


@pytest.mark.integration
def test_smelt_train_wandb_offline_holds_the_logged_scalars(tmp_path, corpus, monkeypatch, capsys):
    """`smelt train ID --wandb PROJECT` in W&B's offline mode: the run files hold metrics.jsonl's
    scalars against the step, and the run's hparams as its config."""
    pytest.importorskip("wandb")
    import experiments
    import smelt_jax.train.trainer as trainer
    from smelt_jax.cli import main
    from tests import wandb_reader

    run = _run()
    monkeypatch.setattr(experiments, "find_run", lambda run_id: run)
    monkeypatch.setattr(trainer, "_load_corpus", lambda: corpus)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs = tmp_path / "runs"
    assert main(["train", run.id, "--runs-dir", str(runs), "--quiet", "--log-every", "3",
                 "--wandb", "smelt-test"]) == 0
    (path,) = wandb_reader.run_files(tmp_path / "wandb-dir")
    assert path.name == f"run-{run.id}-stable.wandb"
    rows = [r for r in wandb_reader.history(path) if "train/loss" in r]
    records = latest_per_step(read_metrics(run_dir(run.suite, run.id, runs).metrics(None)))
    assert [r["step"] for r in rows] == [r["step"] for r in records] == [3, 6, 9, 12]
    for row, record in zip(rows, records):
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert _close(row[f"train/{key}"], record[key]), key
    config = wandb_reader.config(path)
    assert {k: config[k] for k in ("id", "arch", "sparsity", "phase")} == {
        "id": run.id, "arch": run.arch, "sparsity": run.sparsity_label, "phase": "stable"}


@pytest.mark.integration
def test_branch_trainer_writes_one_wandb_offline_run_with_its_final_evaluation(tmp_path, corpus,
                                                                               monkeypatch):
    """One trainer process of a decay branch, W&B offline: one offline-run-* folder (in the phase
    folder), holding the training scalars and the final evaluation (the endpoint's losses), not a
    second run for the evaluation."""
    pytest.importorskip("wandb")
    from tests import wandb_reader

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the phase folder: one phase's runs alone there
    run = _run()
    quick = {**OPTIONS.__dict__, "tensorboard": False}
    with pytest.raises(Preempted):  # the stable run up to branch 0's fork step (6), no W&B
        train(run, root=tmp_path, corpus=corpus, options=TrainOptions(**{**quick, "stop_after": 6}))
    train(run, 0, root=tmp_path, corpus=corpus, options=TrainOptions(**{**quick, "wandb": "smelt-test"}))
    rd = run_dir(run.suite, run.id, tmp_path)
    folders = sorted(rd.phase(0).glob("wandb/offline-run-*"))
    assert len(folders) == 1, folders
    (path,) = wandb_reader.run_files(rd.phase(0))
    assert path.parent == folders[0] and path.name == f"run-{run.id}-branch0.wandb"
    rows = wandb_reader.history(path)
    records = read_metrics(rd.metrics(0))
    assert [r["step"] for r in rows if "train/loss" in r] == [r["step"] for r in records
                                                              if "loss" in r] == [7, 8, 9, 10]
    (final,) = [r for r in records if "eval" in r]
    evals = [r for r in rows if "eval/overall" in r]
    assert [r["step"] for r in evals] == [final["step"]] == [10]
    assert set(final["eval"]) == {k.removeprefix("eval/") for k in evals[0] if k.startswith("eval/")}
    for source, value in final["eval"].items():
        assert _close(evals[0][f"eval/{source}"], value), source
    assert wandb_reader.config(path)["phase"] == "branch0"

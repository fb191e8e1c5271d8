"""What a run writes, on a gs:// runs root, against a real local Cloud Storage server (the emulator
of tests/gcs_emulator.py): run paths stay URLs; metrics.jsonl, TensorBoard files, profiles, run.json,
endpoint.json, the results table, orbax checkpoints and the trainer's lease are written to and read
back from the bucket; a micro run stopped and resumed there ends as the same run on local disk."""

import json
import os

import pytest

from gcs_emulator import BUCKET, gcs_emulator  # noqa: F401 - the fixture
from smelt_jax.platform import storage as gcs
from smelt_jax.run_files.results import EndpointResult, append_result, read_results, rewrite_csv
from smelt_jax.run_files.rundir import results_dir, run_dir, runs_root
from smelt_jax.train.metrics_log import MetricsWriter, latest_per_step, read_metrics

ROOT = f"gs://{BUCKET}/runs"


@pytest.fixture
def bucket_root(gcs_emulator, request):  # noqa: F811
    """A fresh prefix of the bucket for one test."""
    root = f"{ROOT}/{request.node.name}"
    yield root
    gcs.delete_tree(root)


def test_runs_root_on_a_bucket_stays_a_url(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMELT_RUNS_DIR", ROOT)
    assert str(runs_root()) == ROOT
    rd = run_dir("suite", "run-1")
    assert str(rd.spec_file) == f"{ROOT}/suite/run-1/run.json"
    assert str(rd.metrics(0)) == f"{ROOT}/suite/run-1/branch0/metrics.jsonl"
    assert str(rd.tensorboard(None)) == f"{ROOT}/suite/run-1/stable/tensorboard"
    assert str(results_dir("suite")) == f"{ROOT}/suite"
    monkeypatch.setenv("SMELT_RUNS_DIR", "local-runs")
    assert str(run_dir("suite", "r").root) == os.path.join("local-runs", "suite", "r")
    assert not (tmp_path / "gs:").exists()


def test_metrics_jsonl_on_a_bucket_is_rewritten_whole_and_resumes(bucket_root):
    path = f"{bucket_root}/stable/metrics.jsonl"
    with MetricsWriter(path) as log:
        log.write({"step": 1, "loss": 3.0})
        log.write({"step": 2, "loss": 2.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    gcs.write_bytes(path, gcs.read_bytes(path) + b'{"step": 3, "lo')  # a torn last line
    with MetricsWriter(path) as log:  # a resumed trainer
        log.write({"step": 2, "loss": 2.4})
    with pytest.warns(UserWarning, match="skipped 1"):
        records = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in latest_per_step(records)] == [(1, 3.0), (2, 2.4)]


def test_tensorboard_and_profile_on_a_bucket(bucket_root, tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    import jax.numpy as jnp

    from smelt_jax.train.tensorboard import EventWriter
    from smelt_jax.train.hooks import Profiler

    folder = f"{bucket_root}/stable/tensorboard"
    with EventWriter(folder) as writer:
        writer.write({"step": 1, "loss": 2.0, "mfu": 0.25})
        writer.write({"step": 2, "loss": 1.5, "mfu": 0.5})
    files = gcs.list_files(folder)
    assert len(files) == 1
    local = tmp_path / "tb"
    local.mkdir()
    (local / gcs.basename(files[0])).write_bytes(gcs.read_bytes(files[0]))
    acc = accumulator.EventAccumulator(str(local))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.5)]

    profiler = Profiler(f"{bucket_root}/stable/profile", 0, 1)
    profiler.before(0)
    x = jnp.ones((64, 64))
    profiler.after(1, x @ x)
    assert any(f.endswith(".xplane.pb") for f in gcs.list_files(f"{bucket_root}/stable/profile"))


def _row(branch: int, loss: float) -> EndpointResult:
    return EndpointResult(run_id="unit-run", branch=branch, pair_id="p", suite="unit", arch="smelt",
                          scale="tiny", sparsity_label="S50", sparsity=0.5, flops_per_token=1e6,
                          params=1000, tokens=4096, cumulative_flops=4.096e9, val_loss=loss,
                          losses_by_source={"web": loss})


def test_results_and_endpoint_json_on_a_bucket(bucket_root):

    folder = f"{bucket_root}/unit"
    append_result(_row(0, 3.0), folder)
    append_result(_row(1, 2.0), folder)
    append_result(_row(0, 2.9), folder)  # an endpoint written again replaces its row
    table = read_results(folder)
    assert list(zip(table["branch"], table["val_loss"])) == [(0, 2.9), (1, 2.0)]
    assert gcs.read_text(f"{folder}/results.csv").count("unit-run") == 2
    assert rewrite_csv(folder) and not rewrite_csv(f"{bucket_root}/none")

    rd = run_dir("unit", "unit-run", bucket_root)
    assert not gcs.exists(rd.endpoint(0))
    gcs.write_json(rd.endpoint(0), {"val_loss": 2.9})
    assert gcs.exists(rd.endpoint(0))
    assert json.loads(gcs.read_text(str(rd.endpoint(0)))) == {"val_loss": 2.9}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.data_helpers import build_tiny_corpus
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _losses(metrics) -> list[float]:
    return [r["loss"] for r in latest_per_step(read_metrics(metrics))]


@pytest.mark.slow
def test_micro_run_on_a_bucket_resumes_and_matches_a_local_run(bucket_root, corpus, monkeypatch,
                                                                tmp_path):
    """SMELT_RUNS_DIR=gs://...: the stable phase stopped after 5 steps (--stop-after), resumed from
    its gs:// checkpoint, finished; a decay branch forked from the gs:// fork checkpoint writes its
    endpoint row. Same losses and endpoint as the same run on local disk; nothing lands in ./gs:/.

    The emulator sends no generation headers on downloads; the fixture adds them (tests/gcs_emulator.py),
    without which an OCDBT manifest committed in more than one batch failed with "Malformed
    StorageGeneration" (2 of 4 runs)."""
    pytest.importorskip("gcsfs")  # orbax reaches gs:// through etils.epath -> fsspec -> gcsfs
    from smelt_jax.run_files.checkpoint_format import committed_steps
    from smelt_jax.train.trainer import Preempted, TrainOptions, train
    from tests.test_trainer import OPTIONS, _run

    run = _run()
    local = tmp_path / "local"
    train(run, root=local, corpus=corpus, options=OPTIONS)
    train(run, 0, root=local, corpus=corpus, options=OPTIONS)

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("SMELT_RUNS_DIR", bucket_root)
    with pytest.raises(Preempted, match="stopped at step 5"):
        train(run, corpus=corpus, options=TrainOptions(**{**OPTIONS.__dict__, "stop_after": 5}))
    rd = run_dir(run.suite, run.id)
    assert str(rd.root).startswith("gs://")
    assert 5 in committed_steps(rd.checkpoints(None))
    train(run, corpus=corpus, options=OPTIONS)
    summary = train(run, 0, corpus=corpus, options=OPTIONS)

    local_rd = run_dir(run.suite, run.id, local)
    for branch in (None, 0):
        assert _losses(rd.metrics(branch)) == _losses(local_rd.metrics(branch))
        assert gcs.list_files(rd.tensorboard(branch))
        assert not gcs.exists(f"{rd.phase(branch)}/trainer.lock")  # released
    assert {6, 12} <= set(committed_steps(rd.checkpoints(None)))
    endpoint = json.loads(gcs.read_text(str(rd.endpoint(0))))
    local_endpoint = json.loads(local_rd.endpoint(0).read_text())
    assert endpoint["val_loss"] == local_endpoint["val_loss"] == summary["val_loss"]
    table = read_results(results_dir(run.suite))
    assert list(table["val_loss"]) == [local_endpoint["val_loss"]]
    assert json.loads(gcs.read_text(str(rd.spec_file)))["id"] == run.id
    assert train(run, 0, corpus=corpus, options=OPTIONS)["status"] == "done"  # nothing left to do
    from smelt_jax.sweep.graph import JobStatus, artifact_statuses, build_graph
    statuses = artifact_statuses(build_graph([run]))  # sweep status, read from the bucket
    assert [statuses[job.name] for job in build_graph([run]).jobs
            if not job.is_stable and job.branch == 0] == [JobStatus.DONE]
    assert list(work.iterdir()) == []  # no ./gs:/ folder, nothing local


def test_lease_on_a_bucket_is_exclusive_and_taken_over_when_stale(bucket_root):
    from smelt_jax.train.lock import GcsLease, LockHeld, phase_lock

    folder = f"{bucket_root}/stable"
    first = phase_lock(folder, description="run stable")
    assert isinstance(first, GcsLease)
    first.acquire()
    second = GcsLease(folder, description="run stable")
    with pytest.raises(LockHeld, match="run stable is being trained by pid"):
        second.acquire()
    first.refresh()
    assert not first.lost
    stale = GcsLease(folder, description="run stable", stale_after=0.0)
    stale.info["host"] = "elsewhere"  # not this host: judged by its heartbeat alone
    stale.acquire()  # first's heartbeat is older than 0 s: taken over
    assert stale.took_over["token"] == first.token
    first.refresh()
    assert first.lost
    first.release()  # not ours any more: left alone
    assert gcs.exists(f"{folder}/trainer.lock")
    stale.release()
    assert not gcs.exists(f"{folder}/trainer.lock")


XLA_CACHE_SCRIPT = """
import jax, jax.numpy as jnp
from smelt_jax.train.compile_cache import enable_compilation_cache
enable_compilation_cache()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even this small program
print(float(jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((64, 64))).sum()))
"""


def test_compilation_cache_on_a_bucket(bucket_root):
    """$SMELT_XLA_CACHE=gs://...: compiled programs are written to the bucket (jax through etils.epath)."""
    import subprocess
    import sys

    cache = f"{bucket_root}/xla"
    env = {**os.environ, "SMELT_XLA_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", XLA_CACHE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any("jit__lambda" in name for name in gcs.list_files(cache))


def test_conditional_writes_on_a_bucket(bucket_root):
    """gcs.write_if / delete_if are compare-and-swap on the object's generation (ifGenerationMatch)."""
    url = f"{bucket_root}/cas/object"
    data, absent = gcs.read_versioned(url)
    assert data is None
    first = gcs.write_if(url, b"one", absent)
    assert first is not None and gcs.write_if(url, b"two", absent) is None  # created meanwhile
    second = gcs.write_if(url, b"two", first)
    assert second not in (None, first) and gcs.read_versioned(url) == (b"two", second)
    assert gcs.write_if(url, b"three", first) is None  # an old generation: refused
    assert not gcs.delete_if(url, first) and gcs.exists(url)
    assert gcs.delete_if(url, second) and not gcs.exists(url)


def test_lease_race_on_a_bucket_has_one_winner(bucket_root):
    """Eight trainers start at the same instant, then eight take over the same stale lease: each time
    exactly one holds it (the server's ifGenerationMatch decides), the others see a live holder."""
    import threading

    from smelt_jax.train.lock import GcsLease, LockHeld

    def race(folder: str, stale_after: float | None) -> list[GcsLease]:
        leases = [GcsLease(folder, description="run stable", stale_after=stale_after) for _ in range(8)]
        for lease in leases:
            lease.info["host"] = "elsewhere"  # judged by heartbeat, not by this host's pids
        barrier, winners = threading.Barrier(len(leases)), []

        def contend(lease: GcsLease) -> None:
            barrier.wait()
            try:
                lease.acquire()
                winners.append(lease)
            except LockHeld:
                pass

        threads = [threading.Thread(target=contend, args=(lease,)) for lease in leases]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return winners

    folder = f"{bucket_root}/race"
    winners = race(folder, None)
    assert len(winners) == 1
    holder = winners[0]
    # The holder looks dead to contenders with stale_after=0: all race for its one stale generation.
    takers = race(folder, 0.0)
    assert sum(t.took_over["token"] == holder.token for t in takers) == 1  # its generation: taken once
    holder.refresh()
    assert holder.lost
    # With stale_after=0 every later contender may take over again; each took over its predecessor,
    # never the same generation twice: the last one is the holder the object names.
    assert json.loads(gcs.read_text(f"{folder}/trainer.lock"))["token"] == takers[-1].token
    assert len({t.took_over["token"] for t in takers}) == len(takers)


def test_results_collect_reads_endpoints_from_the_bucket(bucket_root, tmp_path):
    from smelt_jax.sweep.collect import collect

    for branch, loss in ((0, 3.0), (1, 2.5)):
        row = _row(branch, loss).to_row()
        gcs.write_json(run_dir("unit", "unit-run", bucket_root).endpoint(branch), row)
    gcs.write_text(f"{bucket_root}/unit/unit-run/stable/metrics.jsonl", "{}\n")  # not an endpoint
    reports = collect(bucket_root, store_root=bucket_root)  # suites found on the bucket
    assert [(r.suite, r.endpoints, r.appended) for r in reports] == [("unit", 2, 2)]
    assert list(read_results(f"{bucket_root}/unit")["val_loss"]) == [3.0, 2.5]
    assert collect(bucket_root, ["unit"], store_root=bucket_root)[0].appended == 0
    local = collect(bucket_root, ["unit"], store_root=tmp_path)  # into a local store
    assert local[0].appended == 2 and len(read_results(tmp_path / "unit")) == 2


def test_analysis_tables_go_to_a_bucket(bucket_root):
    """`smelt analyze --out gs://...`: every table lands in the bucket and reads back equal."""
    import io

    import pandas as pd

    from smelt_jax.analysis.run_analysis import write_tables

    tables = {"routing_overlap": pd.DataFrame({"layer": [1, 2], "mean_overlap": [0.5, 0.25]}),
              "sample": pd.DataFrame({"n_rows": [4]})}
    urls = write_tables(tables, f"{bucket_root}/analysis")
    assert urls == [f"{bucket_root}/analysis/routing_overlap.csv", f"{bucket_root}/analysis/sample.csv"]
    for url, table in zip(urls, tables.values()):
        pd.testing.assert_frame_equal(pd.read_csv(io.StringIO(gcs.read_text(url))), table)


def test_saved_runs_on_a_bucket_are_found_by_prefix_and_listed(bucket_root):
    """A custom run saved on a gs:// runs root: found by its id, by a prefix of it (one listing of the
    run folders it starts) and listed by `saved_runs`; a prefix of two ids is ambiguous."""
    import dataclasses

    from custom_run_helpers import TINY_SPEC, tiny_run

    from smelt_jax.platform.errors import AmbiguousName, UnknownName
    from smelt_jax.run_files.run_lookup import find_run, saved_runs

    runs = [tiny_run(), tiny_run(dict(TINY_SPEC, scale="tinier"))]
    for run in runs:
        rd = run_dir(run.suite, run.id, bucket_root)
        gcs.write_json(rd.spec_file, {**run.to_dict(), "metadata": {}})
        gcs.write_text(f"{rd.root}/stable/metrics.jsonl", "{}\n")  # other objects in the folder
    gcs.write_text(f"{bucket_root}/custom/not-a-run.json", "{}")  # not in a run folder
    first = runs[0]
    assert find_run(first.id, bucket_root) == first
    assert find_run(first.id[:len("custom-tiny-s50-")], bucket_root) == first
    assert dataclasses.asdict(find_run(runs[1].id[:-3], bucket_root)) == dataclasses.asdict(runs[1])
    with pytest.raises(AmbiguousName):
        find_run("custom-tin", bucket_root)
    with pytest.raises(UnknownName):
        find_run("custom-huge", bucket_root)
    listed, problems = saved_runs(bucket_root)
    assert [r.id for r in listed] == sorted(r.id for r in runs) and problems == []

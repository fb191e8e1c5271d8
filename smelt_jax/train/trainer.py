"""The training loop for one phase of one run: the stable run, or one decay branch.

`train(run, branch)` resumes from the phase's newest good checkpoint (a branch starts from the
stable run's checkpoint at its fork step), trains to the phase's last step, evaluates, and for a
branch writes the endpoint row. Everything it needs to resume is (checkpoint, step): the batch is a
pure function of the step and so is the learning rate, so an interrupted and resumed run ends with
bit-identical parameters.

Exits (as exceptions the CLI maps to exit codes): `Preempted` (SIGTERM/SIGINT or `stop_after`:
saved, exit 42, restart me), `NonFiniteLoss` (exit 3: nothing saved past the last good checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from smelt_jax import budget as budget_lib
from smelt_jax import hardware, sharding
from smelt_jax.descriptors import Parallelism, RunSpec
from smelt_jax.errors import SmeltError, UsageError
from smelt_jax.rundir import RunDir, results_dir, run_dir
from smelt_jax.train import lr as lr_lib
from smelt_jax.train.step import optimizer
from smelt_jax.train.wandb_log import wandb_writer

PREEMPTED_EXIT_CODE = 42
NONFINITE_EXIT_CODE = 3


class Preempted(Exception):
    """Stopped on request after saving a checkpoint; restart to resume."""


class NonFiniteLoss(SmeltError, RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate at the end of the phase only
    eval_tokens: int = 16_384  # per source
    eval_batch_size: int = 8
    checkpoint_every: int = 100
    max_to_keep: int = 2
    stop_after: int | None = None  # save and raise Preempted after this many steps (tests, chunking)
    progress: bool = True
    peak_flops: float | None = None  # None: by device kind; on CPU a measured matmul rate
    # jax.profiler trace into <phase>/profile/: (start, stop) traces the steps start..stop-1 (the
    # updates from step `start` to step `stop`); an int N traces the N steps after the first step this
    # process runs (that one compiles). None: no trace.
    profile: tuple[int, int] | int | None = None
    tensorboard: bool = True  # event files in <phase>/tensorboard/ (smelt_jax.train.tensorboard)
    wandb: str = ""  # W&B project the phase also logs to (smelt_jax.train.wandb_log); "": none

    def __post_init__(self) -> None:
        """Bad options fail here, before any start-up work (UsageError: one line, exit 2)."""
        minimum = {"log_every": 1, "checkpoint_every": 1, "eval_every": 0, "eval_tokens": 1,
                   "eval_batch_size": 1, "max_to_keep": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.stop_after is not None and (isinstance(self.stop_after, bool)
                                            or not isinstance(self.stop_after, int)
                                            or self.stop_after < 1):
            raise UsageError(f"--stop-after must be an integer >= 1, got {self.stop_after!r}")
        if self.peak_flops is not None and not (isinstance(self.peak_flops, (int, float))
                                                and 0 < self.peak_flops < float("inf")):
            raise UsageError(f"peak_flops must be a positive finite number, got {self.peak_flops!r}")
        profile = self.profile
        if profile is not None:
            if isinstance(profile, (tuple, list)):
                ok = (len(profile) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in profile) and 0 <= profile[0] < profile[1])
            else:
                ok = isinstance(profile, int) and not isinstance(profile, bool) and profile >= 1
            if not ok:
                raise UsageError("--profile must be STEPS (an integer >= 1) or START:STOP (integers, "
                                 f"0 <= START < STOP), got {profile!r}")


def peak_flops_per_device() -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    kind = jax.devices()[0].device_kind
    known = hardware.peak_flops_for_device_kind(kind)
    if known is not None:
        return known
    a = jnp.ones((1024, 1024), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * 1024 ** 3 / float(np.median(times)), f"measured 1024^2 f32 matmul on {kind}"


def _exists(path) -> bool:
    """Whether a file exists, local or gs://."""
    from smelt_jax.data import gcs
    return gcs.exists(str(path)) if gcs.is_gcs(path) else Path(path).exists()


def _write_json_atomically(path: Path, data: Any) -> None:
    """Local: a temporary file renamed into place; gs://: one object write (atomic on its own)."""
    from smelt_jax.data import gcs
    if gcs.is_gcs(path):
        gcs.write_text(str(path), json.dumps(data, indent=1, sort_keys=True))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(path.suffix + ".tmp")
    temp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temp, path)


def enable_compilation_cache() -> None:
    """Persist compiled programs across processes ($SMELT_XLA_CACHE, default data_cache/xla): the
    decay branches and resumed runs of a sweep recompile the same train step."""
    from smelt_jax.data.corpus import default_data_dir
    folder = os.environ.get("SMELT_XLA_CACHE") or str(default_data_dir() / "xla")
    if not folder.startswith("gs://"):  # a gs:// cache is written by jax itself (through etils.epath)
        Path(folder).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _load_corpus():
    from smelt_jax.data.corpus import open_dataset
    return open_dataset(None, progress=sys.stderr.isatty())


class _StopFlag:
    """SIGTERM / SIGINT set a flag; the loop saves at the next step boundary and exits 42."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self) -> Self:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, _frame) -> None:
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def evaluate(eval_step, params, corpus, seq_len: int, options: TrainOptions,
             place=lambda batch: batch, host: dict | None = None) -> dict[str, float]:
    """Validation loss per source and overall (token-weighted), nats per token.

    `host` ({'host_index', 'host_count'}) picks this process's rows of each validation batch and
    `place` turns them into the step's input (a global array on the trainer's mesh)."""
    from smelt_jax.data.pipeline import validation_sets
    totals = {}
    for source, batches in validation_sets(corpus, batch_size=options.eval_batch_size,
                                           seq_len=seq_len, max_tokens=options.eval_tokens,
                                           **(host or {})).items():
        loss_sum, count = 0.0, 0.0
        for batch in batches:
            s, c = eval_step(params, place(batch))
            loss_sum, count = loss_sum + float(s), count + float(c)
        totals[source] = (loss_sum, count)
    out = {source: s / max(c, 1.0) for source, (s, c) in totals.items()}
    out["overall"] = (sum(s for s, _ in totals.values())
                      / max(sum(c for _, c in totals.values()), 1.0))
    return out


def _replicated_scalar(mesh, value) -> jax.Array:
    """A float32 scalar on every device of `mesh` (valid input in multi-process programs too)."""
    host = np.asarray(value, np.float32)
    return jax.make_array_from_callback((), sharding.replicated(mesh), lambda _index: host)


class _Logs:
    """metrics.jsonl and, when given, the TensorBoard event file: every record goes to both."""

    def __init__(self, *writers) -> None:
        self.writers = [w for w in writers if w is not None]

    def write(self, record: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(record)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Profiler:
    """A `jax.profiler` trace of the steps [start, stop) into `folder` (`<phase>/profile/`). On gs://
    the trace is written to a local temporary folder and its files are uploaded when it stops."""

    def __init__(self, folder, start: int, stop: int) -> None:
        self.folder, self.start, self.stop = str(folder), start, stop
        self.active, self.local = False, None
        self.files: list[str] = []

    def before(self, step: int) -> None:
        if not self.active and self.start <= step < self.stop and not self.files:
            from smelt_jax.data import gcs
            if gcs.is_gcs(self.folder):
                import tempfile
                self.local = tempfile.mkdtemp(prefix="smelt-profile-")
            else:
                os.makedirs(self.folder, exist_ok=True)
            jax.profiler.start_trace(self.local or self.folder)
            self.active = True

    def after(self, done: int, outputs) -> None:
        if self.active and done >= self.stop:
            jax.block_until_ready(outputs)
            self.finish()

    def finish(self) -> None:
        if not self.active:
            return
        self.active = False
        jax.profiler.stop_trace()
        from smelt_jax.data import gcs
        if self.local is None:
            self.files = gcs.list_files(self.folder)
            return
        import shutil
        try:
            for path in sorted(Path(self.local).rglob("*")):
                if path.is_file():
                    target = gcs.join(self.folder, path.relative_to(self.local).as_posix())
                    gcs.write_bytes(target, path.read_bytes())
                    self.files.append(target)
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


class ForkCheckpointDamaged(SmeltError, ValueError):
    """A branch's fork checkpoint is damaged: the stable run must retrain it (one line, exit 2)."""


def _phase_name(branch: int | None) -> str:
    return "stable" if branch is None else f"branch {branch}"


def train(run: RunSpec, branch: int | None = None, *, root: Path | None = None, corpus=None,
          options: TrainOptions = TrainOptions(), parallelism: Parallelism | None = None
          ) -> dict[str, Any]:
    """Train one phase to its end (or until stopped). Returns a summary dict.

    The mesh comes from `parallelism` (default: the run's own `run.parallelism`) over every device of
    every process; one device is a 1x1x1x1 mesh. Parameters and optimizer state are created (or
    restored) directly with their shardings; each process feeds its own rows of the global batch.

    `corpus` defaults to the embedded corpus; data of a tokenizer the run does not expect
    (`RunSpec.check_data`) raises DataMismatch before anything is written. Process 0 then takes the
    phase's lock (`smelt_jax.train.lock`): a second trainer of the same phase raises `LockHeld` naming
    the holder, before any other work.
    """
    from smelt_jax.train import lock as lock_lib

    lr_lib.phase_steps(run.schedule, branch)  # a bad branch fails before anything is written
    corpus = corpus if corpus is not None else _load_corpus()
    run.check_data(corpus.tokenizer, f"the data at {getattr(corpus, 'root', '(in memory)')}")
    rd = run_dir(run.suite, run.id, root)
    if jax.process_index() != 0:
        return _train_phase(run, branch, rd, root, corpus, options, parallelism, None)
    lock = lock_lib.phase_lock(rd.phase(branch), description=f"{run.id} {_phase_name(branch)}")
    with lock_lib.holding(lock):
        if getattr(lock, "took_over", None):
            info = lock.took_over
            print(f"smelt: took over the stale lock of pid {info.get('pid')} on {info.get('host')} "
                  f"for {run.id} {_phase_name(branch)}", file=sys.stderr)
        return _train_phase(run, branch, rd, root, corpus, options, parallelism, lock)


def _stable_holes(rd: RunDir, schedule, good: list[int]) -> list[int]:
    """Fork steps below the newest good stable step whose checkpoint is missing (damaged and moved
    aside) while their branch has no endpoint yet: the stable run must train them again."""
    if not good:
        return []
    return [f for k, f in enumerate(schedule.fork_steps)
            if f < good[-1] and f not in good and not _exists(rd.endpoint(k))]


def _restore_fork(rd: RunDir, run: RunSpec, branch: int, first: int, state: Any) -> tuple[int, Any]:
    """(step, state) of the stable checkpoint a branch forks from; one-line errors when it is missing
    or damaged (the stable trainer, not this one, moves a damaged stable step aside)."""
    from smelt_jax.rundir import checkpoint_damage
    from smelt_jax.train.checkpoint import Checkpointer, CheckpointError

    stable = Checkpointer(rd.checkpoints(None), keep_forever=run.schedule.fork_steps)
    try:
        if first not in stable.all_steps():
            raise UsageError(
                f"branch {branch} of {run.id} forks at step {first}, but the stable run has no "
                f"committed checkpoint there (have {stable.all_steps()}); train the stable run first")
        try:
            damage = checkpoint_damage(rd.checkpoints(None), first)
            if damage:
                raise CheckpointError(damage)
            step, state, _ = stable.restore(state, step=first)
        except CheckpointError as err:
            raise ForkCheckpointDamaged(
                f"branch {branch} of {run.id} forks at step {first}, but the stable checkpoint there "
                f"is damaged ({' '.join(str(err).split())[:200]}); run `smelt train {run.id}` to move "
                "it aside and retrain it") from None
    finally:
        stable.close()
    return step, state


def _train_phase(run: RunSpec, branch: int | None, rd: RunDir, root: Path | None, corpus,
                 options: TrainOptions, parallelism: Parallelism | None, lock) -> dict[str, Any]:
    from smelt_jax.train import state as ts
    from smelt_jax.train.metrics_log import MetricsWriter, NullWriter

    schedule, cfg = run.schedule, run.model
    parallelism = parallelism if parallelism is not None else run.parallelism
    first, end = lr_lib.phase_steps(schedule, branch)
    is_writer = jax.process_index() == 0
    if is_writer and not _exists(rd.spec_file):
        _write_json_atomically(rd.spec_file, {**run.to_dict(), "metadata": _metadata()})
    from smelt_jax.train.checkpoint import Checkpointer, CheckpointError

    keep = set(schedule.fork_steps) | {end} if branch is None else {end}
    ckpt_dir = rd.checkpoints(branch)
    # A damaged step (cheap check: missing files, wrong sizes) is moved aside before anything else.
    probe = Checkpointer(ckpt_dir, max_to_keep=options.max_to_keep, keep_forever=keep,
                         clean_temporary=True)
    for name in probe.removed_temporary:
        print(f"smelt: removed {ckpt_dir / name}, the temporary folder of a save that never "
              "committed", file=sys.stderr)
    if is_writer:
        probe.quarantine_damaged(probe.all_steps())
    good = probe.all_steps()
    holes = _stable_holes(rd, schedule, good) if branch is None else []
    stop_at = min(holes) if holes else end
    if holes:
        # Repair: train from the newest good step below the hole to the hole, saving only there, with
        # no rotation (saving an older step must not delete a newer one); then train on as usual.
        probe.close()
        ckpt = Checkpointer(ckpt_dir, max_to_keep=10 ** 9, keep_forever=keep)
        print(f"smelt: {run.id} stable: the fork checkpoint at step {stop_at} is missing or was "
              "damaged; retraining it", file=sys.stderr)
    else:
        ckpt = probe

    enable_compilation_cache()
    from smelt_jax.data.pipeline import TrainPipeline

    mesh = sharding.make_mesh(parallelism)
    tx = optimizer(schedule)
    plan = ts.plan_training(cfg, tx, mesh, remat=parallelism.remat)
    # Restore targets carry the current mesh's shardings: a checkpoint written on another mesh or
    # host count comes back placed for this one.
    state = plan.restore_target()
    step, restored = first, False
    if holes:
        below = [s for s in good if s < stop_at]
        if below:
            step, state, _ = ckpt.restore(state, step=below[-1])
    elif ckpt.latest_step() is not None:
        try:
            step, state, _ = ckpt.restore(state, quarantine=is_writer)
            restored = True
        except CheckpointError:
            if ckpt.latest_step() is not None:
                ckpt.close()
                raise
            # every step was damaged and moved aside: the phase starts again
    if branch is not None and not restored:
        try:
            step, state = _restore_fork(rd, run, branch, first, state)
        except Exception:
            ckpt.close()
            raise
    if step >= end and (branch is None or _exists(rd.endpoint(branch))):
        ckpt.close()
        return {"run_id": run.id, "branch": branch, "step": step, "status": "done"}
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(state)):
        state = dict(zip(("params", "opt_state"), ts.init_state(plan, tx, schedule.seed)))

    train_step = ts.jit_train_step(plan, tx, schedule.batch_size, schedule.seq_len)
    eval_step = ts.jit_eval_step(plan, options.eval_batch_size, schedule.seq_len)
    # Which rows of a global batch this process feeds depends on the mesh, not on a fixed host split.
    eval_host = ts.host_split(plan, options.eval_batch_size, schedule.seq_len)

    def place_eval(batch):
        return ts.global_batch(plan, batch, options.eval_batch_size)

    def evaluate_here():
        return evaluate(eval_step, params, corpus, schedule.seq_len, options, place_eval, eval_host)

    pipeline = TrainPipeline.from_schedule(
        corpus, schedule, **ts.host_split(plan, schedule.batch_size, schedule.seq_len))
    flops_per_token = budget_lib.train_flops_per_token(cfg)
    peak, peak_source = options.peak_flops, "given"
    if peak is None:
        peak, peak_source = peak_flops_per_device()
    peak *= jax.device_count()
    metrics_file = rd.metrics(branch)

    params, opt_state = state["params"], state["opt_state"]
    start_step, bad = step, _replicated_scalar(mesh, 0.0) > 0
    last_good_step = step
    window_start, window_tokens = time.perf_counter(), 0

    def check_finite(at_step: int, metrics: dict | None) -> None:
        if bool(bad):
            ckpt.wait()
            raise NonFiniteLoss(
                f"{run.id} {_phase_name(branch)}: non-finite loss "
                f"between steps {last_good_step} and {at_step} (last metrics: {metrics}); the "
                f"checkpoint at step {ckpt.latest_step()} is kept")

    def save(at_step: int) -> None:
        ckpt.save(at_step, {"params": params, "opt_state": opt_state},
                  {"step": at_step, "data_step": at_step, "run_id": run.id, "branch": branch})

    progress = None
    if options.progress and is_writer:
        from smelt_jax.progress import progress_bar  # tqdm on a terminal, else a line per log
        progress = progress_bar(end - first, initial=step - first, unit="step",
                                desc=f"{run.id} {'stable' if branch is None else f'branch{branch}'}")
    iterator = pipeline.iterator(step, stop_at - step)
    logged = None
    # Only process 0 writes metrics; the others log into the void.
    log_context = (_Logs(MetricsWriter(metrics_file), _event_writer(rd, branch, options, step, run=run),
                         wandb_writer(options.wandb, run, branch, rd.phase(branch)))
                   if is_writer else NullWriter())
    profiler = None
    if options.profile is not None:
        begin, finish = (options.profile if not isinstance(options.profile, int)
                         else (step + 1, step + 1 + options.profile))
        profiler = _Profiler(rd.profile(branch), begin, finish)
    try:
        with _StopFlag() as stop, log_context as log, jax.set_mesh(mesh):
            for step in range(step, stop_at):  # noqa: B020 (the resume point, then the last step)
                if profiler is not None:
                    profiler.before(step)
                if lock is not None and lock.lost:
                    from smelt_jax.train.lock import LockLost
                    raise LockLost(f"{run.id} {_phase_name(branch)}: another trainer took this "
                                   f"phase's lock over (this process looked dead); stopped at "
                                   f"step {step} without saving")
                ckpt.raise_if_save_failed()
                batch = ts.global_batch(plan, next(iterator), schedule.batch_size)
                lr = _replicated_scalar(mesh, lr_lib.learning_rate(schedule, step, branch))
                params, opt_state, metrics = train_step(params, opt_state, batch, lr)
                bad = bad | ~jnp.isfinite(metrics["loss"])
                done = step + 1
                if profiler is not None:
                    profiler.after(done, (params, metrics))
                window_tokens += schedule.tokens_per_step
                if progress is not None:
                    progress.update(1)
                if done % options.log_every == 0 or done == end:
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    check_finite(done, values)
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = window_tokens / max(elapsed, 1e-9)
                    # `tokens`: cumulative training tokens (the schedule's, as in budgets and
                    # endpoints); `step_tokens`: the loss-bearing tokens of this step's batch.
                    step_tokens = values.pop("tokens", None)
                    logged = {"step": done, **values, "tokens": done * schedule.tokens_per_step,
                              "step_tokens": step_tokens,
                              "cumulative_flops": done * schedule.tokens_per_step * flops_per_token,
                              "tokens_per_s": tokens_per_s,
                              "flops_per_s": tokens_per_s * flops_per_token,
                              "mfu": tokens_per_s * flops_per_token / peak, "peak_flops": peak,
                              "peak_flops_source": peak_source, "time": time.time()}
                    log.write(logged)
                    if progress is not None:
                        progress.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tokens_per_s:.0f}")
                    window_start, window_tokens = time.perf_counter(), 0
                    last_good_step = done
                if options.eval_every and done % options.eval_every == 0 and done != end:
                    log.write({"step": done, "eval": evaluate_here()})
                interrupted = stop.signal is not None or (
                    options.stop_after is not None and done - start_step >= options.stop_after)
                if holes:
                    # Repairing a hole: save only the hole (an older step than the newest one).
                    if done == stop_at:
                        check_finite(done, logged)
                        save(done)
                    elif interrupted:
                        raise Preempted(f"{run.id}: stopped at step {done} while retraining the "
                                        f"fork checkpoint at step {stop_at}; restart to resume")
                    continue
                if done in keep or done % options.checkpoint_every == 0 or done == end or interrupted:
                    check_finite(done, logged)
                    save(done)
                if interrupted and done != end:
                    ckpt.close()
                    raise Preempted(f"{run.id}: stopped at step {done} after saving; restart to resume")
        ckpt.wait()
        if profiler is not None:
            profiler.finish()
    except BaseException:
        if profiler is not None:
            try:
                profiler.finish()
            except Exception:  # noqa: BLE001 — the error in flight says more
                pass
        if progress is not None:
            progress.close()
        try:
            ckpt.close()
        except Exception:  # noqa: BLE001 — the error in flight says more
            pass
        raise
    if progress is not None:
        progress.close()
    if holes:
        ckpt.close()
        return _train_phase(run, branch, rd, root, corpus, options, parallelism, lock)
    summary = {"run_id": run.id, "branch": branch, "step": end, "status": "done"}
    # Endpoints are the decay branches; the stable phase is evaluated only when asked (eval_every).
    if branch is not None:
        with jax.set_mesh(mesh):
            losses = evaluate_here()
        summary.update(val_loss=losses["overall"], losses=losses)
        if is_writer:
            with _Logs(MetricsWriter(metrics_file), _event_writer(rd, branch, options, run=run),
                       wandb_writer(options.wandb, run, branch, rd.phase(branch))) as log:
                log.write({"step": end, "eval": losses})
            summary["endpoint"] = write_endpoint(run, branch, losses, root=root, rd=rd)
    ckpt.close()
    return summary


def _event_writer(rd: RunDir, branch: int | None, options: TrainOptions,
                  resume_step: int | None = None, run: RunSpec | None = None):
    """The phase's TensorBoard event writer (None when turned off). `resume_step`: the step training
    restarts from (its next logged step is resume_step + 1, from which older files are hidden)."""
    if not options.tensorboard:
        return None
    from smelt_jax.train.tensorboard import EventWriter, run_hparams
    return EventWriter(rd.tensorboard(branch),
                       start_step=None if resume_step is None else resume_step + 1,
                       hparams=None if run is None else run_hparams(run, branch))


def write_endpoint(run: RunSpec, branch: int, losses: dict[str, float], *, root: Path | None,
                   rd: RunDir) -> dict:
    """Append the endpoint's row to the suite's results store, then write endpoint.json."""
    from smelt_jax.results import EndpointResult, append_result, git_commit
    b = run.budget()
    tokens = run.schedule.branch_tokens(branch)
    result = EndpointResult(
        run_id=run.id, branch=branch, pair_id=run.pair_id, suite=run.suite, arch=run.arch,
        scale=run.scale, sparsity_label=run.sparsity_label, sparsity=max(0.0, b.sparsity or 0.0),
        flops_per_token=b.train_flops_per_token, params=b.params_total, tokens=tokens,
        cumulative_flops=b.train_flops_per_token * tokens, val_loss=losses["overall"],
        losses_by_source={k: v for k, v in losses.items() if k != "overall"},
        git_commit=git_commit())
    append_result(result, results_dir(run.suite, root))
    row = result.to_row()
    _write_json_atomically(rd.endpoint(branch), row)
    return row


def _metadata() -> dict[str, Any]:
    import flax
    import optax

    from smelt_jax.results import git_commit
    return {"git_commit": git_commit(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind, "processes": jax.process_count(),
            "python": sys.version.split()[0], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                       time.gmtime())}

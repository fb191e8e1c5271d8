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
from smelt_jax import sharding
from smelt_jax.descriptors import Parallelism, RunSpec
from smelt_jax.rundir import RunDir, results_dir, run_dir
from smelt_jax.train import lr as lr_lib
from smelt_jax.train.step import optimizer

PREEMPTED_EXIT_CODE = 42
NONFINITE_EXIT_CODE = 3

# Dense bf16 peak FLOP/s per chip, by jax device_kind prefix (vendor data sheets).
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12, "NVIDIA H100": 989e12,
              "NVIDIA H200": 989e12, "NVIDIA A100": 312e12}


class Preempted(Exception):
    """Stopped on request after saving a checkpoint; restart to resume."""


class NonFiniteLoss(RuntimeError):
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


def peak_flops_per_device() -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    kind = jax.devices()[0].device_kind
    for prefix, value in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return value, f"{prefix} bf16 data sheet"
    a = jnp.ones((1024, 1024), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * 1024 ** 3 / float(np.median(times)), f"measured 1024^2 f32 matmul on {kind}"


def _write_json_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(path.suffix + ".tmp")
    temp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temp, path)


def enable_compilation_cache() -> None:
    """Persist compiled programs across processes ($SMELT_XLA_CACHE, default data_cache/xla): the
    decay branches and resumed runs of a sweep recompile the same train step."""
    from smelt_jax.data.corpus import default_data_dir
    folder = Path(os.environ.get("SMELT_XLA_CACHE", default_data_dir() / "xla"))
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _load_corpus():
    from smelt_jax.data.corpus import Corpus, build_corpus
    return Corpus(build_corpus(progress=sys.stderr.isatty()).folder)


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


def train(run: RunSpec, branch: int | None = None, *, root: Path | None = None, corpus=None,
          options: TrainOptions = TrainOptions(), parallelism: Parallelism | None = None
          ) -> dict[str, Any]:
    """Train one phase to its end (or until stopped). Returns a summary dict.

    The mesh comes from `parallelism` (default: the run's own `run.parallelism`) over every device of
    every process; one device is a 1x1x1x1 mesh. Parameters and optimizer state are created (or
    restored) directly with their shardings; each process feeds its own rows of the global batch.
    """
    from smelt_jax.parallel import train_state as ts

    schedule, cfg = run.schedule, run.model
    parallelism = parallelism if parallelism is not None else run.parallelism
    if parallelism.remat != "none":
        cfg = cfg.replace(remat=parallelism.remat)
    first, end = lr_lib.phase_steps(schedule, branch)
    rd = run_dir(run.suite, run.id, root)
    is_writer = jax.process_index() == 0
    if is_writer and not rd.spec_file.exists():
        _write_json_atomically(rd.spec_file, {**run.to_dict(), "metadata": _metadata()})
    corpus = corpus if corpus is not None else _load_corpus()
    enable_compilation_cache()
    from smelt_jax.data.pipeline import TrainPipeline
    from smelt_jax.train.checkpoint import Checkpointer

    mesh = sharding.make_mesh(parallelism)
    tx = optimizer(schedule)
    plan = ts.plan_training(cfg, tx, mesh)
    abstract_params, abstract_opt_state = plan.abstract_state()
    # Restore targets carry the current mesh's shardings: a checkpoint written on another mesh or
    # host count comes back placed for this one.
    state = {"params": abstract_params, "opt_state": abstract_opt_state}
    keep = set(schedule.fork_steps) | {end} if branch is None else {end}
    ckpt = Checkpointer(rd.checkpoints(branch), max_to_keep=options.max_to_keep,
                        keep_forever=keep)
    step = first
    if ckpt.latest_step() is not None:
        step, state, _ = ckpt.restore(state)
    elif branch is not None:
        stable = Checkpointer(rd.checkpoints(None), keep_forever=schedule.fork_steps)
        if first not in stable.all_steps():
            stable.close()
            ckpt.close()
            raise ValueError(f"branch {branch} of {run.id} forks at step {first}, but the stable run "
                             f"has no committed checkpoint there (have {stable.all_steps()}); train "
                             "the stable run first")
        step, state, _ = stable.restore(state, step=first)
        stable.close()
    if step >= end and (branch is None or rd.endpoint(branch).exists()):
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
    metrics_file.parent.mkdir(parents=True, exist_ok=True)

    params, opt_state = state["params"], state["opt_state"]
    start_step, bad = step, _replicated_scalar(mesh, 0.0) > 0
    last_good_step = step
    window_start, window_tokens = time.perf_counter(), 0

    def check_finite(at_step: int, metrics: dict | None) -> None:
        if bool(bad):
            ckpt.wait()
            raise NonFiniteLoss(
                f"{run.id} {'stable' if branch is None else f'branch {branch}'}: non-finite loss "
                f"between steps {last_good_step} and {at_step} (last metrics: {metrics}); the "
                f"checkpoint at step {ckpt.latest_step()} is kept")

    def save(at_step: int) -> None:
        ckpt.save(at_step, {"params": params, "opt_state": opt_state},
                  {"step": at_step, "data_step": at_step, "run_id": run.id, "branch": branch})

    progress = None
    if options.progress and is_writer:
        from tqdm.auto import tqdm
        progress = tqdm(total=end - first, initial=step - first, unit="step",
                        desc=f"{run.id} {'stable' if branch is None else f'branch{branch}'}",
                        file=sys.stderr, dynamic_ncols=True)
    iterator = pipeline.iterator(step, end - step)
    logged = None
    # Only process 0 writes metrics; the others log into the void.
    log_context = metrics_file.open("a") if is_writer else open(os.devnull, "w")
    with _StopFlag() as stop, log_context as log, jax.set_mesh(mesh):
        for step in range(step, end):  # noqa: B020 (step is the resume point, then the last step)
            batch = ts.global_batch(plan, next(iterator), schedule.batch_size)
            lr = _replicated_scalar(mesh, lr_lib.learning_rate(schedule, step, branch))
            params, opt_state, metrics = train_step(params, opt_state, batch, lr)
            bad = bad | ~jnp.isfinite(metrics["loss"])
            done = step + 1
            window_tokens += schedule.tokens_per_step
            if progress is not None:
                progress.update(1)
            if done % options.log_every == 0 or done == end:
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                check_finite(done, values)
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_tokens / max(elapsed, 1e-9)
                logged = {"step": done, "tokens": done * schedule.tokens_per_step,
                          "cumulative_flops": done * schedule.tokens_per_step * flops_per_token,
                          **values, "tokens_per_s": tokens_per_s,
                          "flops_per_s": tokens_per_s * flops_per_token,
                          "mfu": tokens_per_s * flops_per_token / peak, "peak_flops": peak,
                          "peak_flops_source": peak_source, "time": time.time()}
                if is_writer:
                    log.write(json.dumps(logged) + "\n")
                    log.flush()
                if progress is not None:
                    progress.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tokens_per_s:.0f}")
                window_start, window_tokens = time.perf_counter(), 0
                last_good_step = done
            if options.eval_every and done % options.eval_every == 0 and done != end:
                losses = evaluate_here()
                if is_writer:
                    log.write(json.dumps({"step": done, "eval": losses}) + "\n")
                    log.flush()
            interrupted = stop.signal is not None or (
                options.stop_after is not None and done - start_step >= options.stop_after)
            if done in keep or done % options.checkpoint_every == 0 or done == end or interrupted:
                check_finite(done, logged)
                save(done)
            if interrupted and done != end:
                ckpt.close()
                if progress is not None:
                    progress.close()
                raise Preempted(f"{run.id}: stopped at step {done} after saving; restart to resume")
    if progress is not None:
        progress.close()
    ckpt.wait()
    summary = {"run_id": run.id, "branch": branch, "step": end, "status": "done"}
    # Endpoints are the decay branches; the stable phase is evaluated only when asked (eval_every).
    if branch is not None:
        with jax.set_mesh(mesh):
            losses = evaluate_here()
        summary.update(val_loss=losses["overall"], losses=losses)
        if is_writer:
            with metrics_file.open("a") as log:
                log.write(json.dumps({"step": end, "eval": losses}) + "\n")
            summary["endpoint"] = write_endpoint(run, branch, losses, root=root, rd=rd)
    ckpt.close()
    return summary


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

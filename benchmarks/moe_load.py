"""Routing imbalance over training, for sizing the expert-parallel buffers (docs/moe-buffers.md).

    PYTHONPATH=. python -m benchmarks.moe_load [RUN_ID] [STEPS] [EVERY]
    PYTHONPATH=. python -m benchmarks.moe_load --trained RUN_FOLDER [BRANCH] [GROUP_TOKENS]

Trains one micro run (default micro-xs-s95-smelt) on the embedded corpus with its own optimizer and
learning-rate schedule (the stable phase's, its last rate held past its end), and every EVERY steps reads
each executed layer's top-k expert ids (the model's `capture` forward on the step's batch). For each
sample and layer it computes, with the tokens split into `shards` equal contiguous shards and the
experts into n contiguous device groups (the MoE shard_map's layout):
- expert: the busiest expert's rows over the mean (global batch);
- device: the busiest device's rows over the mean (global batch);
- block: the fullest (token shard -> device) block over T_l * k / n, the balanced block: the slack the
  exchange's first pass needs to hold everything.
Prints a markdown table: per stage of training, the mean and max over samples and layers; then, per
candidate `ModelConfig.expert_buffer_slack`, the exchange's rows per step from the sampled block ratios
(`slack_cost`), to choose the default from (docs/moe-buffers.md).

With --trained it reads a trained run's routing instead (a run folder with checkpoints; BRANCH: a decay
branch's endpoint, default the stable run's newest checkpoint): the routing of the restored model on
consecutive training batches of its own corpus, pooled into groups of GROUP_TOKENS tokens (default
131,072: the G = n * T_l tokens a ring-exchange group of a 100M program gathers, n = 8, T_l = 16,384),
and per group and executed layer the same three ratios. Experts that n does not divide go to devices
in contiguous groups of floor or ceil(E / n) (expert e on device e * n // E).
"""

from __future__ import annotations

import sys

import numpy as np

SHARDS = 8
DEVICE_COUNTS = (4, 8)
SLACKS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
# Rows (in units of the device's R = T_l * k copies) a step with >= 1 overflow pass moves beyond its passes:
# the sorted-order buffer's zero fill and the gather of its rows by the inverse, forward and backward.
OVERFLOW_FIXED = 4.0


def slack_cost(block: float, slack: float) -> tuple[int, float]:
    """(overflow passes, rows moved in units of R) of one layer whose fullest block is `block` x the
    balanced one, with the first pass's blocks `slack` x balanced and overflow passes of a quarter of that
    (moe_buffers.OVERFLOW_SHARE; tile rounding left out): the first pass moves slack x R rows, each
    overflow pass slack / 4 x R, plus OVERFLOW_FIXED x R once when any pass runs."""
    from smelt_jax.model.moe_buffers import OVERFLOW_SHARE

    width = OVERFLOW_SHARE * slack
    passes = int(np.ceil(max(block - slack, 0.0) / width - 1e-9))
    return passes, slack + passes * width + (OVERFLOW_FIXED if passes else 0.0)


def imbalance(ids: np.ndarray, n_experts: int, n_devices: int, shards: int) -> dict[str, float]:
    """ids [T, k] of one layer -> {'expert', 'device', 'block'} max / mean ratios."""
    tokens, top_k = ids.shape
    counts = np.bincount(ids.reshape(-1), minlength=n_experts)
    device_of = np.arange(n_experts) * n_devices // n_experts  # contiguous groups (E / n when n divides E)
    per_device = np.bincount(device_of, weights=counts, minlength=n_devices)
    dest = device_of[ids].reshape(shards, -1)
    blocks = np.stack([np.bincount(d, minlength=n_devices) for d in dest])
    balanced = tokens / shards * top_k / n_devices
    return {"expert": counts.max() / counts.mean(), "device": per_device.max() / per_device.mean(),
            "block": blocks.max() / balanced}


def measure(run_id: str, steps: int, every: int) -> list[tuple[int, int, dict]]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import experiments
    from smelt_jax.data.corpus import open_dataset
    from smelt_jax.data.pipeline import TrainPipeline
    from smelt_jax.train.lr import learning_rate
    from smelt_jax.train.state import init_params
    from smelt_jax.train.step import make_train_step, optimizer

    run = next(r for s in ("micro", "smoke") for r in experiments.load_suite(s) if r.id == run_id)
    cfg, sched = run.model, run.schedule
    pipeline = TrainPipeline.from_schedule(open_dataset(None), sched)
    graphdef, params = init_params(cfg, sched.seed)
    tx = optimizer(sched)
    opt_state = tx.init(params)
    step_fn = jax.jit(make_train_step(graphdef, cfg, tx))

    @jax.jit
    def routed(params, batch):
        model = nnx.merge(graphdef, params)
        _, aux = model(batch["tokens"], batch["segment_ids"], batch["positions"], capture=True)
        return {key: c["topk_ids"] for key, c in aux["captures"].items()}

    last = sched.stable_steps - 1  # the stable phase; its last rate is held past its end
    samples = []
    for step in range(steps + 1):
        batch = {k: jnp.asarray(v) for k, v in pipeline.batch_at(step).items()}
        if step % every == 0:
            for _layer, ids in sorted(routed(params, batch).items()):
                ids = np.asarray(ids).reshape(-1, cfg.top_k)
                for n in DEVICE_COUNTS:
                    samples.append((step, n, imbalance(ids, cfg.n_experts, n, SHARDS)))
        lr = jnp.float32(learning_rate(sched, min(step, last)))
        params, opt_state, _ = step_fn(params, opt_state, batch, lr)
    return samples


def measure_trained(target: str, branch: int | None, group_tokens: int, groups: int = 2) -> tuple[str, list[dict], int]:
    """A trained run's routing: (what was read, per (group, executed layer, n) the imbalance dict with
    'n' added, n_experts). `groups` groups of consecutive batches of the run's own training stream from
    step 0, each pooled to group_tokens tokens."""
    import jax
    import jax.numpy as jnp

    from smelt_jax.analysis.evaluate import load_model, run_corpus
    from smelt_jax.design.config import Schedule
    from smelt_jax.data.pipeline import TrainPipeline

    loaded = load_model(target, branch)
    cfg = loaded.cfg
    pipeline = TrainPipeline.from_schedule(run_corpus(loaded), Schedule.from_dict(loaded.run["schedule"]))

    @jax.jit
    def routed(batch):
        _, aux = loaded.model(batch["tokens"], batch["segment_ids"], batch["positions"], capture=True)
        return {key: c["topk_ids"] for key, c in aux["captures"].items()}

    per_batch = pipeline.batch_at(0)["tokens"].size
    n_batches = -(-group_tokens // per_batch)
    samples, step = [], 0
    for _ in range(groups):
        pooled: dict = {}
        for _ in range(n_batches):
            batch = {k: jnp.asarray(v) for k, v in pipeline.batch_at(step).items()}
            step += 1
            for layer, ids in routed(batch).items():
                pooled.setdefault(layer, []).append(np.asarray(ids).reshape(-1, cfg.top_k))
        for layer in sorted(pooled):
            ids = np.concatenate(pooled[layer])[:group_tokens]
            for n in DEVICE_COUNTS:
                samples.append({"n": n, **imbalance(ids, cfg.n_experts, n, SHARDS)})
    what = (f"{loaded.run.get('id', target)} (E {cfg.n_experts}, top-{cfg.top_k}), "
            f"{'branch ' + str(loaded.branch) if loaded.branch is not None else 'stable'} step {loaded.step}: "
            f"{groups} group(s) of {group_tokens:,} tokens ({n_batches} batches of {per_batch}), "
            f"{len(pooled)} executed layers, {SHARDS} token shards")
    return what, samples, cfg.n_experts


def trained_table(samples: list[dict], n_experts: int) -> str:
    lines = ["| n devices | experts a device | expert max/mean: mean, max | device max/mean: mean, max "
             "| block / balanced: mean, max |", "|---|---|---|---|---|"]
    for n in DEVICE_COUNTS:
        rows = [s for s in samples if s["n"] == n]
        cells = [f"{np.mean([r[k] for r in rows]):.2f}, {np.max([r[k] for r in rows]):.2f}"
                 for k in ("expert", "device", "block")]
        lines.append(f"| {n} | {n_experts / n:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(samples, steps: int) -> str:
    stages = [(0, 0), (1, steps // 3), (steps // 3 + 1, steps)]
    lines = ["| steps | n devices | expert max/mean: mean, max | device max/mean: mean, max "
             "| block / balanced: mean, max |", "|---|---|---|---|---|"]
    for lo, hi in stages:
        for n in DEVICE_COUNTS:
            rows = [s for step, dn, s in samples if lo <= step <= hi and dn == n]
            if not rows:
                continue
            cells = [f"{np.mean([r[k] for r in rows]):.2f}, {np.max([r[k] for r in rows]):.2f}"
                     for k in ("expert", "device", "block")]
            lines.append(f"| {lo}-{hi} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slack_table(blocks_by_n: dict[int, list[float]]) -> str:
    """Per device count and slack, over the sampled block ratios: the share of layers that overflow,
    their mean passes, and mean rows moved per layer (units of R)."""
    lines = ["| n devices | slack | layers overflowing | passes (mean, max) | rows moved / R (mean) |",
             "|---|---|---|---|---|"]
    for n, blocks in blocks_by_n.items():
        for slack in SLACKS:
            costs = [slack_cost(b, slack) for b in blocks]
            passes = [c[0] for c in costs]
            lines.append(f"| {n} | {slack} | {np.mean([p > 0 for p in passes]):.0%} | "
                         f"{np.mean(passes):.2f}, {max(passes)} | {np.mean([c[1] for c in costs]):.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--trained"]:
        branch = int(argv[2]) if len(argv) > 2 else None
        group = int(argv[3]) if len(argv) > 3 else 131072
        what, samples, n_experts = measure_trained(argv[1], branch, group)
        print(what)
        print(trained_table(samples, n_experts))
        for key in ("device", "block"):
            ratios = ", ".join(f"{s[key]:.3f}" for s in samples if s["n"] == 8)
            print(f"\nn = 8, {key} ratio per (group, layer): {ratios}")
        print()
        print(slack_table({n: [s["block"] for s in samples if s["n"] == n] for n in DEVICE_COUNTS}))
        return 0
    run_id = argv[0] if argv else "micro-xs-s95-smelt-27f34426"
    steps = int(argv[1]) if len(argv) > 1 else 300
    every = int(argv[2]) if len(argv) > 2 else 10
    samples = measure(run_id, steps, every)
    print(f"{run_id}: {steps} steps, sampled every {every}, {SHARDS} token shards")
    print(table(samples, steps))
    print()
    print(slack_table({n: [s["block"] for step, dn, s in samples if step > steps // 3 and dn == n]
                       for n in DEVICE_COUNTS}))  # after the first third of training
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""`ladder`: where does SMELT start to win? A pre-registered width ladder on one code version (issue 51;
docs/results-ladder.md, committed before any run).

Every run is of the `nano` grid's kind (experiments/nano.py: the embedded byte corpus, 16 x 256 tokens a
step, 50 warmup steps, branches decaying over 5% of their horizon, the multi-head recipe, nano's rate
rule extended by its own power law) and runs from one pinned worktree of the pre-registration commit:
- **the ladder** (`LADDER_WIDTHS`, in this order): the d96 pair again (both members: the whole pair's
  drift since nano), then d160, then d128, each on nano's full schedule (six branches, 0.5-10M tokens),
  seed 0, SMELT matched to its Baseline by the same matcher and grid as nano;
- **A with seeds** (`SEED_WIDTH`, `SEED_HORIZON`): at d96 and 4M tokens, the unrolled control of SMELT's
  shape (nano2's A) at seed 0, and Baseline, SMELT and control at seeds 1 and 2 (seed 0 of Baseline and
  SMELT is the d96 re-run's 4M branch: the same schedule up to that branch's end);
- **finer routing at the paper's geometry** (`GQA4_WIDTHS`, only if the budget allows after the above):
  nano2's gqa4 recipe (4 heads, one KV head, top-4 of 96 experts) at d128 and d160 with SMELT pinned at
  the width `GQA4_SMELT_WIDTH` gives (0.86x and 0.81x: the nearest widths whose heads meet the KV budget),
  1/2/4M tokens, and nano2's d96 gqa4 pair again at seed 1.
`budgets()` states every member's widths, experts and FLOP / parameter / KV differences.
"""

from __future__ import annotations

from experiments import nano, nano2
from smelt_jax.design.config import ModelConfig, smelt_loop
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.design.matching import match, mismatch

SUITE = "ladder"
LABEL = nano.SPARSITY_LABEL
LADDER_WIDTHS = (96, 160, 128)  # the registered order
SEED_WIDTH, SEED_HORIZON, SEEDS = 96, 4e6, (1, 2)
GQA4_WIDTHS, GQA4_HORIZONS, GQA4_SEED1_WIDTH = (128, 160), (1e6, 2e6, 4e6), 96
# SMELT's width at the paper's ratio: 0.83x is not reachable with one KV head (the KV budget fixes
# SMELT's head size at 2/3 of the Baseline's: 22 at d128, 26 at d160); these are the nearest multiples.
GQA4_SMELT_WIDTH = {96: nano2.GQA_SMELT_WIDTH, 128: 110, 160: 130}


def peak_lr(arch: str, width: int) -> float:
    """nano's rate rule (its power law in width from the `nanolr` sweep's best rates), at any width.
    SMELT-shaped models (looped or unrolled) take SMELT's rate, as in nano2."""
    return nano.rule_rate(nano.LR_BEST, "baseline" if arch == "baseline" else "smelt", width)


def model_for(arch: str, width: int) -> ModelConfig:
    if arch == "baseline":
        return nano.baseline_config(width)
    if arch == "smelt":
        return nano.smelt_config(width)
    return nano2.control_config(width)  # "unrolled": SMELT's shape, every executed layer its own weights


def gqa4_baseline(width: int) -> ModelConfig:
    """nano2's gqa4 Baseline scaled to `width`: 4 heads of d/4, one KV head, top-4 of 96 experts of ~d/3."""
    experts, top_k, _ = nano2.GQA_ROUTING["gqa4"]
    return nano.baseline_config(width).replace(n_heads=4, head_dim=width // 4, n_kv_heads=1, n_experts=experts,
                                               top_k=top_k, expert_ffn=2 * round(width / 3))


def gqa4_smelt(width: int) -> ModelConfig:
    reference = gqa4_baseline(width)
    return match(reference, reference.replace(**smelt_loop(nano.N_LAYERS)), grid=nano.GRID,
                 fixed={"d_model": GQA4_SMELT_WIDTH[width]}, tolerances=nano2.GQA_TOLERANCES["gqa4"]).config


def _spec(scale: str, arch: str, model: ModelConfig, schedule, pair: str, variant: str = "") -> RunSpec:
    return RunSpec(suite=SUITE, scale=scale, sparsity_label=LABEL, arch=arch, model=model, schedule=schedule,
                   control=model.replace(n_experts=model.top_k), pair_id=f"{SUITE}-{pair}", variant=variant,
                   tokenizer="bytes")


def _seed_run(arch: str, seed: int) -> RunSpec:
    scale = nano.scale_name(SEED_WIDTH)
    return _spec(scale, arch, model_for(arch, SEED_WIDTH),
                 nano.schedule(peak_lr(arch, SEED_WIDTH), (SEED_HORIZON,), seed=seed), f"{scale}-seed{seed}",
                 f"seed{seed}")


def build() -> list[RunSpec]:
    """Every run, in the registered order (docs/results-ladder.md)."""
    runs = [_spec(nano.scale_name(width), arch, model_for(arch, width), nano.schedule(peak_lr(arch, width)),
                  nano.scale_name(width)) for width in LADDER_WIDTHS for arch in ("baseline", "smelt")]
    runs.append(_seed_run("unrolled", 0))
    runs += [_seed_run(arch, seed) for seed in SEEDS for arch in ("baseline", "smelt", "unrolled")]
    for width in GQA4_WIDTHS:
        for arch in ("baseline", "smelt"):
            model = gqa4_baseline(width) if arch == "baseline" else gqa4_smelt(width)
            runs.append(_spec(f"d{width}gqa", arch, model, nano.schedule(peak_lr(arch, width), GQA4_HORIZONS),
                              f"d{width}gqa-gqa4", "gqa4"))
    for arch in ("baseline", "smelt"):  # nano2's d96 gqa4 pair at seed 1
        model = nano2.gqa_baseline("gqa4") if arch == "baseline" else nano2.gqa_smelt("gqa4")
        runs.append(_spec(f"d{GQA4_SEED1_WIDTH}gqa", arch, model,
                          nano.schedule(peak_lr(arch, GQA4_SEED1_WIDTH), GQA4_HORIZONS, seed=1),
                          f"d{GQA4_SEED1_WIDTH}gqa-gqa4-seed1", "gqa4.seed1"))
    return runs


def reference_for(run: RunSpec) -> ModelConfig:
    """The Baseline a ladder run is compared with (its pair's Baseline; the d96 Baseline for A's runs)."""
    if "gqa" in run.scale:
        width = int(run.scale[1:].removesuffix("gqa"))
        return nano2.gqa_baseline("gqa4") if width == GQA4_SEED1_WIDTH else gqa4_baseline(width)
    return nano.baseline_config(int(run.scale[1:]))


def budgets() -> list[dict]:
    """Each ladder model's shape and budgets against its Baseline (relative mismatch)."""
    out = []
    for run in build():
        m = run.model
        out.append({"run": run.id, "d_model": m.d_model, "heads": f"{m.n_heads}x{m.head_dim} ({m.n_kv_heads} KV)",
                    "experts": f"top-{m.top_k} of {m.n_experts} x {m.expert_ffn}", "executed": m.executed_layers,
                    "peak_lr": run.schedule.peak_lr,
                    **{k: round(v, 4) for k, v in mismatch(reference_for(run), m).items()}})
    return out


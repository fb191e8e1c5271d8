"""`nano`: a Baseline/SMELT scaling grid built so that the smelt law L(F, D) can be identified on a CPU.

The `micro` suite (experiments/micro.py) keeps the paper's structure, but its runs see 0.006-0.32 tokens
per active parameter, where loss has not yet bent towards a constant, so its law is degenerate (issue 25).
`nano` keeps one sparsity (S ~ 95%) and spends the compute on widths and tokens instead:
- 4 Baseline widths d = 24/40/64/96 (4 layers, 3 heads, 48 experts top-2, experts of width ~4/3 d),
  F per token 0.66M-4.6M (7.0x); each SMELT member loops layers 1-2 twice (6 executed layers) and is
  matched to its Baseline's FLOPs, parameters and KV cache by the same matcher as every suite;
- one warmup-stable-decay run of 9.5M tokens per model (50 warmup steps of 16 x 256 tokens) with six
  decay branches at horizons 0.5/1/2/4/7/10M tokens, each decaying over 5% of its horizon, so tokens
  per active parameter D / (F / 6) span 0.65-91;
- the peak learning rate by a rule fixed before the main runs from the `nanolr` sweep (`PEAK_LR`,
  docs/nano.md), and a second seed of the d40 pair for the noise.
docs/nano.md holds the arithmetic (F, tokens per parameter, cost per run); docs/results-nano.md the
pre-registered test and its outcome.
"""

from __future__ import annotations

import math

from smelt_jax.design.config import ModelConfig, Schedule, smelt_loop
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.design.matching import SearchGrid, match

SUITE, LR_SUITE = "nano", "nanolr"
VOCAB, SEQ_LEN, TOP_K = 512, 256, 2  # the embedded byte corpus, as micro
N_LAYERS, N_HEADS = 4, 3
SPARSITY_LABEL, EXPERTS, CONTROL_EXPERTS = "s95", 48, 2  # S ~ 94-95% at top-2; 2 of 2 is the S~0 control
# width -> head size: 3 heads of d/3 rounded to an even size (RoPE), the widths spaced ~1.6x apart.
WIDTHS = {24: 8, 40: 14, 64: 22, 96: 32}
BATCH_SIZE, WARMUP_STEPS = 16, 50
HORIZONS = (0.5e6, 1e6, 2e6, 4e6, 7e6, 10e6)  # training tokens at each branch's end
DECAY_FRACTION = 0.05
# Steps of 2 at every axis: these widths are too small for micro's steps of 4 to meet all three budgets.
GRID = SearchGrid(d_model_step=2, d_model_range=(0.5, 2.0), head_dim_step=2, head_dim_range=(4, 64),
                  kv_heads=(1, 2, 3, 4), experts_step=2, ffn_step=2)
SEED_PAIR, SECOND_SEED = 40, 1  # the pair trained twice (its second seed is variant "seed1")

# The learning-rate sweep (`nanolr`): these peak rates at the smallest and the largest width of each
# architecture, each a 1M-token run (the stable run up to the 1M-token branch's fork, then that branch).
LR_GRID = (3e-3, 6e-3, 1.2e-2)
LR_WIDTHS = (24, 96)
LR_HORIZON = 1e6
# The rule's edge step (docs/nano.md): where the best of LR_GRID lay at an edge, one rate a factor 2 beyond
# it. From the first 11 endpoints of the sweep (docs/results-nano.md): d24 best at 1.2e-2 for both
# architectures, d96 best at 3e-3 for both.
LR_EXTENSION = {("baseline", 24): 2.4e-2, ("smelt", 24): 2.4e-2, ("baseline", 96): 1.5e-3,
                ("smelt", 96): 1.5e-3}
# The best rate per (arch, width) of the finished `nanolr` sweep (fits/nano/lr_sweep.csv, 16 endpoints,
# one seed; docs/results-nano.md). The d96 Baseline is best at the extension 1.5e-3, the lowest rate run:
# the rule takes it (one edge step, then the choice is final).
LR_BEST = {("baseline", 24): 6e-3, ("baseline", 96): 1.5e-3, ("smelt", 24): 1.2e-2, ("smelt", 96): 3e-3}
# Peak rate per (arch, width): lr_rule(LR_BEST), written out (tests/test_nano.py recomputes both from the csv).
PEAK_LR: dict[tuple[str, int], float] | None = {
    ("baseline", 24): 6e-3, ("baseline", 40): 3.6e-3, ("baseline", 64): 2.3e-3, ("baseline", 96): 1.5e-3,
    ("smelt", 24): 1.2e-2, ("smelt", 40): 7.2e-3, ("smelt", 64): 4.5e-3, ("smelt", 96): 3e-3}


def scale_name(width: int) -> str:
    return f"d{width}"


def head_size(width: int) -> int:
    """Head size of a width: 3 heads of d/3 rounded to an even size (RoPE); WIDTHS lists nano's own."""
    return 2 * round(width / (2 * N_HEADS))


def baseline_config(width: int, n_experts: int = EXPERTS) -> ModelConfig:
    return ModelConfig(vocab=VOCAB, d_model=width, n_layers=N_LAYERS, n_heads=N_HEADS,
                       n_kv_heads=N_HEADS, head_dim=head_size(width), n_experts=n_experts, top_k=TOP_K,
                       expert_ffn=2 * round(2 * width / 3), seq_len=SEQ_LEN)


def smelt_config(width: int) -> ModelConfig:
    reference = baseline_config(width)
    return match(reference, reference.replace(**smelt_loop(N_LAYERS)), grid=GRID).config


def control(model: ModelConfig) -> ModelConfig:
    """The S~0 member S is measured against: the same model with 2 of 2 experts active. (micro matches
    a looped control to the Baseline's; at these widths no looped layout meets the 2-expert budgets.)"""
    return model.replace(n_experts=CONTROL_EXPERTS)


def fork_steps(horizons=HORIZONS) -> tuple[int, ...]:
    """Fork step of each horizon H: the branch decays over DECAY_FRACTION of H, so it forks at
    round((1 - f) H / tokens per step)."""
    return tuple(round((1 - DECAY_FRACTION) * h / (BATCH_SIZE * SEQ_LEN)) for h in horizons)


def schedule(peak_lr: float, horizons=HORIZONS, seed: int = 0) -> Schedule:
    forks = fork_steps(horizons)
    return Schedule(batch_size=BATCH_SIZE, seq_len=SEQ_LEN, stable_steps=forks[-1], fork_steps=forks,
                    decay_steps=0, decay_fraction=DECAY_FRACTION, warmup_steps=WARMUP_STEPS,
                    peak_lr=peak_lr, seed=seed)


def _run(suite: str, width: int, arch: str, sched: Schedule, variant: str = "") -> RunSpec:
    model = baseline_config(width) if arch == "baseline" else smelt_config(width)
    return RunSpec(suite=suite, scale=scale_name(width), sparsity_label=SPARSITY_LABEL, arch=arch,
                   model=model, schedule=sched, control=control(model),
                   pair_id=f"{suite}-{scale_name(width)}-{SPARSITY_LABEL}" + (f"-{variant}" if variant else ""),
                   variant=variant, tokenizer="bytes")


def lr_variant(peak_lr: float) -> str:
    return f"lr{peak_lr:g}"


def build_lr_sweep() -> list[RunSpec]:
    points = [(arch, width, lr) for arch in ("baseline", "smelt") for width in LR_WIDTHS for lr in LR_GRID]
    points += [(arch, width, lr) for (arch, width), lr in LR_EXTENSION.items()]
    return [_run(LR_SUITE, width, arch, schedule(lr, (LR_HORIZON,)), lr_variant(lr)) for arch, width, lr in points]


def lr_rule(best: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """The pre-registered rule (docs/nano.md): per architecture, the best peak rate at the smallest and
    the largest width of the sweep, and a power law in the width between them,
    lr(d) = lr(d_lo) * (d / d_lo) ** (log(lr(d_hi) / lr(d_lo)) / log(d_hi / d_lo)), rounded to 2
    significant figures."""
    return {(arch, width): rule_rate(best, arch, width) for arch in ("baseline", "smelt") for width in WIDTHS}


def rule_rate(best: dict[tuple[str, int], float], arch: str, width: int) -> float:
    """`lr_rule` at one width (also outside nano's widths: the `ladder` suite extends the power law)."""
    low, high = LR_WIDTHS
    slope = math.log(best[arch, high] / best[arch, low]) / math.log(high / low)
    return float(f"{best[arch, low] * (width / low) ** slope:.2g}")


def build() -> list[RunSpec]:
    if PEAK_LR is None:
        return []
    runs = [_run(SUITE, width, arch, schedule(PEAK_LR[arch, width]))
            for width in WIDTHS for arch in ("baseline", "smelt")]
    runs += [_run(SUITE, SEED_PAIR, arch, schedule(PEAK_LR[arch, SEED_PAIR], seed=SECOND_SEED),
                  f"seed{SECOND_SEED}") for arch in ("baseline", "smelt")]
    return runs

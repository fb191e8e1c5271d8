"""The paper's grid: 4 scales x 4 sparsities x {baseline, smelt} = 32 runs, 16 matched pairs.

Baseline geometry is reconstructed from Appendix A (docs/budget.md derives it); each SMELT model
takes the paper's hidden size and expert count (its design choices) and the matcher solves the
rest (head size, head count, KV heads, expert width) against its Baseline's three budgets.
"""

from __future__ import annotations

from experiments.placement import smelt16_layouts
from smelt_jax.design import paper
from smelt_jax.design.config import ModelConfig, Schedule, smelt_loop
from smelt_jax.design.descriptors import Parallelism, RunSpec
from smelt_jax.design.matching import SearchGrid, match
from smelt_jax.parallel.layout import layout_key

SUITE = "smelt16"
VOCAB = 65_536  # not published; a 64k BPE vocabulary (embeddings are outside every budget)
# The paper publishes neither its tokenizer nor its data. Runs train on a token store prepared with a
# Hugging Face tokenizer.json of exactly VOCAB ids (a byte-level BPE: `smelt data tokenizer train
# --vocab-size 65536`); `RunSpec.check_data` refuses any other data, the embedded byte corpus included.
TOKENIZER = "hf"
SEQ_LEN = 4096
# The suite's runs compute in bf16 (float32 parameters, optimizer state, router, softmax and norm
# statistics); applied in `build` (and by ablations200m, whose reference is this suite's 200M S85
# Baseline), not in `baseline_config`, whose configs the matcher compares.
COMPUTE_DTYPE = "bfloat16"

# scale -> (d_model, n_layers, n_heads, head_dim, n_kv_heads, expert_ffn): docs/budget.md.
BASELINE_GEOMETRY = {
    "100m": (672, 10, 6, 112, 2, 544),
    "200m": (1280, 12, 10, 128, 2, 432),
    "600m": (1792, 20, 14, 128, 2, 600),
    "1.6b": (2304, 30, 18, 128, 2, 768),
}
# Not published. Peak learning rates fall with width as in public MoE/dense recipes (docs/training.md).
PEAK_LR = {"100m": 1.0e-3, "200m": 8.0e-4, "600m": 6.0e-4, "1.6b": 4.0e-4}

STABLE_STEPS = 196_075
FORK_STEPS = (10_000, 20_000, 50_000, 100_000, 150_000, 196_075)
DECAY_TOKENS = 10e9
BATCH_SIZE = 256


def schedule(scale: str) -> Schedule:
    return Schedule(batch_size=BATCH_SIZE, seq_len=SEQ_LEN, stable_steps=STABLE_STEPS,
                    fork_steps=FORK_STEPS,
                    decay_steps=Schedule.decay_steps_for_tokens(DECAY_TOKENS, BATCH_SIZE, SEQ_LEN),
                    warmup_steps=2000, peak_lr=PEAK_LR[scale])


def baseline_config(scale: str, n_experts: int) -> ModelConfig:
    d_model, n_layers, n_heads, head_dim, n_kv_heads, expert_ffn = BASELINE_GEOMETRY[scale]
    return ModelConfig(vocab=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, n_experts=n_experts, top_k=8,
                       expert_ffn=expert_ffn, seq_len=SEQ_LEN)


def smelt_config(scale: str, sparsity_label: str) -> ModelConfig:
    """The matched SMELT model. Sparse cells pin the paper's d_model and expert count; at S~0 the
    paper's rows admit no geometry that meets its own totals (docs/budget.md), so only the expert
    count (16) is pinned and the hidden size is searched."""
    i = paper.SPARSITY_LABELS.index(sparsity_label)
    reference = baseline_config(scale, paper.APPENDIX_A_BASELINE[scale]["experts"][i])
    row = paper.APPENDIX_A_SMELT[scale]
    target = reference.replace(**smelt_loop(reference.n_layers))
    if sparsity_label == "s0":
        return match(reference, target, fixed={"n_experts": row["experts"][i]}).config
    # Hidden size and expert count pinned: solve heads and expert width on the budgets alone.
    return match(reference, target, fixed={"n_experts": row["experts"][i], "d_model": row["d_model"][i]},
                 grid=SearchGrid(shape_scale=None)).config


def build() -> list[RunSpec]:
    # Layouts chosen by ahead-of-time compilation for TPU slices (`make compile-report` writes
    # experiments/layouts.json; docs/parallelism.md); configurations not compiled yet keep the default
    # (and get no TPU placement: experiments/placement.py).
    layouts = smelt16_layouts()
    runs = []
    for scale in paper.SCALES:
        controls = {"baseline": baseline_config(scale, 8), "smelt": smelt_config(scale, "s0")}
        for i, label in enumerate(paper.SPARSITY_LABELS):
            models = {"baseline": baseline_config(scale, paper.APPENDIX_A_BASELINE[scale]["experts"][i]),
                      "smelt": smelt_config(scale, label)}
            for arch in ("baseline", "smelt"):
                runs.append(RunSpec(suite=SUITE, scale=scale, sparsity_label=label, arch=arch,
                                    model=models[arch].replace(compute_dtype=COMPUTE_DTYPE),
                                    schedule=schedule(scale),
                                    control=controls[arch].replace(compute_dtype=COMPUTE_DTYPE),
                                    pair_id=f"{SUITE}-{scale}-{label}", tokenizer=TOKENIZER,
                                    parallelism=layouts.get(layout_key(scale, label, arch),
                                                            Parallelism())))
    return runs

"""The paper's ablations at 200M, S~85% (docs/paper.md §6), every looped or re-shaped model re-matched to the
200M S~85% Baseline's FLOPs, parameters and KV cache.

- `span`: loop span m = 0, 2, ..., 12 of L = 12 layers (0-100%), centred, r = 2.
- `depth`: Baselines of L = 9, 12, 15, 18 and looped models of L = 8, 10, 12, 14 physical layers
  (middle half, r = 2; effective 12, 15, 18, 21), all matched to the L = 12 Baseline's budgets
  (our reading of "re-matched at each depth": every point of the sweep costs the same).
- `loops`: the middle half looped r = 1, 2, 3, 4 times.
"""

from __future__ import annotations

from experiments import smelt16
from smelt_jax.design.config import ModelConfig, middle_loop, smelt_loop
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.design.matching import match

SUITE = "ablations200m"
SCALE, LABEL, EXPERTS = "200m", "s85", 64


def _run(variant: str, model: ModelConfig, reference: ModelConfig, control: ModelConfig,
         sweep: str) -> RunSpec:
    arch = "looped" if model.is_looped else "baseline"
    dtype = smelt16.COMPUTE_DTYPE  # as smelt16 computes: its 200M S85 Baseline is this suite's reference
    return RunSpec(suite=SUITE, scale=SCALE, sparsity_label=LABEL, arch=arch,
                   model=model.replace(compute_dtype=dtype), schedule=smelt16.schedule(SCALE),
                   control=control.replace(compute_dtype=dtype),
                   pair_id=f"{SUITE}-{sweep}", variant=variant, tokenizer=smelt16.TOKENIZER)


def _matched(reference: ModelConfig, **shape) -> ModelConfig:
    target = reference.replace(**shape)
    if target == reference:
        return reference
    return match(reference, target).config


def build() -> list[RunSpec]:
    reference = smelt16.baseline_config(SCALE, EXPERTS)
    control = smelt16.baseline_config(SCALE, 8)
    runs = []
    for loop_length in range(0, 13, 2):
        shape = {"loop_start": middle_loop(12, loop_length), "loop_length": loop_length,
                 "loop_repeats": 2 if loop_length else 1}
        runs.append(_run(f"span{loop_length}", _matched(reference, **shape), reference, control,
                         "span"))
    for n_layers in (9, 12, 15, 18):
        runs.append(_run(f"l{n_layers}", _matched(reference, n_layers=n_layers), reference,
                         control, "depth"))
    for n_layers in (8, 10, 12, 14):
        model = _matched(reference, n_layers=n_layers, **smelt_loop(n_layers))
        runs.append(_run(f"l{n_layers}", model, reference, control, "depth"))
    for loop_repeats in (1, 2, 3, 4):
        shape = smelt_loop(12, loop_repeats) if loop_repeats > 1 else {}
        runs.append(_run(f"r{loop_repeats}", _matched(reference, **shape), reference, control,
                         "loops"))
    return runs

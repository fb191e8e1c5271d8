"""`ablationsmicro`: the paper's three ablations (docs/paper.md §6) shrunk as `micro` shrinks its grid.

The paper ablates at its second scale, S~85%, L = 12; here the micro `s` scale, S~85% (16 experts
top-2), L = 6, so every fraction of the depth the paper uses is a whole number of layers:
- `span`: loop span m = 0..6 of L = 6 layers (0, 17, 33, 50, 67, 83, 100%, the paper's fractions),
  centred, r = 2.
- `depth`: Baselines of L = 5, 6, 8, 9 (the paper's 0.75/1/1.25/1.5 x L, rounded half up) and looped
  models of L = 4, 5, 6, 7 physical layers (the paper's 2/3, 5/6, 1, 7/6 x L; middle half, r = 2;
  effective 6, 7, 9, 10).
- `loops`: the middle half (3 layers) looped r = 1, 2, 3, 4 times.
Every model is re-matched to the `s` S~85% Baseline's FLOPs, parameters and KV cache with micro's
search grid, and trains micro's stable run (100 steps) with one decay branch at its end (the paper's
ablations are single runs).

Two points of the grid are models the `micro` suite already trains with exactly this stable run and
this final branch (`micro-s-s85-baseline`, branch 5: span 0 = L 6 Baseline = r 1; and
`micro-s-s85-smelt`, branch 5: span 3 = looped L 6 = r 2), so they are not trained twice:
`points()` names them by their micro run and the ablation table reads them from micro's results.
"""

from __future__ import annotations

import dataclasses

from experiments import micro
from smelt_jax.design.config import ModelConfig, Schedule, middle_loop, smelt_loop
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.design.matching import Tolerances, match

SUITE = "ablationsmicro"
SCALE, LABEL, EXPERTS = "s", "s85", micro.BASELINE_EXPERTS[1]
N_LAYERS = micro.SCALES[SCALE][1]
SPANS = tuple(range(0, N_LAYERS + 1))
BASELINE_DEPTHS = (5, 6, 8, 9)
LOOPED_DEPTHS = (4, 5, 6, 7)
LOOP_COUNTS = (1, 2, 3, 4)
# micro's grid with steps of 2: a loop of 7 or 15 executed layers needs a KV width (KV heads x head size)
# near 576 / (2 x executed layers), which steps of 4 cannot reach at these widths. The KV tolerance is
# 4.5%: r = 4 (15 executed layers) meets FLOPs and parameters only at a KV width of 20 against 19.2.
GRID = dataclasses.replace(micro.GRID, d_model_step=2, head_dim_step=2, ffn_step=2)
TOLERANCES = Tolerances(kv=0.045)
SCHEDULE = dict(micro.MICRO_SCHEDULE, fork_steps=(micro.MICRO_SCHEDULE["stable_steps"],))


def schedule() -> Schedule:
    return Schedule(peak_lr=micro.PEAK_LR[SCALE], **SCHEDULE)


def _shapes() -> list[tuple[str, str, dict]]:
    """(sweep, variant, shape overrides of the reference Baseline) for every point of the grid."""
    points = []
    for m in SPANS:
        loop = {"loop_start": middle_loop(N_LAYERS, m), "loop_length": m, "loop_repeats": 2}
        points.append(("span", f"span{m}", loop if m else {}))
    for n_layers in BASELINE_DEPTHS:
        points.append(("depth", f"l{n_layers}", {"n_layers": n_layers}))
    for n_layers in LOOPED_DEPTHS:
        points.append(("depth", f"l{n_layers}", {"n_layers": n_layers, **smelt_loop(n_layers)}))
    for r in LOOP_COUNTS:
        points.append(("loops", f"r{r}", smelt_loop(N_LAYERS, r) if r > 1 else {}))
    return points


def _model(reference: ModelConfig, shape: dict) -> ModelConfig:
    target = reference.replace(**shape)
    if target == reference:
        return reference
    if target == reference.replace(**smelt_loop(N_LAYERS)):
        return micro.smelt_config(SCALE, LABEL)
    return match(reference, target, grid=GRID, tolerances=TOLERANCES).config


def points() -> list[dict]:
    """Every ablation point: sweep, variant, arch, the model, and where its result comes from
    (`run`: this suite's run id, or the micro run whose final branch it is, with `branch`)."""
    from experiments import load_suite  # cached: neither suite is matched again

    reference = micro.baseline_config(SCALE, EXPERTS)
    shared = {run.model: run for run in load_suite("micro")
              if run.scale == SCALE and run.sparsity_label == LABEL}  # its s-s85 Baseline and SMELT
    runs = {run.model: run for run in load_suite(SUITE)}
    out = []
    for sweep, variant, shape in _shapes():
        model = _model(reference, shape)
        arch = "looped" if model.is_looped else "baseline"
        if model in shared:
            run, branch = shared[model], len(micro.MICRO_SCHEDULE["fork_steps"]) - 1
        else:
            run, branch = runs[model], 0
        out.append({"sweep": sweep, "variant": variant, "arch": arch, "model": model,
                    "run": run.id, "branch": branch})
    return out


def build() -> list[RunSpec]:
    reference = micro.baseline_config(SCALE, EXPERTS)
    control = micro.baseline_config(SCALE, micro.BASELINE_EXPERTS[0])
    shared = {reference, micro.smelt_config(SCALE, LABEL)}
    runs, seen = [], set()
    for sweep, variant, shape in _shapes():
        model = _model(reference, shape)
        if model in shared or model in seen:
            continue
        seen.add(model)
        arch = "looped" if model.is_looped else "baseline"
        runs.append(RunSpec(suite=SUITE, scale=SCALE, sparsity_label=LABEL, arch=arch, model=model,
                            schedule=schedule(), control=control, pair_id=f"{SUITE}-{sweep}",
                            variant=variant))
    return runs


def paper_point(sweep: str, variant: str, arch: str) -> tuple[str, int]:
    """The point of the paper's grid (a key of `smelt_jax.design.paper.ABLATION_LOSS`) a micro point stands for:
    span m of 6 -> 2m of 12; depths by position (Baselines 5/6/8/9 -> 9/12/15/18, looped 4/5/6/7 ->
    8/10/12/14); loop counts as they are."""
    if sweep == "span":
        return "span", 2 * int(variant[len("span"):])
    if sweep == "loops":
        return "loops", int(variant[1:])
    depth = int(variant[1:])
    if arch == "baseline":
        return "depth_baseline", (9, 12, 15, 18)[BASELINE_DEPTHS.index(depth)]
    return "depth_looped", (8, 10, 12, 14)[LOOPED_DEPTHS.index(depth)]


def export_ablations(out_path, root=None) -> int:
    """`fits/micro/ablations.csv`: one row per ablation point with its validation loss, read from this
    suite's and micro's results stores under `root` (scaling.endpoints.ABLATION_COLUMNS)."""
    import pandas as pd

    from smelt_jax.platform.errors import MissingInput
    from smelt_jax.run_files.results import read_results
    from smelt_jax.run_files.rundir import results_dir

    stores = {suite: read_results(results_dir(suite, root)) for suite in (SUITE, "micro")}
    rows = []
    for point in points():
        table = stores[point["run"].split("-", 1)[0]]
        hit = table[(table["run_id"] == point["run"]) & (table["branch"] == point["branch"])]
        if hit.empty:
            raise MissingInput(f"no endpoint row for {point['run']} branch {point['branch']} "
                               f"({point['sweep']} {point['variant']}): train it first")
        paper_sweep, paper_value = paper_point(point["sweep"], point["variant"], point["arch"])
        rows.append({"sweep": point["sweep"], "variant": point["variant"], "arch": point["arch"],
                     "paper_sweep": paper_sweep, "paper_point": paper_value, "run_id": point["run"],
                     "branch": point["branch"], "val_loss": float(hit["val_loss"].iloc[0])})
    pd.DataFrame(rows).to_csv(out_path, index=False, float_format="%.8g")
    return len(rows)

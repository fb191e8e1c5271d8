"""`smelt experiments list|show`, `smelt budget ID`, `smelt match ID`."""

from __future__ import annotations

import json

from smelt_jax import budget as budget_lib
from smelt_jax import paper
from smelt_jax.descriptors import RunSpec
from smelt_jax.matching import mismatch


def _suites():
    import experiments  # the descriptors live at the top of the repository
    return experiments


def _fmt(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


def cmd_list(args) -> int:
    ex = _suites()
    names = [args.suite] if args.suite else list(ex.SUITE_NAMES)
    runs = [run for name in names for run in ex.load_suite(name)]
    if args.json:
        print(json.dumps([run.to_dict() for run in runs], indent=1))
        return 0
    print(f"{'id':<52} {'d':>5} {'L':>3} {'loop':>7} {'E':>4} {'F/token':>9} {'N total':>9} "
          f"{'KV/token':>8} {'S':>6}")
    for run in runs:
        m, b = run.model, run.budget()
        loop = f"{m.loop_start}+{m.loop_length}x{m.loop_repeats}" if m.is_looped else "-"
        print(f"{run.id:<52} {m.d_model:>5} {m.n_layers:>3} {loop:>7} {m.n_experts:>4} "
              f"{b.train_flops_per_token:>9.3g} {b.params_total:>9.3g} {b.kv_per_token:>8} "
              f"{b.sparsity:>6.1%}")
    print(f"{len(runs)} runs, {len({r.pair_id for r in runs})} pairs")
    return 0


def cmd_show(args) -> int:
    print(json.dumps(_suites().find_run(args.id).to_dict(), indent=2))
    return 0


def _budget_rows(run: RunSpec) -> dict[str, float]:
    b = run.budget()
    return {"train FLOPs/token": b.train_flops_per_token,
            "forward FLOPs/token": b.forward_flops_per_token, "params total": b.params_total,
            "params active": b.params_active, "params executed": b.params_executed,
            "params embedding": b.params_embedding, "KV entries/token": b.kv_per_token,
            "sparsity S": b.sparsity}


def cmd_budget(args) -> int:
    run = _suites().find_run(args.id)
    print(f"{run.id}  (attention at {budget_lib.ATTENDED_KEYS:.0f} keys/query; docs/budget.md)")
    for name, value in _budget_rows(run).items():
        print(f"  {name:<22} {_fmt(value)}")
    return 0


def cmd_match(args) -> int:
    ex = _suites()
    run = ex.find_run(args.id)
    pair = [r for r in ex.load_suite(run.suite) if r.pair_id == run.pair_id]
    base = next((r for r in pair if r.arch == "baseline"), None)
    if base is None:
        raise ValueError(f"{run.pair_id} has no baseline to match against")
    others = [r for r in pair if r is not base]
    print(f"pair {run.pair_id}")
    header = f"  {'budget':<22} {'baseline':>12}"
    for other in others:
        header += f" {other.arch + (':' + other.variant if other.variant else ''):>14} {'ratio':>7}"
    print(header)
    rows = {r.id: _budget_rows(r) for r in pair}
    for name, value in rows[base.id].items():
        line = f"  {name:<22} {_fmt(value):>12}"
        for other in others:
            theirs = rows[other.id][name]
            ratio = f"{theirs / value:.3f}" if name != "sparsity S" and value else "-"
            line += f" {_fmt(theirs):>14} {ratio:>7}"
        print(line)
    for other in others:
        mm = mismatch(base.model, other.model)
        print(f"  {other.id}: mismatch FLOPs {mm['flops']:+.2%}, params {mm['params']:+.2%}, "
              f"KV {mm['kv']:+.2%}")
    if run.suite == "smelt16":
        _print_paper(base, [o for o in others if o.arch == "smelt"])
    return 0


def _print_paper(base: RunSpec, smelts: list[RunSpec]) -> None:
    print("  paper (Appendix A):")
    ref = paper.appendix_a(base.scale, base.sparsity_label, "baseline")
    print(f"    baseline: active {ref['active']}B, total {ref['total']}B, S {ref['sparsity']}% | "
          f"ours: active {base.budget().params_active / 1e9:.3f}B, total "
          f"{base.budget().params_total / 1e9:.2f}B, S {base.budget().sparsity:.1%}")
    for smelt in smelts:
        ref = paper.appendix_a(smelt.scale, smelt.sparsity_label, "smelt")
        b, b0 = smelt.budget(), base.budget()
        print(f"    smelt: active {ref['active']}B, total {ref['total']}B, S {ref['sparsity']}%, "
              f"F ratio {ref['flops_ratio']}, KV ratio {ref['kv_ratio']} | ours: active "
              f"{b.params_active / 1e9:.3f}B, total {b.params_total / 1e9:.2f}B, "
              f"S {b.sparsity:.1%}, F ratio {b.train_flops_per_token / b0.train_flops_per_token:.3f},"
              f" KV ratio {b.kv_per_token / b0.kv_per_token:.3f}")
    if base.scale == "200m" and base.sparsity_label == "s95":
        print(f"    worked example F: baseline {paper.WORKED_EXAMPLE_FLOPS['baseline']:.3g}, smelt "
              f"{paper.WORKED_EXAMPLE_FLOPS['smelt']:.3g}")


def register(subparsers) -> None:
    ex = subparsers.add_parser("experiments", help="list and show experiment descriptors")
    ex_sub = ex.add_subparsers(dest="experiments_command", metavar="ACTION")
    p = ex_sub.add_parser("list", help="runs of one suite or all, as a table or JSON")
    p.add_argument("--suite", help="smelt16, ablations200m, micro, ablationsmicro or smoke (default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per model configuration")
    p.set_defaults(handler=cmd_list)
    p = ex_sub.add_parser("show", help="one run's full descriptor as JSON")
    p.add_argument("id", help="run id or a unique prefix of one")
    p.set_defaults(handler=cmd_show)
    ex.set_defaults(handler=lambda args: ex.print_help() or 2)

    p = subparsers.add_parser("budget", help="FLOPs, parameters, KV cache and sparsity of a run")
    p.add_argument("id", help="run id or a unique prefix of one")
    p.set_defaults(handler=cmd_budget)
    p = subparsers.add_parser("match", help="a matched pair's budgets side by side, with ratios")
    p.add_argument("id", help="the id of either run of the pair")
    p.set_defaults(handler=cmd_match)

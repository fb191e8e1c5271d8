"""`smelt experiments list|show`, `smelt budget ID`, `smelt match ID`."""

from __future__ import annotations

import json

from smelt_jax.design import suites
from smelt_jax.design import budget as budget_lib
from smelt_jax.design import paper
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.design.pairs import budget_rows, compare_pair
from smelt_jax.platform.exit_codes import SKIPPED


def _suites():
    import experiments  # the descriptors live at the top of the repository
    return experiments


def _fmt(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


def cmd_list(args) -> int:
    import sys

    from smelt_jax.run_files.run_lookup import saved_runs
    ex = _suites()
    names = [args.suite] if args.suite else list(ex.SUITE_NAMES)
    runs = [run for name in names if name in ex.SUITE_NAMES or not args.runs_dir
            for run in ex.load_suite(name)]
    saved = []
    if args.runs_dir:
        saved, problems = saved_runs(args.runs_dir)
        saved = [run for run in saved if not args.suite or run.suite == args.suite]
        for problem in problems:
            print(f"smelt: {problem}", file=sys.stderr)
    runs += saved
    done = SKIPPED if args.runs_dir and problems else 0  # the runs listed; the bad run.json files named
    if args.json:
        print(json.dumps([run.to_dict() for run in runs], indent=1))
        return done
    print(f"{'id':<52} {'d':>5} {'L':>3} {'loop':>7} {'E':>4} {'F/token':>9} {'N total':>9} "
          f"{'KV/token':>8} {'S':>6}")
    for run in runs:
        m, b = run.model, run.budget()
        loop = f"{m.loop_start}+{m.loop_length}x{m.loop_repeats}" if m.is_looped else "-"
        print(f"{run.id:<52} {m.d_model:>5} {m.n_layers:>3} {loop:>7} {m.n_experts:>4} "
              f"{b.train_flops_per_token:>9.3g} {b.params_total:>9.3g} {b.kv_per_token:>8} "
              f"{b.sparsity:>6.1%}")
    print(f"{len(runs)} runs, {len({r.pair_id for r in runs})} pairs")
    if args.runs_dir:
        print(f"{len(saved)} saved run{'s' if len(saved) != 1 else ''} under {args.runs_dir} (defined by "
              "a config file or --override; their specs are RUNS/SUITE/ID/run.json)")
    return done


def cmd_show(args) -> int:
    from smelt_jax.run_files.run_lookup import find_run
    print(json.dumps(find_run(args.id, args.runs_dir).to_dict(), indent=2))
    return 0


def cmd_budget(args) -> int:
    from smelt_jax.run_files.run_lookup import find_run
    run = find_run(args.id, args.runs_dir)
    print(f"{run.id}  (attention at {budget_lib.ATTENDED_KEYS:.0f} keys/query; docs/budget.md)")
    for name, value in budget_rows(run).items():
        print(f"  {name:<22} {_fmt(value)}")
    return 0


def _label(run: RunSpec) -> str:
    return run.arch + (":" + run.variant if run.variant else "")


def cmd_match(args) -> int:
    ex = _suites()
    run = ex.find_run(args.id)
    pair = compare_pair(run, ex.load_suite(run.suite))
    base = pair.baseline
    print(f"pair {pair.pair_id}")
    print(f"  {'budget':<22} {'baseline':>12}"
          + "".join(f" {_label(other):>14} {'ratio':>7}" for other in pair.others))
    for name, value in pair.budgets[base.id].items():
        line = f"  {name:<22} {_fmt(value):>12}"
        for other in pair.others:
            ratio = pair.ratio(other, name)
            line += f" {_fmt(pair.budgets[other.id][name]):>14} {'-' if ratio is None else f'{ratio:.3f}':>7}"
        print(line)
    for other in pair.others:
        mm = pair.mismatches[other.id]
        print(f"  {other.id}: mismatch FLOPs {mm['flops']:+.2%}, params {mm['params']:+.2%}, "
              f"KV {mm['kv']:+.2%}")
    if pair.paper:
        _print_paper(pair.paper, base)
    return 0


def _print_paper(rows, base: RunSpec) -> None:
    print("  paper (Appendix A):")
    for row in rows:
        line = (f"    {row['arch']}: active {row['paper_active']}B, total {row['paper_total']}B, "
                f"S {row['paper_sparsity']}%")
        ours = (f"active {row['active']:.3f}B, total {row['total']:.2f}B, S {row['sparsity'] / 100:.1%}")
        if row["arch"] == "smelt":
            line += f", F ratio {row['paper_flops_ratio']}, KV ratio {row['paper_kv_ratio']}"
            ours += f", F ratio {row['flops_ratio']:.3f}, KV ratio {row['kv_ratio']:.3f}"
        print(f"{line} | ours: {ours}")
    if base.scale == "200m" and base.sparsity_label == "s95":
        print(f"    worked example F: baseline {paper.WORKED_EXAMPLE_FLOPS['baseline']:.3g}, smelt "
              f"{paper.WORKED_EXAMPLE_FLOPS['smelt']:.3g}")


def register(subparsers) -> None:
    ex = subparsers.add_parser("experiments", help="list and show experiment descriptors")
    ex_sub = ex.add_subparsers(dest="experiments_command", metavar="ACTION")
    p = ex_sub.add_parser("list", help="runs of one suite or all, as a table or JSON")
    p.add_argument("--suite", help=suites.described("suite") + "; default: all")
    p.add_argument("--json", action="store_true", help="one JSON object per model configuration")
    p.add_argument("--runs-dir", help="also list the runs saved under this runs root that no suite "
                                      "defines (config files, overrides)")
    p.set_defaults(handler=cmd_list)
    p = ex_sub.add_parser("show", help="one run's full descriptor as JSON")
    p.add_argument("id", help="run id or a unique prefix of one")
    p.add_argument("--runs-dir", help="runs root of saved runs (default $SMELT_RUNS_DIR or ./runs)")
    p.set_defaults(handler=cmd_show)
    ex.set_defaults(handler=lambda args: ex.print_help() or 2)

    p = subparsers.add_parser("budget", help="FLOPs, parameters, KV cache and sparsity of a run")
    p.add_argument("id", help="run id or a unique prefix of one")
    p.add_argument("--runs-dir", help="runs root of saved runs (default $SMELT_RUNS_DIR or ./runs)")
    p.set_defaults(handler=cmd_budget)
    p = subparsers.add_parser("match", help="a matched pair's budgets side by side, with ratios")
    p.add_argument("id", help="the id of either run of the pair")
    p.set_defaults(handler=cmd_match)

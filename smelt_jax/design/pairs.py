"""A matched pair side by side: the budgets of its Baseline and of every model matched to it, their
ratios and relative mismatches, and, for smelt16, the paper's Appendix A numbers beside ours.

`compare_pair(run, suite_runs)` is what `smelt match` prints; `budget_rows(run)` what `smelt budget`
prints. Plain data out (no printing), so notebooks and tests read the same numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smelt_jax.design import paper
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.platform.errors import UsageError
from smelt_jax.design.matching import mismatch

NO_RATIO = ("sparsity S",)  # budgets whose ratio means nothing (S is already a fraction)


def budget_rows(run: RunSpec) -> dict[str, float]:
    """The run's budgets by display name (docs/budget.md)."""
    b = run.budget()
    return {"train FLOPs/token": b.train_flops_per_token,
            "forward FLOPs/token": b.forward_flops_per_token, "params total": b.params_total,
            "params active": b.params_active, "params executed": b.params_executed,
            "params embedding": b.params_embedding, "KV entries/token": b.kv_per_token,
            "sparsity S": b.sparsity}


@dataclasses.dataclass(frozen=True)
class PairComparison:
    pair_id: str
    baseline: RunSpec
    others: tuple[RunSpec, ...]  # every other member of the pair (SMELT, or an ablation's models)
    budgets: dict[str, dict[str, float]]  # run id -> budget_rows
    mismatches: dict[str, dict[str, float]]  # other run id -> {flops, params, kv}: other/baseline - 1
    paper: tuple[dict[str, float | str], ...]  # Appendix A beside ours (smelt16 only), one per model

    def ratio(self, other: RunSpec, name: str) -> float | None:
        """other's budget over the Baseline's, or None where a ratio means nothing."""
        base = self.budgets[self.baseline.id][name]
        return None if name in NO_RATIO or not base else self.budgets[other.id][name] / base


def compare_pair(run: RunSpec, suite_runs: Sequence[RunSpec]) -> PairComparison:
    """The pair `run` belongs to (its `pair_id` in `suite_runs`), compared against its Baseline."""
    pair = [r for r in suite_runs if r.pair_id == run.pair_id]
    base = next((r for r in pair if r.arch == "baseline"), None)
    if base is None:
        raise UsageError(f"{run.pair_id} has no baseline to match against")
    others = tuple(r for r in pair if r is not base)
    smelts = [o for o in others if o.arch == "smelt"]
    return PairComparison(
        pair_id=run.pair_id, baseline=base, others=others,
        budgets={r.id: budget_rows(r) for r in pair},
        mismatches={o.id: mismatch(base.model, o.model) for o in others},
        paper=tuple(appendix_a_beside_ours(base, smelts)) if run.suite == "smelt16" else ())


def appendix_a_beside_ours(base: RunSpec, smelts: Sequence[RunSpec]) -> list[dict[str, float | str]]:
    """One row per model: the paper's active/total parameters (billions), S (%) and, for SMELT, its
    FLOP and KV ratios, next to ours in the same units."""
    b0 = base.budget()
    ref = paper.appendix_a(base.scale, base.sparsity_label, "baseline")
    rows = [{"arch": "baseline", "paper_active": ref["active"], "paper_total": ref["total"],
             "paper_sparsity": ref["sparsity"], "active": b0.params_active / 1e9,
             "total": b0.params_total / 1e9, "sparsity": 100 * b0.sparsity}]
    for smelt in smelts:
        ref, b = paper.appendix_a(smelt.scale, smelt.sparsity_label, "smelt"), smelt.budget()
        rows.append({"arch": "smelt", "paper_active": ref["active"], "paper_total": ref["total"],
                     "paper_sparsity": ref["sparsity"], "paper_flops_ratio": ref["flops_ratio"],
                     "paper_kv_ratio": ref["kv_ratio"], "active": b.params_active / 1e9,
                     "total": b.params_total / 1e9, "sparsity": 100 * b.sparsity,
                     "flops_ratio": b.train_flops_per_token / b0.train_flops_per_token,
                     "kv_ratio": b.kv_per_token / b0.kv_per_token})
    return rows

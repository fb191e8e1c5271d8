"""The CPU's attention backend (kernels/backend.py `choose_attention_backend`): every step of the peer and
pair tables run with `attention_impl="reference"` (the masked dense core, the CPU's choice before issue 28's
`blocked`) and with the default (`auto` -> `blocked`: query blocks of 64 rows against the keys up to their
end), timed in interleaved rounds in one process, with the PyTorch peer at the issue-17 shapes beside them.

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.run attention
    SMELT_BENCH_ATTENTION_ROUNDS=3 ... (default 5)

Two tables: each step's before -> after (ours / peer in tokens per second for the issue-17 step), and each
matched pair's SMELT / Baseline time per token over their FLOP ratio (issue 28's goal <= 1.15) before and
after. Paired medians: the ratio of two candidates timed back to back in a round, medianed over rounds.
"""

from __future__ import annotations

import os

ROUNDS = int(os.environ.get("SMELT_BENCH_ATTENTION_ROUNDS", "5"))
BEFORE = "reference"


def _steps():
    """(name, cfg, batch size, pair id or None, arch or None) of the issue-17 step and the pairs' members."""
    from benchmarks import bench_peer as bp

    yield "issue-17 step", bp.issue_config(), bp.BATCH, None, None
    for spec in bp.matched_pair_specs():
        yield spec.id, spec.model, spec.schedule.batch_size, spec.pair_id, spec.arch


def run() -> str:
    import jax

    from benchmarks import bench_peer as bp
    from benchmarks.cpu_info import cpu_line

    peer_ok, peer_note = bp.peer_available()
    peer = bp.peer_candidate(bp.issue_config(), bp.BATCH) if peer_ok else None
    rows = []  # (name, cfg, pair, arch, before, after)
    for name, cfg, batch, pair, arch in _steps():
        before = bp.our_candidate("before", name, cfg.replace(attention_impl=BEFORE), batch)
        after = bp.our_candidate("after", name, cfg, batch)
        rows.append((name, cfg, pair, arch, before, after))
    cands = ([peer] if peer else []) + [c for *_, before, after in rows for c in (before, after)]
    bp.measure(cands, rounds=ROUNDS, steps=1)

    out = [cpu_line() + f"; jax {jax.__version__}; {peer_note}; {ROUNDS} interleaved rounds, one step each, "
           "after one compiling step.\n",
           f"| step | before s ({BEFORE} attention) | after s (auto: blocked) | after / before, paired median | "
           "ours / peer tokens per s, before -> after |", "|---|---:|---:|---:|---|"]
    for name, _, pair, _, before, after in rows:
        if before.error or after.error:
            out.append(f"| {name} | failed: {before.error or after.error} | | | |")
            continue
        vs_peer = ""
        if pair is None and peer is not None and peer.times:
            vs_peer = f"{peer.median_s / before.median_s:.2f}x -> {peer.median_s / after.median_s:.2f}x"
        out.append(f"| {name} | {before.median_s:.3f} | {after.median_s:.3f} | "
                   f"{bp.paired_ratio(after, before, 1):.3f} | {vs_peer} |")
    if peer is not None:
        out.append(f"\nPeer (HF Mixtral, `grouped_mm`, 2 threads) at the issue-17 shapes: {peer.median_s:.3f} s "
                   "a step (median).")

    members: dict[str, dict] = {}
    for _, cfg, pair, arch, before, after in rows:
        if pair and not (before.error or after.error):
            members.setdefault(pair, {})[arch] = (cfg, before, after)
    out += ["", f"| pair | SMELT / Baseline time per token, before | after | FLOP ratio | time / FLOP, before | "
            f"after | <= {bp.PAIR_GOAL} after |", "|---|---:|---:|---:|---:|---:|---|"]
    for pair, both in members.items():
        if set(both) != {"baseline", "smelt"}:
            continue
        (cfg_b, base_before, base_after), (cfg_s, smelt_before, smelt_after) = both["baseline"], both["smelt"]
        flops = bp.step_flops_per_token(cfg_s) / bp.step_flops_per_token(cfg_b)
        per_token = base_before.tokens / smelt_before.tokens
        t_before = bp.paired_ratio(smelt_before, base_before, 1) * per_token
        t_after = bp.paired_ratio(smelt_after, base_after, 1) * per_token
        goal = "yes" if t_after / flops <= bp.PAIR_GOAL else "no"
        out.append(f"| {pair} | {t_before:.2f} | {t_after:.2f} | {flops:.2f} | {t_before / flops:.2f} | "
                   f"{t_after / flops:.2f} | {goal} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(run())

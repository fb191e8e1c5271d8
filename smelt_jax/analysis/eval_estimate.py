"""What `smelt eval` will cost, said before it starts: forward passes, tokens, compiled programs, an
estimated time and peak memory.

The passes are counted exactly as `analysis.evaluate` will run them: validation, per source, the
`ValidationSet` batches of `batch_size` rows of `seq_len`; Dyck, per shot count, the examples in
chunks of `batch_size` at the chunk's padded width (`evaluate._padded_length`, at most `max_len`);
each distinct width is one more compiled program. Task files are not counted (their size is not known
before they are read).

Time = forward FLOPs (budget.forward_flops_per_token at the pass's width, padding included) / (the
device's rate x EFFICIENCY) + COMPILE_SECONDS per program. Memory = BASE_BYTES (the process with JAX
and the libraries loaded) + 3 copies of the parameters (restored, merged, the program's) + the largest
pass's live activations (attention scores, one layer's hidden and expert buffers, the logits; x
XLA_OVERHEAD). The constants were fitted on the 2.5M-parameter smoke model
(smoke-xs-s85-baseline) on a 2-core CPU, where `smelt eval` with the defaults measured 37 s wall
(9 s of it start-up and restore) and 668 MB peak RSS (/usr/bin/time -v), estimated ~23 s of
evaluation and ~0.6 GB: a rough guide, not a promise; the order of magnitude is what matters (a
4096-token `--max-len` with 32-shot Dyck is gigabytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

EFFICIENCY = 0.25  # share of the measured matmul rate a small model's forward reaches
COMPILE_SECONDS = 6.0  # one jitted forward of a new width (CPU, smoke model)
BASE_BYTES = 400 * 2**20  # `smelt eval --no-validation --dyck-shots none`: 415 MB peak RSS
XLA_OVERHEAD = 2.0  # live temporaries beyond the tensors counted


@dataclasses.dataclass(frozen=True)
class EvalEstimate:
    validation_passes: int
    dyck_passes: int
    tokens: int  # rows x width over every pass (padding included)
    widths: tuple[int, ...]  # one compiled program each (per scorer)
    programs: int
    flops: float
    seconds: float
    peak_bytes: int

    def line(self) -> str:
        parts = []
        if self.validation_passes:
            parts.append(f"validation {self.validation_passes} batch(es)")
        if self.dyck_passes:
            parts.append(f"Dyck {self.dyck_passes} batch(es)")
        what = ", ".join(parts) or "nothing to evaluate"
        return (f"smelt eval: {what}, {self.tokens:,} tokens, {self.programs} program(s) to compile "
                f"(widths {', '.join(map(str, self.widths)) or '-'}); estimated ~{_duration(self.seconds)} "
                f"and ~{self.peak_bytes / 2**30:.1f} GB peak memory")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def activation_bytes(cfg, batch: int, width: int) -> int:
    """Live float32 bytes of one forward of [batch, width] (attention scores and probabilities, one
    layer's hidden state and expert buffers, the logits and their log-softmax)."""
    attention = batch * cfg.n_heads * width * width * 3
    hidden = batch * width * (12 * cfg.d_model + cfg.n_experts * cfg.expert_ffn + 4 * cfg.top_k * cfg.expert_ffn)
    logits = batch * width * cfg.vocab * 3
    return int(4 * XLA_OVERHEAD * (attention + hidden + logits))


def dyck_widths(shots: Sequence[int], n_examples: int, batch_size: int, max_len: int) -> list[int]:
    """The padded width of every Dyck batch, in the order evaluate_dyck runs them."""
    from smelt_jax.analysis import dyck as dyck_lib
    from smelt_jax.analysis.evaluate import _padded_length

    widths = []
    for k in shots:
        examples = dyck_lib.make_examples(0, n_examples, int(k), dyck_lib.DyckConfig())
        lengths = [min(max_len, 1 + len((e.context + e.continuation).encode("utf-8"))) for e in examples]
        for start in range(0, len(lengths), batch_size):
            widths.append(_padded_length(max(lengths[start:start + batch_size]), max_len))
    return widths


def validation_batches(corpus, *, seq_len: int, eval_tokens: int | None, batch_size: int) -> int:
    """The ValidationSet batches validation_report will run, over every source (0 without a corpus)."""
    if corpus is None:
        return 0
    from smelt_jax.data.pipeline import validation_sets
    return sum(len(vset) for vset in validation_sets(corpus, batch_size=batch_size, seq_len=seq_len,
                                                     max_tokens=eval_tokens, host_index=0,
                                                     host_count=1).values())


def estimate_eval(cfg, corpus=None, *, seq_len: int, eval_tokens: int | None, dyck_shots: Sequence[int],
                  dyck_examples: int, max_len: int | None, batch_size: int,
                  rate: float | None = None) -> EvalEstimate:
    """What evaluate_model(model of `cfg`, corpus, ...) with these arguments will run and cost.
    rate: the device's FLOP/s (default: train.mfu.peak_flops_per_device, a measured matmul on CPU)."""
    from smelt_jax.design.budget import forward_flops_per_token, params_total

    if rate is None:
        from smelt_jax.train.mfu import peak_flops_per_device
        rate = peak_flops_per_device()[0]
    n_validation = validation_batches(corpus, seq_len=seq_len, eval_tokens=eval_tokens,
                                      batch_size=batch_size)
    from smelt_jax.analysis.evaluate import effective_max_len
    max_len = effective_max_len(max_len, seq_len)
    dyck = dyck_widths(dyck_shots, dyck_examples, batch_size, max_len) if dyck_shots else []
    passes = [seq_len] * n_validation + dyck
    tokens = batch_size * sum(passes)
    flops = sum(batch_size * w * forward_flops_per_token(cfg, attended_keys=w / 2,
                                                                include_unembedding=True) for w in passes)
    widths = tuple(sorted(set(passes)))
    # the validation scorer and the Dyck scorer are two jitted functions: one program per width each
    programs = (1 if n_validation else 0) + len(set(dyck))
    seconds = flops / (rate * EFFICIENCY) + COMPILE_SECONDS * programs
    peak = (BASE_BYTES + 3 * 4 * params_total(cfg)
            + max((activation_bytes(cfg, batch_size, w) for w in widths), default=0))
    return EvalEstimate(n_validation, len(dyck), tokens, widths, programs, flops, float(seconds), int(peak))

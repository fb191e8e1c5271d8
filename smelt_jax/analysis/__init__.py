"""Evaluations and mechanistic analyses: pure functions over task files, scores and captured internals.

- `dyck`: the synthetic BIG-bench-format Dyck in-context task and its scoring.
- `tasks`: offline scoring of language-modelling and multiple-choice JSONL files through an injected scorer;
  centered accuracy and DCLM Core.
- `mechanistic`: cross-visit routing overlap, residual-write ratios and cosines, attention-stage cosines.
- `attention`: attended-token overlap, attention sinks (own-document first token; Gu et al.'s sink rate),
  the Dyck head.

Nothing here imports the model package: numpy arrays and strings in, numbers and DataFrames out.
"""

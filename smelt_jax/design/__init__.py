"""The experiment design: what a run is and what it is matched against, as pure values and functions.

- `config`: the frozen model and schedule dataclasses; `descriptors`: a `RunSpec` per configuration.
- `budget`: parameters, FLOPs and KV cache of a configuration (the one budget formula); `matching`: the
  matcher that gives a looped model its Baseline's budgets; `pairs`: a matched pair side by side.
- `suites`: the registry through which the library reaches `experiments/`; `paper`: the numbers the paper
  publishes, for comparison only.
"""

"""Compile tools: ahead-of-time TPU compilation from a CPU machine and what is read from its output.

- `aot`: compile-only TPU devices for a named topology; compile a jitted program and summarise it.
- `report`: a run's real train step compiled for a TPU slice -> `CompileReport` (memory, FLOPs,
  executed collectives, roofline step time and MFU bound).
- `hlo_stats`: collectives and loop trip counts parsed from compiled HLO text.
- `program_flops`: matmul FLOPs of a jaxpr, loops x trip count, by primitive kind.
- `layout_search`: the search for a layout that fits (candidates, cache, table) and `compile_suite`,
  the resumable loop behind `smelt compile-report`. A suite's policy (slice per scale, expert axis
  sizes, order) comes from `experiments.placement`.
- `isolated`: each of `compile_suite`'s compiles in a child process, so one the host cannot hold (or a
  libtpu crash) fails alone.

Hardware numbers (HBM, peak, ICI, slice shapes) live in `smelt_jax.platform.hardware`.
"""

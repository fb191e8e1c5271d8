"""Platform plumbing: what every other package reads about the machine, the process and the user.

- `hardware`: chips, slices and their numbers (the one table); `jax_platform`: which JAX platform a
  process uses when nobody said; `fit_isa`: the instruction set a fit process is pinned to.
- `storage`: local paths and gs:// URLs behind one interface; `paths`: where the package and its checkout are.
- `errors` and `exit_codes`: what the `smelt` command reports and exits with; `progress`: progress lines.
"""

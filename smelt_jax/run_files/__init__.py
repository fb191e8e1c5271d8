"""Run folders and their files: where a run's artifacts live and how each is read and checked.

- `rundir`: the folder layout under the runs root; `path_names`: the one check of every path component
  from user input.
- `run_spec_file` (`run.json`), `run_data` (the data a run trains on), `checkpoint_format` (checkpoints on
  disk and the judgement of a step), `results` (the endpoint store: parquet rows and the CSV export).
- `run_lookup`: a run by id, from the suites or the runs folder; `overrides`: `key=value` changes of a run;
  `memory_estimate`: a run's memory per device, refused before anything is written when it cannot fit.
"""

"""The `smelt` process exit codes: one definition each, read by the CLI, the trainer and every sweep
backend (which restart a job that exits `PREEMPTED`).

    0   done
    1   `SKIPPED`: done, but some items were left out (a command that walks many runs, files or shards:
        results collect, sweep status, experiments list, data prepare; a local sweep with failed jobs):
        each is named in one line with its path, the rest were processed
    2   a user error (`SmeltError`): one line on stderr
    3   `NONFINITE`: the loss became NaN or infinite; the last good checkpoint is kept
    42  `PREEMPTED`: stopped on request (SIGTERM/SIGINT, --stop-after) after saving: restart me
"""

SKIPPED = 1
USER_ERROR = 2
NONFINITE = 3
PREEMPTED = 42

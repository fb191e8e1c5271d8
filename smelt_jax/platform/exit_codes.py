"""The `smelt` process exit codes: one definition each, read by the CLI, the trainer and every sweep
backend (which restart a job that exits `PREEMPTED`).

    0   done
    2   a user error (`SmeltError`): one line on stderr
    3   `NONFINITE`: the loss became NaN or infinite; the last good checkpoint is kept
    42  `PREEMPTED`: stopped on request (SIGTERM/SIGINT, --stop-after) after saving: restart me
"""

USER_ERROR = 2
NONFINITE = 3
PREEMPTED = 42

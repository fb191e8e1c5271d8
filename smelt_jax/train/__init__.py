"""Training: checkpoints (and, later, the trainer, schedules and metrics)."""

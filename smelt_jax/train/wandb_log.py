"""Optional Weights & Biases logging of a run phase (`smelt train ID --wandb PROJECT`).

The writer takes the records the trainer writes to `metrics.jsonl` (the interface of
`tensorboard.EventWriter`: write(record), close()) and logs the same scalars (`train/<key>`,
`eval/<source>`; tensorboard.scalars_of) against the training step, with the run's hyperparameters
(tensorboard.run_hparams) as the W&B config. One W&B run per phase: its id is `<run id>-<phase>`
(resumed with `resume="allow"` when the trainer restarts), its group the run id, so a run's stable
phase and branches sit together and runs compare by arch and sparsity. A trainer process opens the
run once (phase.Phase.wandb_log) and logs its training, any repair and a branch's final
evaluation into it, so W&B offline writes one `offline-run-*` folder per trainer process.

A resumed phase logs again the steps after its checkpoint: `step` is the x axis (define_metric),
not W&B's own counter, so a repeated step is one more point at that step, not an error.

`wandb` is an optional dependency (`pip install smelt_jax[wandb]`). Where it writes: $WANDB_DIR if
set, else the phase folder when it is local (`<phase>/wandb/`), else wandb's default (./wandb).
Offline (`WANDB_MODE=offline`) the run stays in those files; `wandb sync` uploads it later.
"""

from __future__ import annotations

import os
from typing import Any

from smelt_jax.platform.errors import UsageError


def wandb_run_id(run, branch: int | None) -> str:
    return f"{run.id}-{'stable' if branch is None else f'branch{branch}'}"


class WandbWriter:
    """One phase's scalars into one W&B run. `run`: descriptors.RunSpec; `folder`: the phase folder."""

    def __init__(self, project: str, run, branch: int | None, folder=None) -> None:
        try:
            import wandb
        except ImportError:
            raise UsageError("--wandb needs the wandb package: pip install 'smelt_jax[wandb]'") from None
        directory = os.environ.get("WANDB_DIR")
        if not directory and folder is not None and "://" not in str(folder):
            directory = str(folder)
            os.makedirs(directory, exist_ok=True)
        from smelt_jax.train.tensorboard import run_hparams
        hparams = run_hparams(run, branch)
        self._run = wandb.init(project=project, id=wandb_run_id(run, branch),
                               name=wandb_run_id(run, branch), group=run.id, job_type=hparams["phase"],
                               config=hparams, dir=directory, resume="allow",
                               settings=wandb.Settings(console="off", silent=True))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, record: dict[str, Any]) -> None:
        from smelt_jax.train.tensorboard import scalars_of
        if "step" in record:
            scalars = scalars_of(record)
            if scalars:
                self._run.log({**scalars, "step": int(record["step"])})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __enter__(self) -> WandbWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wandb_writer(project: str, run, branch: int | None, folder=None) -> WandbWriter | None:
    """The phase's W&B writer, or None when no project is given."""
    return WandbWriter(project, run, branch, folder) if project else None

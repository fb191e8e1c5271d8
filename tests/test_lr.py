import itertools
import math

import pytest

from smelt_jax.design.config import Schedule
from smelt_jax.train.lr import learning_rate, phase_steps

SCHED = Schedule(batch_size=2, seq_len=8, stable_steps=100, fork_steps=(20, 100), decay_steps=10,
                 warmup_steps=10, peak_lr=1.0, final_lr_fraction=0.1)


def test_warmup_stable_and_decay_shapes():
    assert learning_rate(SCHED, 0) == pytest.approx(0.1)
    assert learning_rate(SCHED, 9) == pytest.approx(1.0)
    assert learning_rate(SCHED, 50) == 1.0
    # branch 0 forks at 20: cosine over steps 20..29, ending on the floor
    decay = [learning_rate(SCHED, s, branch=0) for s in range(20, 30)]
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert decay[-1] == pytest.approx(0.1)
    assert decay[4] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))  # halfway: the mean


def test_phase_bounds():
    assert phase_steps(SCHED, None) == (0, 100)
    assert phase_steps(SCHED, 1) == (100, 110)
    with pytest.raises(ValueError, match="outside"):
        learning_rate(SCHED, 100)
    with pytest.raises(ValueError, match="branch 2"):
        phase_steps(SCHED, 2)

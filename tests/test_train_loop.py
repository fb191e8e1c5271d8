"""Issue 24 item 1: the step loop with hooks (`add_hook(fn, every=N)`), the `TrainState` pytree saved
and restored whole, checkpoints of the earlier layout restoring unchanged, and read-only readers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smelt_jax.train.checkpoint import Checkpointer
from smelt_jax.train.loop import StepLoop, StopSignal
from smelt_jax.train.state import TrainState


def _state(step: int = 0) -> TrainState:
    return TrainState({"w": jnp.arange(6.0).reshape(2, 3)}, {"m": jnp.zeros(3), "count": jnp.int32(0)},
                      step, step)


def _step(state: TrainState):
    params = jax.tree.map(lambda w: w + 1.0, state.params)
    return state.advanced(params, state.opt_state), {"loss": jnp.float32(state.step)}


def test_hooks_run_after_their_steps_in_the_order_added():
    calls = []
    loop = StepLoop(_step, before=[lambda step: calls.append(("before", step))])
    loop.add_hook(lambda info: calls.append(("every", info.step)))
    loop.add_hook(lambda info: calls.append(("third", info.step)), every=3, at={5})
    state = loop.run(_state(1), 6)
    assert state.step == 6 and state.data_step == 6
    assert float(state.params["w"][0, 0]) == 5.0  # five steps
    expected = []
    for step in range(1, 6):
        expected += [("before", step), ("every", step + 1)]
        if (step + 1) % 3 == 0 or step + 1 == 5:
            expected.append(("third", step + 1))
    assert calls == expected
    with pytest.raises(ValueError):
        loop.add_hook(print, every=0)


def test_a_hook_stops_the_loop_by_raising():
    loop = StepLoop(_step)

    def stop(info):
        raise KeyboardInterrupt(info.step)
    loop.add_hook(stop, every=4)
    with pytest.raises(KeyboardInterrupt, match="4"):
        loop.run(_state(), 10)


def test_the_stop_signal_is_a_flag_while_the_block_runs():
    import os
    import signal
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert not stop.raised
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.raised and stop.signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_train_state_leaves_are_the_arrays_and_the_positions_are_static():
    state = _state(7)
    assert len(jax.tree.leaves(state)) == 3
    moved = jax.tree.map(lambda x: x * 2, state)
    assert (moved.step, moved.data_step) == (7, 7)
    assert state.positions() == {"step": 7, "data_step": 7}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    assert abstract.is_abstract and not state.is_abstract


def test_train_state_is_saved_and_restored_whole(tmp_path):
    saved = _state(3)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(saved, {"run_id": "r", "branch": None})
        ckpt.wait()
        restored = ckpt.restore_state(_state(0))
        _, _, metadata = ckpt.restore(_state(0).arrays())
    assert (restored.step, restored.data_step) == (3, 3)
    assert metadata == {"step": 3, "data_step": 3, "run_id": "r", "branch": None}  # the on-disk layout
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_of_the_earlier_layout_restores(tmp_path):
    """Before the TrainState, the trainer saved {'params', 'opt_state'} with {'step', 'data_step', ...}
    as metadata (the same layout); the oldest ones had no data_step: it is the step then."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, _state().arrays(), {"step": 5})
        ckpt.save(6, _state().arrays(), {"step": 6, "data_step": 6, "run_id": "r", "branch": 0})
    with Checkpointer(tmp_path, read_only=True) as reader:
        assert reader.restore_state(_state(), step=5).data_step == 5
        assert reader.restore_state(_state()).step == 6


def test_a_read_only_reader_changes_nothing(tmp_path):
    with Checkpointer(tmp_path / "missing", read_only=True) as reader:
        assert reader.all_steps() == []
    assert not (tmp_path / "missing").exists()  # a writer would have created it
    with Checkpointer(tmp_path, max_to_keep=1) as ckpt:
        ckpt.save(1, _state().arrays())
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    with Checkpointer(tmp_path, read_only=True) as reader:
        with pytest.raises(RuntimeError, match="read-only"):
            reader.save(2, _state().arrays())
        assert reader.restore(_state().arrays())[0] == 1
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before

"""compile_step, step_closure and checkpoint_closure semantics."""

from __future__ import annotations

import pytest
import torch

import weightstream as cstorch
from weightstream.executor import step_context


def test_step_closure_runs_after_the_step_with_the_last_value():
    events = []

    @cstorch.step_closure
    def log(t):
        events.append(("closure", t.item()))

    @cstorch.compile_step
    def step(x):
        y = x * 2
        log(y)  # queued: runs after the step
        events.append(("in step", None))
        y.add_(1)  # in-place after the call: the closure sees this last value
        return y

    out = step(torch.tensor(3.0))
    assert events == [("in step", None), ("closure", 7.0)]
    assert out.item() == 7.0
    assert step_context().step == 1


def test_step_closure_outside_a_step_runs_at_once():
    seen = []
    cstorch.step_closure(lambda t: seen.append(t.item()))(torch.tensor(1.5))
    assert seen == [1.5]


def test_steps_cannot_nest_and_a_failed_step_drops_its_closures():
    @cstorch.compile_step
    def inner():
        return 1

    @cstorch.compile_step
    def outer():
        return inner()

    with pytest.raises(RuntimeError, match="cannot be nested"):
        outer()
    seen = []

    @cstorch.compile_step
    def failing():
        cstorch.step_closure(lambda: seen.append(1))()
        raise ValueError("boom")

    with pytest.raises(ValueError):
        failing()
    assert seen == [] and step_context().step == 0


def test_checkpoint_closure_only_on_checkpoint_steps():
    cstorch.configure(checkpoint_steps=3)
    saved = []

    @cstorch.checkpoint_closure
    def save(step):
        saved.append(step)

    @cstorch.compile_step
    def step():
        return None

    save(0)  # before the first step: allowed
    loader = cstorch.utils.data.DataLoader(lambda: [torch.zeros(1)] * 4, num_steps=7)
    for i, _ in enumerate(loader, start=1):
        step()
        if i in (3, 6, 7):  # checkpoint steps and the last step
            save(i)
        elif i == 4:
            with pytest.raises(RuntimeError, match="not a checkpoint step"):
                save(i)
    assert saved == [0, 3, 6, 7]


def test_checkpoint_closure_inside_a_step_is_checked_after_it():
    cstorch.configure(checkpoint_steps=2)
    saved = []

    @cstorch.checkpoint_closure
    def save():
        saved.append(step_context().step)

    @cstorch.compile_step
    def step():
        save()

    with pytest.raises(RuntimeError, match="step 1"):
        step()
    step()
    assert saved == [2]


def _loader(**steps):
    data = [torch.full((1,), float(i)) for i in range(4)]
    return cstorch.utils.data.DataLoader(lambda: data, **steps)


def test_checkpoint_steps_count_on_from_a_restored_loader():
    """A loader restored at step 6 counts on from there (Note [checkpoint steps]):
    step 8 is a checkpoint step of checkpoint_steps=4, step 7 is not."""
    cstorch.configure(checkpoint_steps=4)
    step = cstorch.compile_step(lambda: None)
    first = _loader(max_steps=6)
    for _ in first:
        step()
    state = first.state_dict()
    saved = []
    save = cstorch.checkpoint_closure(lambda s: saved.append(s))
    resumed = _loader(max_steps=10)  # 4 steps on from the restored 6
    resumed.load_state_dict(state)
    for global_step, _ in enumerate(resumed, start=7):
        step()
        if global_step in (7, 9):
            with pytest.raises(RuntimeError, match=f"called at step {global_step}, which is"):
                save(global_step)
        else:
            save(global_step)  # 8: every 4 steps; 10: the last
    assert saved == [8, 10]


def test_an_evaluation_loader_between_training_steps_keeps_the_training_count():
    cstorch.configure(checkpoint_steps=4)
    step = cstorch.compile_step(lambda: None)
    save = cstorch.checkpoint_closure(lambda s: s)
    for i, _ in enumerate(_loader(num_steps=8), start=1):
        step()
        if i == 2:
            for _ in _loader(num_steps=3):  # three evaluation steps in between
                step()
        if i in (4, 8):
            save(i)
        elif i == 5:
            with pytest.raises(RuntimeError, match="called at step 5"):
                save(i)
    assert step_context().step == 11

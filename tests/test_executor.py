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


def test_a_weight_given_to_a_step_closure_has_the_steps_value_under_overlapped_updates():
    """overlap_updates applies a step behind the next forward: a closure given a weight
    waits for that update, so it sees each step's weights as eager torch.optim makes
    them (it saw the step before, or a half-written update)."""
    import copy

    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(5, 16, 8, generator=g), torch.randint(0, 4, (5, 16), generator=g)
    eager = copy.deepcopy(base)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in zip(xs, ys):
        F.cross_entropy(eager(x), y).backward()
        eager_opt.step()
        eager_opt.zero_grad()
        expected.append(eager[0].weight.detach().clone())

    model = copy.deepcopy(base)
    compiled = cstorch.compile(model, backend="wse_ws", overlap_updates=True)
    opt = cstorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @cstorch.compile_step
    def step(x, y):
        loss = F.cross_entropy(compiled(x), y)
        cstorch.amp.optimizer_step(loss, opt, None)
        return loss

    seen = []

    @cstorch.step_closure
    def peek(weight, loss):
        seen.append(weight.detach().clone())

    for x, y in zip(xs, ys):
        peek(model[0].weight, step(x, y))
    assert len(seen) == 5 and all(torch.equal(a, b) for a, b in zip(seen, expected))


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


def _save_after_every_step(num_steps: int) -> list[int]:
    """A reference-style loop: a checkpoint closure called after every step; the steps
    it ran on."""
    saved = []
    save = cstorch.checkpoint_closure(lambda s: saved.append(s))
    step = cstorch.compile_step(lambda: None)
    save(0)  # before the first step: allowed
    loader = cstorch.utils.data.DataLoader(lambda: [torch.zeros(1)] * 4, num_steps=num_steps)
    for i, _ in enumerate(loader, start=1):
        step()
        save(i)  # after every step, as the reference allows: skipped but on checkpoint steps
    return saved


def test_checkpoint_closure_only_on_checkpoint_steps(caplog):
    cstorch.configure(checkpoint_steps=3)
    with caplog.at_level("WARNING", logger="weightstream"):
        assert _save_after_every_step(7) == [0, 3, 6, 7]  # checkpoint steps and the last step
    assert not caplog.records  # a DataLoader announces the last step: nothing to warn of


def test_checkpoint_closure_without_checkpoint_steps_warns_once_that_it_is_skipped(caplog):
    with caplog.at_level("WARNING", logger="weightstream"):
        assert _save_after_every_step(5) == [0, 5]  # before the first step, and the last
    (record,) = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert "configure(checkpoint_steps=0)" in record.getMessage()


def test_checkpoint_closure_without_a_dataloader_warns_that_the_last_step_is_unknown(caplog):
    """Steps over a plain list: the last step is not announced, so step 7 gets no
    checkpoint with checkpoint_steps=3; said once, with the fix."""
    cstorch.configure(checkpoint_steps=3)
    saved = []
    save = cstorch.checkpoint_closure(lambda s: saved.append(s))
    step = cstorch.compile_step(lambda: None)
    with caplog.at_level("WARNING", logger="weightstream"):
        for i, _ in enumerate([torch.zeros(1)] * 7, start=1):
            step()
            save(i)
    assert saved == [3, 6]
    (record,) = [r for r in caplog.records if "last step is not" in r.getMessage()]
    assert "runs every 3 steps" in record.getMessage()
    assert "Fix: iterate a cstorch.utils.data.DataLoader" in record.getMessage()


def test_checkpoint_closure_inside_a_step_is_checked_after_it():
    cstorch.configure(checkpoint_steps=2)
    saved = []

    @cstorch.checkpoint_closure
    def save():
        saved.append(step_context().step)

    @cstorch.compile_step
    def step():
        save()

    step()  # step 1: not a checkpoint step, skipped once the step ended
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
        save(global_step)  # skipped on 7 and 9
    assert saved == [8, 10]  # 8: every 4 steps; 10: the last


def test_an_evaluation_loader_between_training_steps_keeps_the_training_count():
    cstorch.configure(checkpoint_steps=4)
    step = cstorch.compile_step(lambda: None)
    saved = []
    save = cstorch.checkpoint_closure(lambda s: saved.append(s))
    for i, _ in enumerate(_loader(num_steps=8), start=1):
        step()
        if i == 2:
            for _ in _loader(num_steps=3):  # three evaluation steps in between
                step()
        else:  # (after them, the loader that yielded last is at its last step)
            save(i)
    assert saved == [4, 8]  # the training loader's count, not the 11 steps run
    assert step_context().step == 11


@pytest.mark.parametrize("steps", [5, 7])
def test_with_gradient_accumulation_the_last_step_is_a_checkpoint_step(steps):
    """grad_accum_steps=3: each step takes 3 batches and one compile_step call; the last
    step is a checkpoint step (api-reference.md: "every checkpoint_steps and the last
    step"). The closure missed it: the loader counted batches as steps."""
    cstorch.configure(checkpoint_steps=3)
    step = cstorch.compile_step(lambda: None)
    saved = []
    save = cstorch.checkpoint_closure(lambda s: saved.append(s))
    loader = _loader(num_steps=steps, grad_accum_steps=3)
    batches = iter(loader)
    for global_step in range(1, steps + 1):
        for _ in range(3):
            next(batches)
        step()
        save(global_step)
    assert next(batches, None) is None  # the loader gave steps x 3 batches
    assert saved == [s for s in range(1, steps + 1) if s % 3 == 0 or s == steps]

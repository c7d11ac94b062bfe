"""Overlapped host updates (Note [overlapped updates]): the next forward starts
while the last units are still being updated, and the weights are exactly those
of the non-overlapped run."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=3, d_model=32, n_head=4)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 128, (4, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _train(overlap: bool, steps: int = 8, optimizer_cls=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", granularity="module", overlap_updates=overlap)
    opt = (optimizer_cls or cstorch.optim.AdamW)(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = cstorch.optim.configure_lr_scheduler(
        opt,
        {
            "scheduler": "Linear",
            "initial_learning_rate": 3e-3,
            "end_learning_rate": 1e-4,
            "total_iters": steps,
        },
    )
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = F.cross_entropy(runner(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()  # changes lr right after step(): the pending update keeps the old one
        losses.append(loss.detach())
    return model, runner, opt, torch.stack(losses)


def test_overlapped_updates_are_bitwise_equal_to_synchronous_ones():
    ref_model, _, ref_opt, ref_losses = _train(overlap=False)
    model, runner, opt, losses = _train(overlap=True)
    assert torch.equal(losses, ref_losses)
    state = model.state_dict()  # waits for the last step's pending update
    assert not runner.engine.updater.pending
    for k, v in ref_model.state_dict().items():
        assert torch.equal(state[k], v), k
    ref_state, got_state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    for i in ref_state:
        for name in ref_state[i]:
            assert torch.equal(ref_state[i][name], got_state[i][name]), (i, name)


def test_next_forward_starts_before_the_last_unit_is_updated():
    """The last unit's update blocks until the next forward has fetched its first
    unit: with overlap this happens; without, the wait would time out."""
    started_next_forward = threading.Event()
    overlapped = []
    last_params: set[int] = set()

    class GatedAdamW(cstorch.optim.AdamW):
        def _update(self, groups):
            ids = {id(p) for g in groups for p in g["params"]}
            if last_params and ids & last_params:
                overlapped.append(started_next_forward.wait(timeout=10))
            super()._update(groups)

    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", granularity="module", overlap_updates=True)
    opt = GatedAdamW(model.parameters(), lr=1e-3)
    x, y = _batch(0)
    F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
    units = runner.plan.units
    # The last unit whose parameters no earlier unit holds (lm_head shares the
    # tied embedding with unit 0, whose share applies it): ln_f.
    earlier = {id(p) for u in units[:-2] for p in u.params}
    assert not {id(p) for p in units[-2].params} & earlier
    last_params.update(id(p) for p in units[-2].params)
    units[0].module.register_forward_pre_hook(lambda *_: started_next_forward.set())
    opt.step()  # returns at once; the last unit's share waits for the gate
    opt.zero_grad()
    runner(x)  # unit 0 is fetched (its share is done) and opens the gate
    runner.engine.synchronize()
    assert overlapped == [True]


def test_overlap_is_exact_against_eager_torch_optim():
    torch.manual_seed(0)
    eager = GPT(CFG)
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    for step in range(4):
        x, y = _batch(step)
        F.cross_entropy(eager(x).flatten(0, 1), y.flatten()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", overlap_updates=True)
    opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(4):
        x, y = _batch(step)
        F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    for (k, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_a_weight_written_behind_an_overlapped_step_stops_it(tmp_path, store):
    """Writing a parameter while its overlapped update is pending would step the written
    value: the next forward raises, naming it. After ``optimizer.synchronize()`` the same
    write is exact against eager PyTorch (step, then write)."""
    hold = threading.Lock()  # held by the test: the update waits behind step()

    class HeldAdamW(cstorch.optim.AdamW):
        def _update(self, groups):
            with hold:
                super()._update(groups)

    def run(synchronize: bool | None):
        torch.manual_seed(0)
        model = GPT(CFG)
        if synchronize is None:  # eager PyTorch
            runner = model
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.0)
        else:
            disk = {"store": "disk", "store_dir": str(tmp_path / "s")} if store == "disk" else {}
            runner = cstorch.compile(model, backend="ws", overlap_updates=True, **disk)
            opt = HeldAdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        target = model.blocks[1].mlp.fc.weight
        for step in range(2):
            x, y = _batch(step)
            F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
            with hold:
                opt.step()
                opt.zero_grad()
                if synchronize:
                    hold.release()
                    opt.synchronize()
                    hold.acquire()
                with torch.no_grad():
                    target.mul_(0.5)  # behind the step while it is pending
        return model

    eager = run(None)
    model = run(True)
    for (k, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.mlp\.fc\.weight' were changed in place"):
        run(False)

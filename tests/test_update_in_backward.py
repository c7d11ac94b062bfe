"""Updates in the backward (Note [updates in backward] in runtime/updater.py): a
unit's share of the step starts as soon as its gradients are final, and the
weights and optimizer state are bit for bit those of eager PyTorch with
torch.optim, stepped after the backward."""

from __future__ import annotations

import dataclasses
import threading

import models as zoo
import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=3, d_model=32, n_head=4)


def _batch(kind: str, step: int):
    g = torch.Generator().manual_seed(step)
    if kind == "lm":
        x = torch.randint(0, 128, (4, 16), generator=g)
        return x, torch.roll(x, -1, 1)
    if kind == "fc":
        return torch.randn(16, 784, generator=g), torch.randint(0, 10, (16,), generator=g)
    if kind == "root":
        x = torch.randint(0, 50, (4, 8), generator=g)
        return x, torch.roll(x, -1, 1)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def _loss(out, y):
    return (
        F.cross_entropy(out.flatten(0, 1), y.flatten())
        if out.dim() == 3
        else F.cross_entropy(out, y)
    )


MODELS = {
    "gpt": (lambda: GPT(CFG), "lm"),
    "gpt_tied": (zoo.gpt_tied, "lm"),
    "fc_mnist": (zoo.fc_mnist, "fc"),
    "called_twice": (zoo.CalledTwice, "vec"),
    "partly_frozen": (zoo.PartlyFrozen, "vec"),
    "root_params": (zoo.RootParams, "root"),
}
# (weightstream optimizer, its torch.optim twin), same hyperparameters
OPTIMIZERS = {
    "adamw": (
        lambda ps: cstorch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, eps=1e-6),
    ),
    "sgd": (
        lambda ps: cstorch.optim.SGD(ps, lr=0.05, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    ),
}


def _eager(make, kind, make_opt, steps):
    torch.manual_seed(0)
    model = make()
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        x, y = _batch(kind, step)
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, torch.stack(losses)


def _streamed(make, kind, make_opt, steps, between=None, **compile_kw):
    """Training with updates in the backward; ``between(model, step)`` runs after each step."""
    torch.manual_seed(0)
    model = make()
    runner = cstorch.compile(
        model, backend="ws", granularity="module", update_in_backward=True, **compile_kw
    )
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        x, y = _batch(kind, step)
        loss = _loss(runner(x), y)
        cstorch.amp.optimizer_step(loss, opt, None)
        losses.append(loss.detach())
        if between is not None:
            between(model, step)
    return model, runner, opt, torch.stack(losses)


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_equals_eager_torch_bitwise(model_name, opt_name):
    make, kind = MODELS[model_name]
    ours, theirs = OPTIMIZERS[opt_name]
    ref, ref_losses = _eager(make, kind, theirs, 5)
    model, runner, _, losses = _streamed(make, kind, ours, 5)
    assert torch.equal(losses, ref_losses)
    _same_state(model, ref)
    assert not runner.engine.updater.pending


@pytest.mark.parametrize("overlap", [False, True])
def test_with_overlapped_updates_and_prefetch(overlap):
    make, kind = MODELS["gpt_tied"]
    ours, theirs = OPTIMIZERS["adamw"]
    ref, ref_losses = _eager(make, kind, theirs, 5)
    model, _, _, losses = _streamed(make, kind, ours, 5, overlap_updates=overlap, prefetch_depth=2)
    assert torch.equal(losses, ref_losses)
    _same_state(model, ref)  # state_dict() waits for a pending update


def test_the_last_units_update_runs_while_the_backward_is_still_at_the_first_unit():
    """The backward is held at the token embedding's gradient (unit 0, reached last)
    until the untied head's share (the last unit, final first) has run: it runs, so
    the update started inside the backward; otherwise the hold would time out."""
    reached_first_unit = threading.Event()
    during_backward = []

    class RecordingAdamW(cstorch.optim.AdamW):
        def _update(self, groups):
            if {id(p) for g in groups for p in g["params"]} & last_params:
                during_backward.append(not reached_first_unit.is_set())
            super()._update(groups)

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, tie_embeddings=False))
    runner = cstorch.compile(model, backend="ws", granularity="module", update_in_backward=True)
    opt = RecordingAdamW(model.parameters(), lr=1e-3)
    x, y = _batch("lm", 0)
    runner(x)  # the plan is fixed at the first call
    units = runner.plan.units
    last_params = {id(p) for p in units[-1].params}
    assert last_params.isdisjoint(id(p) for u in units[:-1] for p in u.params)
    first = units[0].params[0]
    ran = threading.Event()

    def hold(grad):
        ran.wait(timeout=10)  # released once the head's share ran (or after 10 s)
        return grad

    hooks = [
        first.register_hook(hold),
        first.register_post_accumulate_grad_hook(lambda _p: reached_first_unit.set()),
    ]

    def release_when_updated():
        while not during_backward and not reached_first_unit.is_set():
            threading.Event().wait(0.01)
        ran.set()

    watcher = threading.Thread(target=release_when_updated)
    watcher.start()
    loss = F.cross_entropy(runner(x).flatten(0, 1), y.flatten())
    cstorch.amp.optimizer_step(loss, opt, None)
    watcher.join()
    for h in hooks:
        h.remove()
    assert during_backward == [True]


def test_not_armed_with_clipping_or_loss_scaling():
    make, kind = MODELS["gpt"]
    torch.manual_seed(0)
    model = make()
    runner = cstorch.compile(model, backend="ws", granularity="module", update_in_backward=True)
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(kind, 0)
    armed = []
    updater = runner.engine.updater
    original = updater.arm
    updater.arm = lambda o: (armed.append(o), original(o))[1]
    cstorch.amp.optimizer_step(_loss(runner(x), y), opt, None, max_gradient_norm=1.0)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    cstorch.amp.optimizer_step(_loss(runner(x), y), opt, scaler)
    assert armed == []
    cstorch.amp.optimizer_step(_loss(runner(x), y), opt, None)
    assert armed == [opt]


def test_a_failed_backward_after_a_share_started_is_reported():
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", granularity="module", update_in_backward=True)
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch("lm", 0)
    runner(x)
    first = runner.plan.units[0].params[0]

    def fail(_grad):
        raise MemoryError("out of memory in the backward")

    h = first.register_hook(fail)
    loss = F.cross_entropy(runner(x).flatten(0, 1), y.flatten())
    with pytest.raises(RuntimeError, match="begun their optimizer update") as info:
        cstorch.amp.optimizer_step(loss, opt, None)
    assert isinstance(info.value.__cause__, MemoryError)
    h.remove()


def test_run_command_trains_the_same_with_it(tmp_path, monkeypatch):
    """The trainer's last micro-batch arms it; gradient accumulation included."""
    pytest.importorskip("tensorboard")
    from weightstream.runtime.updater import UnitUpdater

    armed = []
    arm = UnitUpdater.arm
    monkeypatch.setattr(UnitUpdater, "arm", lambda self, o: (armed.append(o), arm(self, o))[1])
    import params_files as pf

    def losses(name: str, **runconfig) -> list[float]:
        optimizer = pf.adamw(1e-3, grad_accum_steps=2)
        return pf.train_tiny_gpt2(tmp_path / name, optimizer, {"max_steps": 4, **runconfig})

    early = losses("early", update_in_backward=True)
    assert len(armed) == 4  # once a step, for its last micro-batch
    assert early == losses("plain") and len(armed) == 4


def test_with_the_disk_store(tmp_path):
    """Shares started in the backward read and write the disk store's files through
    their own pagers (Note [explicit disk I/O]): the bits stay eager PyTorch's."""
    make, kind = MODELS["gpt"]
    ours, theirs = OPTIMIZERS["adamw"]
    ref, ref_losses = _eager(make, kind, theirs, 4)
    model, runner, _, losses = _streamed(
        make, kind, ours, 4, store="disk", store_dir=tmp_path, host_memory_budget=300_000
    )
    store = runner.engine.store.tier
    placement = store.placement()
    assert placement.disk["master"] and placement.disk["state"]
    # The gradients went from the backward to the update in memory: no file, no
    # room in the RAM tier, none predicted (Note [updates in backward]).
    assert not placement.disk.get("grad") and not placement.ram.get("grad")
    assert "grad" not in store.places.predicted.disk and "grad" not in store.places.predicted.ram
    assert torch.equal(losses, ref_losses)
    _same_state(model, ref)
    runner.engine.close()


def _on_disk(model, store_dir, budget: int):
    return cstorch.compile(
        model,
        backend="ws",
        granularity="module",
        update_in_backward=True,
        store="disk",
        store_dir=store_dir,
        host_memory_budget=budget,
    )


def test_disk_store_accumulated_gradients_come_from_the_files(tmp_path):
    """A micro-batch before the last is not armed: its gradients go to the files, and
    the armed last backward adds to them there; the bits stay eager PyTorch's."""
    make, kind = MODELS["gpt"]
    ours, theirs = OPTIMIZERS["adamw"]
    torch.manual_seed(0)
    ref = make()
    ref_opt = theirs(ref.parameters())
    torch.manual_seed(0)
    model = make()
    runner = _on_disk(model, tmp_path, 300_000)
    opt = ours(model.parameters())
    for step in range(3):
        (x0, y0), (x1, y1) = _batch(kind, 2 * step), _batch(kind, 2 * step + 1)
        (_loss(ref(x0), y0) / 2).backward()
        (_loss(ref(x1), y1) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (_loss(runner(x0), y0) / 2).backward()
        cstorch.amp.optimizer_step(_loss(runner(x1), y1) / 2, opt, None)
    assert runner.engine.store.tier.placement().disk["grad"]
    _same_state(model, ref)
    runner.engine.close()


def test_disk_store_gradients_in_memory_are_bounded_to_two_units(tmp_path):
    """Gradients that skip the files are memory until their update is done: while a
    slow update runs, the backward waits, so at most two units' gradients (the one
    being updated, the one handed over) are alive at any hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    alive: list = []  # weak references to every gradient autograd made
    most = []

    def seen(p):
        import weakref

        alive.append((weakref.ref(p.grad), p.grad.numel() * 4))
        most.append(sum(n for ref, n in alive if ref() is not None))

    # Registered before the store's hook (Note [one gradient hook]): it runs first, on
    # the gradient as autograd made it.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(seen)
    runner = _on_disk(model, tmp_path, 400_000)

    class SlowSGD(cstorch.optim.SGD):
        def _update(self, groups):
            threading.Event().wait(0.02)  # a host update slower than the backward
            super()._update(groups)

    opt = SlowSGD(model.parameters(), lr=0.1)
    unit = 64 * 64 * 4 + 64 * 4
    for _ in range(2):
        cstorch.amp.optimizer_step(runner(torch.randn(4, 64)).sum(), opt, None)
    assert not runner.engine.store.tier.placement().disk.get("grad")
    assert max(most) <= 2 * unit
    runner.engine.close()

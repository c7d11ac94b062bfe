"""The host mirror (Note [host mirror] in runtime/mirror.py): fetches copy a flat
compute-dtype buffer written once per forward pass. On the CPU it is off by
default; ``host_mirror=True`` turns it on, and training must stay bitwise what it
is without it (and what eager PyTorch or the cast recipe gives)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine import MODELS, OPTIMIZERS, _assert_same_state, _run
from test_engine_precision import CFG, _batch, _reference_step, _ws_step

import weightstream as cstorch
from weightstream.models import GPT


@pytest.mark.parametrize("model_name", ["fc_mnist", "gpt_tied", "called_twice", "norm_dropout"])
def test_fp32_training_with_the_mirror_matches_eager_bitwise(model_name):
    make, kind = MODELS[model_name]
    make_opt = OPTIMIZERS["adamw"]
    ref, _, ref_losses = _run(make, kind, None, make_opt, steps=6)
    model, runner, losses = _run(
        make, kind, "ws", make_opt, steps=6, granularity="module", host_mirror=True
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    streamer = runner.engine.streamer
    # One mirror per unit and dtype group, as large as the unit's device copy; fp32
    # masters travelling in fp32 are their own mirror: no byte beside them, but for
    # a tied weight's second unit.
    mirrors = [m for g in streamer._mirrors.values() for m in g.values()]
    assert streamer._mirror and sum(not m.aliased for m in mirrors) <= 1
    assert streamer.mirror_bytes() == sum(m.flat.nbytes for m in mirrors if not m.aliased)
    assert sum(m.flat.nbytes for g in streamer._mirrors.values() for m in g.values()) == sum(
        u.device_bytes() for u in streamer.units
    )


def test_off_by_default_on_the_cpu():
    runner = cstorch.compile(GPT(CFG), backend="ws", granularity="module")
    x, _ = _batch(0)
    runner(x)
    assert not runner.engine.streamer._mirror and runner.engine.streamer.mirror_bytes() == 0


def test_bf16_mirror_equals_the_cast_recipe_and_holds_two_bytes_a_parameter():
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(
        model, backend="ws", granularity="module", compute_dtype="bf16", host_mirror=True
    )
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(6):
        x, y = _batch(step)
        expected = _reference_step(ref, opt_ref, x, y, lambda t: t.to(torch.bfloat16))
        assert torch.equal(_ws_step(runner, opt, x, y), expected), step
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    params = sum(p.numel() for p in model.parameters())
    assert runner.engine.streamer.mirror_bytes() == 2 * params


def test_a_write_through_data_between_steps_reaches_the_next_forward():
    """``p.data`` writes bump no version counter: the mirror is written again at each
    forward pass, so the next forward sees them (and so does eager PyTorch)."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", granularity="module", host_mirror=True)
    x, y = _batch(0)
    runner(x)  # the mirrors now hold the initial weights
    for m in (model, ref):
        with torch.no_grad():
            for p in m.parameters():
                p.data.mul_(0.5)
    got = F.cross_entropy(runner(x).flatten(0, 1), y.flatten())
    expected = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    assert torch.equal(got, expected)


def test_overlapped_updates_and_gradient_accumulation_with_the_mirror():
    make, kind = MODELS["gpt_tied"]
    make_opt = OPTIMIZERS["sgd_momentum"]
    ref, _, ref_losses = _run(make, kind, None, make_opt, steps=5, accum=2)
    model, runner, losses = _run(
        make,
        kind,
        "ws",
        make_opt,
        steps=5,
        accum=2,
        granularity="module",
        host_mirror=True,
        overlap_updates=True,
        prefetch_depth=2,
    )
    runner.engine.synchronize()
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)


def test_activation_checkpointing_recomputes_from_the_mirror():
    make, kind = MODELS["norm_dropout"]
    make_opt = OPTIMIZERS["adamw"]
    ref, _, ref_losses = _run(make, kind, None, make_opt, steps=4)
    model, _, losses = _run(
        make,
        kind,
        "ws",
        make_opt,
        steps=4,
        granularity="module",
        host_mirror=True,
        activation_checkpointing=True,
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)


def test_ignored_with_a_disk_store_says_so(tmp_path):
    with pytest.warns(UserWarning, match="host_mirror is ignored with a disk store"):
        runner = cstorch.compile(
            GPT(CFG), backend="ws", store="disk", store_dir=tmp_path, host_mirror=True
        )
        runner(_batch(0)[0])
    assert not runner.engine.streamer._mirror
    runner.engine.close()


def _updated_in_backward(make, kind, make_opt, steps, between=None):
    """Streamed training with the mirror written by the update (updates in the
    backward); ``between(model, step)`` runs after each step."""
    from test_update_in_backward import _streamed

    model, runner, _, losses = _streamed(
        make, kind, make_opt, steps, between=between, host_mirror=True
    )
    return model, runner, losses


@pytest.mark.parametrize("model_name", ["gpt_tied", "partly_frozen", "called_twice"])
def test_the_update_writes_the_mirror_and_the_forward_only_copies_it(model_name, monkeypatch):
    """With updates in the backward each share writes its masters into the mirrors
    (a tied weight into both units'): training equals eager torch bit for bit, and
    after the first step no forward fetch writes a mirror again."""
    from test_update_in_backward import MODELS as UIB_MODELS
    from test_update_in_backward import OPTIMIZERS as UIB_OPTIMIZERS
    from test_update_in_backward import _eager

    from weightstream.runtime import mirror as mirror_module

    make, kind = UIB_MODELS[model_name]
    ours, theirs = UIB_OPTIMIZERS["adamw"]
    ref, ref_losses = _eager(make, kind, theirs, 4)
    writes = []
    flatten = mirror_module.flatten

    def counting(tensors, out):
        writes.append(len(tensors))
        return flatten(tensors, out=out)

    monkeypatch.setattr(mirror_module, "flatten", counting)
    model, _, losses = _updated_in_backward(
        make, kind, ours, 4, between=lambda m, step: writes.append("step")
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    first_step = writes.index("step")
    assert first_step > 0  # the first forward wrote every mirror
    assert writes[first_step:] == ["step"] * 4  # later forwards only copied them


def test_writes_after_an_updated_step_reach_the_next_forward():
    """The update-written mirror is trusted only while each master's version counter
    and address are those it was written from: an in-place write under no_grad, a
    new ``.data`` and ``load_state_dict`` after a step are all seen (Note [host
    mirror])."""
    from test_update_in_backward import MODELS as UIB_MODELS
    from test_update_in_backward import OPTIMIZERS as UIB_OPTIMIZERS
    from test_update_in_backward import _batch as batch

    make, kind = UIB_MODELS["gpt_tied"]
    ours, theirs = UIB_OPTIMIZERS["adamw"]
    changes = {
        0: lambda p: p.mul_(0.5),
        1: lambda p: setattr(p, "data", p.data * 0.75),
        2: None,  # load_state_dict, below
    }
    saved = {}

    def between(model, step):
        with torch.no_grad():
            if step == 0:
                saved.update({k: v.clone() for k, v in model.state_dict().items()})
            if changes.get(step) is not None:
                for p in model.parameters():
                    changes[step](p)
            if step == 2:
                model.load_state_dict(saved)

    torch.manual_seed(0)
    ref = make()
    opt = theirs(list(ref.parameters()))
    ref_losses = []
    for step in range(4):
        x, y = batch(kind, step)
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.detach())
        between(ref, step)
    saved.clear()
    model, _, losses = _updated_in_backward(make, kind, ours, 4, between=between)
    assert torch.equal(losses, torch.stack(ref_losses))
    _assert_same_state(model, ref)


@pytest.mark.parametrize("overlap", [False, True])
def test_bf16_masters_are_the_mirror_with_no_second_copy(overlap):
    """Masters already in the compute dtype: the mirror is the masters themselves
    (Note [host mirror]); training stays bitwise eager's."""
    torch.manual_seed(0)
    ref = GPT(CFG).to(torch.bfloat16)
    torch.manual_seed(0)
    model = GPT(CFG).to(torch.bfloat16)
    runner = cstorch.compile(
        model, backend="ws", granularity="module", host_mirror=True, overlap_updates=overlap
    )
    opt_ref = cstorch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(4):
        x, y = _batch(step)
        for o, run in ((opt_ref, ref), (opt, runner)):
            F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten()).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    streamer = runner.engine.streamer
    assert streamer.mirror_bytes() == 0
    mirrors = [m for group in streamer._mirrors.values() for m in group.values()]
    # Every mirror but a tied weight's second one is the masters' own storage.
    assert sum(m.aliased for m in mirrors) >= len(mirrors) - 1
    assert all(m.aliased for m in mirrors[:1])

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
    # One mirror per unit and dtype group, as large as the unit's device copy.
    assert streamer._mirror and streamer.mirror_bytes() == sum(
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

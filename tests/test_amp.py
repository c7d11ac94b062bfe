"""weightstream.amp: GradScaler, optimizer_step, half types and the cbfloat16 format.

The references in this file are written out independently of the library:
the dynamic loss scale update is the reference algorithm in plain Python, and
cbfloat16 decoding and rounding are computed from the sign/exponent/mantissa
fields with Python integers and fractions.
"""

from __future__ import annotations

import copy
import math
import random
import struct
import warnings
from fractions import Fraction

import pytest
import torch
from torch import nn

import weightstream as cstorch
import weightstream.amp as amp
from weightstream.amp import GradScaler, OptState, optimizer_step, skip

INF = float("inf")
NAN = float("nan")


# =============================================================== helpers


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b) -> None:
    """Recursive bitwise equality of (nested) optimizer state."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    else:
        assert a == b


def inject(model: nn.Module, value: float) -> None:
    """Put one non-finite value into a gradient, as an overflow in backward would."""
    model[0].weight.grad[0, 0] = value


def reference_update(scale, steps, overflows, finite, *, spi, tol, lo, hi):
    """The reference dynamic loss scale update, written out (both comparisons strict)."""
    steps += 1
    overflows += 0 if finite else 1
    if overflows / steps > tol:
        scale /= 2
        steps = overflows = 0
    if steps > spi:
        scale *= 2
        steps = overflows = 0
    scale = max(min(scale, hi), lo)
    return scale, steps, overflows


class CountingScheduler:
    """A stand-in LR scheduler: advances only when the optimizer's step was not skipped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.last_epoch = 0

    def step(self):
        if not skip.step_was_skipped(self.optimizer):
            self.last_epoch += 1


# ==================================================== GradScaler: training

INJECTED = {3: INF, 4: NAN, 10: INF}
NUM_STEPS = 14

# (init_scale, steps_per_increase, overflow_tolerance, min_loss_scale, max_loss_scale)
CONFIGS = {
    "plain": (256.0, 2, 0.0, 2.0**-14, 2.0**15),
    "clamp_max": (256.0, 2, 0.0, 2.0**-14, 256.0),
    "clamp_min": (256.0, 2, 0.0, 256.0, 2.0**15),
    "tolerance": (256.0, 3, 0.25, 2.0**-14, 2.0**15),
}
# Scale after each update() for "plain", worked out by hand from the algorithm:
# growth on the 3rd step after a rescale (3 > 2), any overflow halves.
PLAIN_SCALES = [256, 256, 512, 256, 128, 128, 128, 256, 256, 256, 128, 128, 128, 256]


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_dynamic_scaling_skips_and_rescales_exactly(kind, config):
    init, spi, tol, lo, hi = CONFIGS[config]
    model = make_model()
    opt = make_optimizer(kind, model)
    sched = CountingScheduler(opt)
    x, y = make_data()
    scaler = GradScaler(
        loss_scale="dynamic",
        init_scale=init,
        steps_per_increase=spi,
        min_loss_scale=lo,
        max_loss_scale=hi,
        overflow_tolerance=tol,
    )

    # Reference: the same training without any scaling, skipping the same steps.
    ref_model = make_model()
    ref_opt = make_optimizer(kind, ref_model)

    expected_scale, steps, overflows = min(init, hi), 0, 0
    scales = []
    for i in range(NUM_STEPS):
        assert scaler.get_scale() == expected_scale
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if i in INJECTED:
            inject(model, INJECTED[i])
        before_params = params_of(model)
        before_state = copy.deepcopy(opt.state_dict())

        scaler.step(opt)
        sched.step()

        if i in INJECTED:
            assert skip.step_was_skipped(opt)
            for p, q in zip(model.parameters(), before_params):
                assert torch.equal(p, q)
            assert_same(opt.state_dict(), before_state)
        else:
            assert not skip.step_was_skipped(opt)
            assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before_params))
            ref_opt.zero_grad()
            loss_of(ref_model, x, y).backward()
            ref_opt.step()

        scaler.update()
        expected_scale, steps, overflows = reference_update(
            expected_scale, steps, overflows, i not in INJECTED, spi=spi, tol=tol, lo=lo, hi=hi
        )
        assert scaler.get_scale() == expected_scale, f"step {i}"
        scales.append(scaler.get_scale())

    if config == "plain":
        assert scales == PLAIN_SCALES
    assert scaler.get_num_skipped_steps() == len(INJECTED)
    assert sched.last_epoch == NUM_STEPS - len(INJECTED)
    assert scaler.state_dict() == {
        "loss_scale": expected_scale,
        "steps_since_rescale": steps,
        "overflows_since_rescale": overflows,
        "num_skipped_steps": len(INJECTED),
    }
    # Scaling by powers of two and back is exact: same weights as unscaled training.
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, cstorch.optim.SGD])
def test_a_plain_step_after_a_skipped_one_moves_the_schedule(optimizer):
    """A scaler step skipped (overflow), then optimizer.step() called directly: that step
    was taken, so the schedule moves (it stayed one step behind: 0, 0, 1)."""
    p = nn.Parameter(torch.zeros(3))
    opt = optimizer([p], lr=0.1)
    sched = cstorch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 10)
    scaler = GradScaler("dynamic", init_scale=8.0)
    epochs = []
    for i in range(3):
        opt.zero_grad()
        if i == 1:
            (p * 1.0).sum().backward()
            opt.step()
        else:
            scaler.scale((p * 1.0).sum()).backward()
            if i == 0:
                p.grad[0] = INF
            scaler.step(opt)
            scaler.update()
        sched.step()
        epochs.append(int(sched.last_epoch))
    assert epochs == [0, 1, 2]


def test_the_default_tolerance_is_the_seeds_5_percent():
    """Seed 003's table: overflow_tolerance defaults to 0.05 (the wider API reference
    says 0.0; the seeds win). One overflow after 20 clean steps (1/21 <= 0.05) skips
    its step and keeps the scale; one after 5 (1/6) halves it."""
    for clean, expected in [(20, 64.0), (5, 32.0)]:
        scaler = GradScaler("dynamic", init_scale=64.0, steps_per_increase=100)
        p = nn.Parameter(torch.zeros(3))
        opt = torch.optim.SGD([p], lr=1.0)
        for i in range(clean + 1):
            scaler.scale((p * 1.0).sum()).backward()
            if i == clean:
                p.grad[1] = INF
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.get_scale() == expected and scaler.get_num_skipped_steps() == 1


def test_tolerance_allows_some_overflows_without_halving():
    # tolerance 0.5: 1 overflow in 2 steps is not > 0.5, 2 in 3 is.
    scaler = GradScaler("dynamic", init_scale=64.0, steps_per_increase=100, overflow_tolerance=0.5)
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    for finite, expected in [(True, 64), (False, 64), (False, 32), (False, 16)]:
        scaler.scale((p * 1.0).sum()).backward()
        if not finite:
            p.grad[1] = INF
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == expected
        opt.zero_grad()


def test_first_step_skipped_leaves_empty_adamw_state():
    model = make_model()
    opt = make_optimizer("adamw", model)
    x, y = make_data()
    scaler = GradScaler("dynamic", init_scale=1024.0)
    before = params_of(model)
    scaler.scale(loss_of(model, x, y)).backward()
    inject(model, NAN)
    assert scaler.step(opt) is None
    scaler.update()
    assert opt.state_dict()["state"] == {}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == 512.0
    assert scaler.state_dict()["num_skipped_steps"] == 1


def test_global_norm_decides_for_all_unscaled_optimizers():
    model = make_model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    x, y = make_data()
    scaler = GradScaler("dynamic", init_scale=8.0)
    before = params_of(model)
    scaler.scale(loss_of(model, x, y)).backward()
    model[2].bias.grad[0] = INF  # only opt_b's gradients overflow
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    assert skip.step_was_skipped(opt_a) and skip.step_was_skipped(opt_b)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == 4.0
    assert not math.isfinite(scaler.global_norm)


def test_global_norm_overflow_of_finite_gradients_counts_as_nonfinite():
    # The decision is the finiteness of the float32 global norm, as in the
    # reference: finite gradients whose squared sum overflows are non-finite.
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("dynamic", init_scale=1.0)
    scaler.scale(p.sum()).backward()
    p.grad.fill_(1e20)
    scaler.step(opt)
    assert skip.step_was_skipped(opt)
    assert torch.equal(p.detach(), torch.zeros(2))


def test_matches_torch_grad_scaler_where_semantics_coincide():
    # With tolerance 0 the reference halves on any overflow and doubles after
    # more than N clean steps; torch doubles after growth_interval clean steps.
    spi = 2
    model, ref_model = make_model(), make_model()
    opt = make_optimizer("sgd", model)
    ref_opt = make_optimizer("sgd", ref_model)
    x, y = make_data()
    ours = GradScaler("dynamic", init_scale=256.0, steps_per_increase=spi)
    theirs = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=spi + 1)
    for i in range(NUM_STEPS):
        for m, o, s in ((model, opt, ours), (ref_model, ref_opt, theirs)):
            o.zero_grad()
            s.scale(loss_of(m, x, y)).backward()
            if i in INJECTED:
                inject(m, INJECTED[i])
            s.step(o)
            s.update()
        assert ours.get_scale() == theirs.get_scale(), f"step {i}"
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_static_power_of_two_scale_is_bitwise_unscaled_training(kind):
    x, y = make_data()
    runs = []
    for loss_scale in (None, 2.0**8):
        model = make_model()
        opt = make_optimizer(kind, model)
        scaler = GradScaler(loss_scale=loss_scale)
        for _ in range(5):
            opt.zero_grad()
            scaler.scale(loss_of(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        runs.append(params_of(model))
        assert scaler.state_dict() == {"loss_scale": 1.0 if loss_scale is None else loss_scale}
    for p, q in zip(*runs):
        assert torch.equal(p, q)


def test_static_scaling_does_not_skip():
    # Reference semantics: only dynamic scaling checks for non-finite
    # gradients; a static scaler always steps (and has no skip counter).
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(loss_scale=4.0)
    scaler.scale(p.sum()).backward()
    p.grad[0] = INF
    scaler.step(opt)
    scaler.update()
    assert not skip.step_was_skipped(opt)
    assert p[0].item() == -INF
    assert scaler.get_scale() == 4.0


def test_static_scale_multiplies_loss_and_gradients():
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(loss_scale=1000.0)
    scaled = scaler.scale((p * p).sum())
    assert scaled.item() == 5000.0
    scaled.backward()
    assert torch.equal(p.grad, torch.tensor([2000.0, 4000.0]))
    scaler.unscale_(opt)
    torch.testing.assert_close(p.grad, torch.tensor([2.0, 4.0]), rtol=1e-6, atol=0)


def test_no_scaling_returns_loss_unchanged():
    for loss_scale in (None, 1.0, 0.0):
        scaler = GradScaler(loss_scale=loss_scale)
        loss = torch.tensor(3.0)
        assert scaler.scale(loss) is loss
        assert not scaler.is_enabled()


def test_gradient_clipping_inside_dynamic_scaler():
    x, y = make_data()
    model, ref_model = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1.0)
    scaler = GradScaler("dynamic", init_scale=64.0, max_gradient_norm=0.01)
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    loss_of(ref_model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
    ref_opt.step()
    # Same coefficient max_norm / (norm + 1e-6); the norms are summed in a
    # different order, so the last bit may differ.
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ============================================== GradScaler: state and stages


def run_steps(scaler, p, opt, pattern):
    for finite in pattern:
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        if not finite:
            p.grad[0] = NAN
        scaler.step(opt)
        scaler.update()


def test_state_dict_round_trip_continues_identically():
    kwargs = dict(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=3)
    pattern_before = [True, True, False, True, True]
    pattern_after = [True, True, False, False, True, True, True, True, True]

    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.01)
    original = GradScaler(**kwargs)
    run_steps(original, p, opt, pattern_before)
    saved = copy.deepcopy(original.state_dict())
    assert saved == {
        "loss_scale": 2.0**9,
        "steps_since_rescale": 2,
        "overflows_since_rescale": 0,
        "num_skipped_steps": 1,
    }

    resumed = GradScaler(**kwargs)
    # Checkpoints of the reference system hold 0-d tensors: accept both.
    resumed.load_state_dict({k: torch.tensor(v) for k, v in saved.items()})
    assert resumed.state_dict() == saved

    q = nn.Parameter(p.detach().clone())
    opt_q = torch.optim.SGD([q], lr=0.01)
    run_steps(original, p, opt, pattern_after)
    run_steps(resumed, q, opt_q, pattern_after)
    assert resumed.state_dict() == original.state_dict()
    assert torch.equal(p, q)


def test_load_state_dict_rejects_bad_input():
    scaler = GradScaler("dynamic")
    with pytest.raises(ValueError, match="unknown keys"):
        scaler.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        scaler.load_state_dict({"loss_scale": -1.0})
    with pytest.raises(ValueError, match="non-negative integer"):
        scaler.load_state_dict({"num_skipped_steps": 1.5})
    with pytest.raises(TypeError, match="expects a dict"):
        scaler.load_state_dict([1.0])
    assert scaler.state_dict()["loss_scale"] == 2.0**15  # unchanged by the failures
    static = GradScaler(loss_scale=8.0)
    with pytest.warns(UserWarning, match="ignored"):
        static.load_state_dict({"loss_scale": 16.0, "num_skipped_steps": 3})
    assert static.state_dict() == {"loss_scale": 16.0}


def test_stage_machine():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("dynamic", init_scale=4.0)
    assert scaler.stage(opt) is OptState.READY
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    assert scaler.stage(opt) is OptState.UNSCALED
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="scale\\(\\) called after unscale_"):
        scaler.scale(p.sum())
    scaler.step(opt)
    assert scaler.stage(opt) is OptState.STEPPED
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    assert scaler.stage(opt) is OptState.READY
    # From the second iteration on, scale() marks known optimizers SCALED.
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    assert scaler.stage(opt) is OptState.SCALED
    scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="before any step"):
        scaler.update()
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=2.0)
    with pytest.raises(TypeError, match="Optimizer"):
        scaler.step(object())


def test_unscale_twice_is_an_error_without_scaling_too():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_scale=-2.0), ValueError, "loss_scale must be a finite number >= 0"),
        (dict(loss_scale=INF), ValueError, "loss_scale must be a finite number"),
        (dict(loss_scale="dynamc"), ValueError, 'None, a positive number or "dynamic"'),
        (dict(loss_scale="Dynamic"), ValueError, "did you mean"),
        (dict(loss_scale=True), TypeError, "loss_scale must be a number"),
        (
            dict(loss_scale="dynamic", init_scale=0.0),
            ValueError,
            "init_scale must be a finite number > 0",
        ),
        (dict(loss_scale="dynamic", init_scale=-1.0), ValueError, "init_scale"),
        (
            dict(loss_scale="dynamic", steps_per_increase=0),
            ValueError,
            "steps_per_increase must be >= 1",
        ),
        (
            dict(loss_scale="dynamic", steps_per_increase=2.5),
            TypeError,
            "steps_per_increase must be an int",
        ),
        (dict(loss_scale="dynamic", min_loss_scale=2.0**-20), ValueError, "2\\*\\*-14"),
        (
            dict(loss_scale="dynamic", min_loss_scale=8.0, max_loss_scale=4.0),
            ValueError,
            "larger than",
        ),
        (dict(loss_scale="dynamic", max_loss_scale=-4.0), ValueError, "max_loss_scale"),
        (dict(loss_scale="dynamic", overflow_tolerance=-0.1), ValueError, "overflow_tolerance"),
        (dict(loss_scale="dynamic", overflow_tolerance=None), TypeError, "overflow_tolerance"),
        (dict(loss_scale="dynamic", max_gradient_norm=-1.0), ValueError, "max_gradient_norm"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradScaler(**kwargs)


def test_dynamic_only_settings_warn_when_ignored():
    with pytest.warns(UserWarning, match="init_scale, steps_per_increase.*only apply to dynamic"):
        GradScaler(loss_scale=4.0, init_scale=8.0, steps_per_increase=3)
    with pytest.warns(UserWarning, match="overflow_tolerance"):
        GradScaler(overflow_tolerance=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradScaler("dynamic", init_scale=8.0, overflow_tolerance=0.1)


@pytest.mark.parametrize(
    "half, expected", [("float16", 2.0**15), ("bfloat16", 2.0**15), ("cbfloat16", 2.0**31)]
)
def test_default_scales_follow_half_dtype(half, expected):
    amp.set_half_dtype(half)
    scaler = GradScaler("dynamic")
    assert scaler.get_scale() == expected
    # max_loss_scale has the same default: a larger init_scale is capped.
    assert GradScaler("dynamic", init_scale=2.0**40).get_scale() == expected
    # Growth stops at the default maximum.
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    capped = GradScaler("dynamic", steps_per_increase=1)
    run_steps(capped, p, opt, [True, True])
    assert capped.get_scale() == expected


# ========================================================= optimizer_step


def manual_step(model, opt, x, y, *, norm=None, value=None):
    loss_of(model, x, y).backward()
    if norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
    if value is not None:
        torch.nn.utils.clip_grad_value_(model.parameters(), value)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("use_scaler", [False, True])
@pytest.mark.parametrize("clip", [dict(), dict(norm=0.05), dict(value=0.01)])
def test_optimizer_step_equals_manual_clipping(use_scaler, clip):
    x, y = make_data()
    model, ref_model = make_model(), make_model()
    opt, ref_opt = make_optimizer("sgd", model), make_optimizer("sgd", ref_model)
    scaler = GradScaler("dynamic", init_scale=2.0**10) if use_scaler else None
    for _ in range(3):
        optimizer_step(
            loss_of(model, x, y),
            opt,
            scaler,
            max_gradient_norm=clip.get("norm"),
            max_gradient_value=clip.get("value"),
        )
        assert all(p.grad is None for p in model.parameters())
        manual_step(ref_model, ref_opt, x, y, **clip)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    if use_scaler:
        assert scaler.state_dict()["steps_since_rescale"] == 3


def test_optimizer_step_skips_non_finite_loss():
    x, y = make_data()
    model = make_model()
    opt = make_optimizer("sgd", model)
    scaler = GradScaler("dynamic", init_scale=2.0**10)
    before = params_of(model)
    optimizer_step(loss_of(model, x, y) * INF, opt, scaler, max_gradient_norm=1.0)
    assert skip.step_was_skipped(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0**9
    # A following plain step clears the record.
    optimizer_step(loss_of(model, x, y), opt, None)
    assert not skip.step_was_skipped(opt)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_gradient_norm=1.0, max_gradient_value=1.0), ValueError, "mutually exclusive"),
        (dict(max_gradient_norm=-1.0), ValueError, "max_gradient_norm must be non-negative"),
        (dict(max_gradient_value=-0.5), ValueError, "max_gradient_value must be non-negative"),
        (dict(max_gradient_norm=NAN), ValueError, "non-negative"),
        (dict(max_gradient_value="1"), TypeError, "must be a number"),
        (dict(max_gradient_norm=True), TypeError, "must be a number"),
    ],
)
@pytest.mark.parametrize("use_scaler", [False, True])
def test_optimizer_step_errors_change_nothing(kwargs, error, match, use_scaler):
    x, y = make_data()
    model = make_model()
    opt = make_optimizer("sgd", model)
    scaler = GradScaler("dynamic") if use_scaler else None
    before = params_of(model)
    with pytest.raises(error, match=match):
        optimizer_step(loss_of(model, x, y), opt, scaler, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # backward never ran
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    if use_scaler:
        assert scaler.stage(opt) is OptState.READY


def test_optimizer_step_type_errors():
    model = make_model()
    opt = make_optimizer("sgd", model)
    with pytest.raises(TypeError, match="grad_scaler"):
        optimizer_step(torch.tensor(1.0), opt, torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="loss must be a tensor"):
        optimizer_step(1.0, opt, None)
    with pytest.raises(TypeError, match="optimizer"):
        optimizer_step(torch.tensor(1.0), model, None)


# ============================================================= half types


@pytest.mark.parametrize(
    "value, expected",
    [
        ("float16", torch.float16),
        (torch.float16, torch.float16),
        ("bfloat16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        ("cbfloat16", amp.cbfloat16),
        (amp.cbfloat16, amp.cbfloat16),
    ],
)
def test_set_and_get_half_dtype(value, expected):
    assert amp.set_half_dtype(value) == expected
    assert amp.get_half_dtype() == expected
    assert amp.half_dtype_setting.get() == expected


def test_default_half_dtype_is_float16():
    assert amp.HalfDtypeSetting().get() is torch.float16


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("float32", ValueError, "unknown half type"),
        ("CBFloat16", ValueError, "Did you mean 'cbfloat16'"),
        (torch.float32, ValueError, "not a 16-bit floating point type"),
        (16, TypeError, "expects a name or a torch dtype"),
    ],
)
def test_set_half_dtype_rejects(value, error, match):
    amp.set_half_dtype("bfloat16")
    with pytest.raises(error, match=match):
        amp.set_half_dtype(value)
    assert amp.get_half_dtype() is torch.bfloat16  # unchanged


# ============================================================ cbfloat16


def f32_from_bits(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def bits_from_f32(f: float) -> int:
    return struct.unpack("<I", struct.pack("<f", f))[0]


def f32_tensor(patterns: list[int]) -> torch.Tensor:
    """float32 tensor with exactly these bit patterns (NaN payloads included)."""
    signed = [u - (1 << 32) if u >= (1 << 31) else u for u in patterns]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def ref_decode(pattern: int) -> float:
    """cbfloat16 value of a 16-bit pattern, from its fields."""
    sign = -1.0 if pattern & 0x8000 else 1.0
    exponent = (pattern >> 9) & 0x3F
    mantissa = pattern & 0x1FF
    if exponent == 63:
        return sign * INF if mantissa == 0 else NAN
    if exponent == 0:  # denormal: 0.mantissa * 2**(1 - 31)
        return sign * math.ldexp(mantissa, 1 - 31 - 9)
    return sign * math.ldexp(512 + mantissa, exponent - 31 - 9)


def ref_round_bits(f: float) -> int:
    """Nearest cbfloat16 pattern to the float32 value f (not NaN), ties to even.

    Plain arithmetic on exact fractions: find the spacing of cbfloat16 values
    around |f|, round |f| / spacing to an integer (half to even), then build
    the fields.
    """
    sign = 0x8000 if math.copysign(1.0, f) < 0 else 0
    if math.isinf(f):
        return sign | 0x7E00
    a = Fraction(abs(f))
    if a < Fraction(1, 2**30):
        q_exp = 1 - 31 - 9  # denormal spacing 2**-39
    else:
        _, e = math.frexp(abs(f))  # |f| in [2**(e-1), 2**e)
        q_exp = (e - 1) - 9
    n = a / Fraction(2) ** q_exp
    k = math.floor(n)
    r = n - k
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and k % 2 == 1):
        k += 1
    if q_exp == 1 - 31 - 9 and k < 512:
        return sign | k  # denormal (or zero)
    if k == 1024:  # rounded up to the next power of two
        k, q_exp = 512, q_exp + 1
    exponent = q_exp + 9 + 31
    if exponent >= 63:
        return sign | 0x7E00  # overflow
    return sign | (exponent << 9) | (k - 512)


ALL_PATTERNS = list(range(1 << 16))


def is_nan_pattern(u: int) -> bool:
    return (u >> 9) & 0x3F == 63 and u & 0x1FF != 0


def test_decode_all_patterns():
    expected = [ref_decode(u) for u in ALL_PATTERNS]
    for bits in (
        torch.tensor(ALL_PATTERNS, dtype=torch.int32),
        torch.tensor([u - 65536 if u >= 32768 else u for u in ALL_PATTERNS], dtype=torch.int16),
        torch.tensor(ALL_PATTERNS, dtype=torch.int64),
    ):
        got = amp.cbfloat16_bits_to_float32(bits)
        assert got.dtype == torch.float32
        got_bits = (got.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()
        for u, value, g in zip(ALL_PATTERNS, expected, got_bits):
            if is_nan_pattern(u):
                assert math.isnan(f32_from_bits(g)), hex(u)
                assert g >> 31 == u >> 15, hex(u)  # sign kept
            else:
                assert g == bits_from_f32(value), hex(u)  # value and sign of zero


def test_bits_float_bits_round_trip_is_identity():
    bits = torch.tensor(ALL_PATTERNS, dtype=torch.int32)
    back = amp.float32_to_cbfloat16_bits(amp.cbfloat16_bits_to_float32(bits))
    assert back.dtype == torch.int16
    back = (back.to(torch.int32) & 0xFFFF).tolist()
    for u, b in zip(ALL_PATTERNS, back):
        if is_nan_pattern(u):
            # NaN stays NaN with its sign; the quiet bit is set.
            assert is_nan_pattern(b) and b >> 15 == u >> 15 and b & 0x100, hex(u)
            if u & 0x100:
                assert b == u
        else:
            assert b == u, hex(u)


def check_rounding(patterns: list[int]) -> None:
    x = f32_tensor(patterns)
    got_bits = (amp.float32_to_cbfloat16_bits(x).to(torch.int32) & 0xFFFF).tolist()
    got_values = amp.round_to_cbfloat16(x)
    assert got_values.dtype == torch.float32
    got_value_bits = (got_values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()
    for u, g, gv in zip(patterns, got_bits, got_value_bits):
        f = f32_from_bits(u)
        if math.isnan(f):
            assert is_nan_pattern(g) and g >> 15 == u >> 31, hex(u)
            assert math.isnan(f32_from_bits(gv))
            continue
        want = ref_round_bits(f)
        assert g == want, f"{f!r}: got {g:#06x}, want {want:#06x}"
        assert gv == bits_from_f32(ref_decode(want)), repr(f)


def test_rounding_random_inputs_over_whole_range():
    rng = random.Random(0)
    # Uniform bit patterns cover every float32 exponent (most flush to 0 or
    # overflow); a second set concentrates on the cbfloat16 range (2**-41 ..
    # 2**33) where rounding actually happens.
    patterns = [rng.getrandbits(32) for _ in range(10_000)]
    patterns += [
        (rng.getrandbits(1) << 31) | (rng.randint(86, 160) << 23) | rng.getrandbits(23)
        for _ in range(20_000)
    ]
    check_rounding(patterns)


def test_rounding_ties_and_their_neighbours():
    # Every midpoint between consecutive positive cbfloat16 values (exact in
    # float32: 10 significant bits), and the float32 values just below and
    # above it, including the midpoint between the largest finite value and
    # 2**32 (which rounds to infinity).
    patterns = []
    for u in range(0, 0x7E00):
        lo = Fraction(ref_decode(u))
        hi = Fraction(ref_decode(u + 1)) if u + 1 < 0x7E00 else Fraction(2**32)
        mid = bits_from_f32(float((lo + hi) / 2))
        patterns += [mid - 1, mid, mid + 1]
    check_rounding(patterns)
    # The negative side is the mirror image.
    x = f32_tensor(patterns)
    neg = amp.float32_to_cbfloat16_bits(-x).to(torch.int32) & 0xFFFF
    pos = amp.float32_to_cbfloat16_bits(x).to(torch.int32) & 0xFFFF
    assert torch.equal(neg, pos | 0x8000)


def test_rounding_edge_values():
    largest = (2 - 2**-9) * 2.0**31
    smallest = 2.0**-39
    values = [
        0.0,
        -0.0,
        INF,
        -INF,
        largest,
        -largest,
        largest + 2**8,  # next float32 above the largest finite value: rounds down
        (largest + 2.0**32) / 2,  # halfway to 2**32: ties to even -> inf
        2.0**32,
        -(2.0**32),
        3.4028234663852886e38,  # largest float32
        2.0**-30,  # smallest normal
        2.0**-30 - 2.0**-40,  # halfway between largest denormal and smallest normal
        smallest,
        smallest / 2,  # tie between 0 and 2**-39: to even -> 0
        -smallest / 2,
        smallest / 2 * (1 + 2**-23),  # just above half: -> 2**-39
        smallest / 2 * (1 - 2**-24),  # just below half: -> 0
        1.5 * smallest,  # tie between 1 and 2 quanta: -> 2 (even)
        2.5 * smallest,  # tie between 2 and 3 quanta: -> 2 (even)
        1e-45,  # float32 denormal
        1.0 + 2**-10,  # tie at 1: -> 1.0
        1.0 + 3 * 2**-10,  # tie: -> 1 + 2**-8
    ]
    patterns = [bits_from_f32(v) for v in values]
    patterns += [0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FBFFFFF]  # NaNs, incl. signalling
    check_rounding(patterns)
    got = amp.round_to_cbfloat16(torch.tensor(values[:10])).tolist()
    assert got[:10] == [0.0, -0.0, INF, -INF, largest, -largest, largest, INF, INF, -INF]
    assert math.copysign(1.0, got[1]) == -1.0


def test_rounding_accepts_half_inputs_and_keeps_shape():
    x = torch.randn(3, 5, dtype=torch.float32)
    expected = amp.round_to_cbfloat16(x.half().float())
    assert torch.equal(amp.round_to_cbfloat16(x.half()), expected)
    assert amp.float32_to_cbfloat16_bits(x.t()).shape == (5, 3)
    assert torch.equal(amp.round_to_cbfloat16(x.t()), amp.round_to_cbfloat16(x).t())


def test_conversion_type_errors():
    with pytest.raises(TypeError, match="float64 -> float32 -> cbfloat16 rounds twice"):
        amp.round_to_cbfloat16(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        amp.float32_to_cbfloat16_bits(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="use round_to_cbfloat16"):
        amp.cbfloat16_bits_to_float32(torch.zeros(2))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        amp.round_to_cbfloat16([1.0])


def test_cbfloat16_object():
    cb = amp.cbfloat16
    decode = amp.cbfloat16_bits_to_float32
    assert (cb.name, cb.bits, cb.exponent_bits, cb.mantissa_bits, cb.exponent_bias) == (
        "cbfloat16",
        16,
        6,
        9,
        31,
    )
    assert cb.max == decode(torch.tensor([0x7DFF])).item() == (2 - 2**-9) * 2.0**31
    assert cb.min == -cb.max
    assert cb.eps == decode(torch.tensor([0x3E01])).item() - 1.0 == 2.0**-9
    assert cb.smallest_normal == cb.tiny == decode(torch.tensor([0x0200])).item() == 2.0**-30
    assert cb.smallest_subnormal == decode(torch.tensor([1])).item() == 2.0**-39
    x = torch.randn(100) * 1e4
    assert torch.equal(cb.round(x), amp.round_to_cbfloat16(x))
    assert torch.equal(cb.from_bits(cb.to_bits(x)), cb.round(x))
    assert cb == amp.CBFloat16() and cb != torch.float16
    assert repr(cb) == "weightstream.amp.cbfloat16"
    assert amp.set_half_dtype("cbfloat16") is cb

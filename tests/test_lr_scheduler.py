"""Tests for ``weightstream.optim.lr_scheduler``.

Acceptance: every scheduler with a ``torch.optim.lr_scheduler`` counterpart matches it
over 1,000 steps where the semantics coincide (the argument mapping and each semantic
difference are stated next to the case); the others match their closed form written out
with ``math``. Then: ``configure_lr_scheduler`` (each rule, each error), skipped optimizer
steps, checkpoints, param-group tags, per-group scaling and the weight-decay schedulers.

Note [tolerances]
    Every comparison uses ``|ours - theirs| <= rtol * |theirs| + 2 ulp(peak)``, where
    ``peak`` is the largest value of the schedule.

    * ``2 ulp(peak)`` (absolute, about 3e-17 for a peak of 0.1): our closed forms call
      ``torch.cos`` / ``torch.pow`` on float64 tensors, torch's schedulers and the
      reference formulas below call ``math.cos`` / ``**`` on Python floats. On the same
      input the two libm implementations may differ in the last bit, and ``1 + cos(x)``
      near its zero turns that last bit into an absolute (not relative) error of the
      order of one ulp of the peak.
    * ``rtol = 0`` where torch evaluates the same closed form in the same order
      (CyclicLR, OneCycleLR, CosineAnnealingWarmRestarts, LambdaLR, ConstantLR).
    * ``rtol = RECURSIVE_RTOL = 1e-12`` where torch's ``get_lr`` is *recursive*
      (``lr_t = lr_{t-1} * factor_t``): each of the 1,000 steps rounds a multiplication
      and its factor (a few ulps, 2.2e-16 each), so the relative drift from the closed
      form is bounded by about 1000 * 4 * 1.1e-16 = 4.4e-13; 1e-12 is that bound
      rounded up. Measured drift is at most ~1e-14.
    * ``rtol = FORMULA_RTOL = 1e-14`` against the closed forms written out with
      ``math``: the same formula evaluated in a different order (and ``torch.pow`` vs
      ``**``) differs by a few ulps per operation; 1e-14 is ~45 ulps.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as tls

import weightstream.optim.lr_scheduler as wls
from weightstream.amp.skip import record_step

STEPS = 1000
LR = 0.1
RECURSIVE_RTOL = 1e-12
FORMULA_RTOL = 1e-14


# ---------------------------------------------------------------------------- helpers


def make_optimizer(lr: float = LR, **kwargs) -> torch.optim.SGD:
    """A one-group SGD; momentum so that torch's CyclicLR/OneCycleLR accept it."""
    return torch.optim.SGD(
        [torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9, weight_decay=0.01, **kwargs
    )


def tagged_optimizer() -> torch.optim.SGD:
    """Three groups: tagged 'embed', tagged 'body' and 'norm', and untagged."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    return torch.optim.SGD(
        [
            {"params": [params[0]], "tags": {"embed"}, "lr": 1.0, "adjust_learning_rate": 0.5},
            {
                "params": [params[1]],
                "tags": {"body", "norm"},
                "lr": 2.0,
                "adjust_learning_rate": 3.0,
            },
            {"params": [params[2]], "lr": 3.0},
        ],
        lr=LR,
        weight_decay=0.01,
    )


def trace(scheduler, optimizer, steps: int = STEPS, key: str = "lr", group: int = 0) -> list:
    """The value in ``group[key]`` after construction and after each of ``steps`` steps."""
    values = [optimizer.param_groups[group][key]]
    for _ in range(steps):
        scheduler.step()
        values.append(optimizer.param_groups[group][key])
    return values


def torch_trace(scheduler, optimizer, steps: int = STEPS) -> list:
    """Like :func:`trace`, calling ``optimizer.step()`` first as torch expects."""
    values = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        values.append(optimizer.param_groups[0]["lr"])
    return values


def assert_close(ours, expected, rtol: float) -> None:
    """See Note [tolerances]."""
    ours, expected = np.asarray(ours, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    peak = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(ours, expected, rtol=rtol, atol=2 * math.ulp(peak))


# ---------------------------------------------------------------------------- torch parity

# (id, our scheduler, torch scheduler, rtol). Each comment states the argument mapping
# and the semantic differences between the two.
TORCH_CASES = [
    # torch's ConstantLR multiplies the optimizer's lr by `factor` for `total_iters`
    # steps; ours holds an absolute value (`total_iters` only sizes it inside a
    # SequentialLR). They coincide for factor=1 ...
    (
        "ConstantLR",
        lambda o: wls.ConstantLR(o, LR, total_iters=5),
        lambda o: tls.ConstantLR(o, factor=1.0, total_iters=5),
        0.0,
    ),
    # ... and torch's factor window is our SequentialLR of two ConstantLR. torch undoes
    # the factor recursively (lr * 1/factor), hence the recursive tolerance.
    (
        "ConstantLR-window",
        lambda o: wls.SequentialLR(o, [wls.ConstantLR(o, LR / 3, 40), wls.ConstantLR(o, LR)], [40]),
        lambda o: tls.ConstantLR(o, factor=1 / 3, total_iters=40),
        RECURSIVE_RTOL,
    ),
    # torch decays the optimizer's lr to 0; ours goes from initial_learning_rate to
    # end_learning_rate: initial=lr, end=0. torch is recursive. (`cycle` has no torch
    # counterpart: see test_polynomial_closed_form.)
    (
        "PolynomialLR",
        lambda o: wls.PolynomialLR(o, LR, 0.0, total_iters=700, power=2.0),
        lambda o: tls.PolynomialLR(o, total_iters=700, power=2.0),
        RECURSIVE_RTOL,
    ),
    # torch's LinearLR takes factors of the optimizer's lr; ours takes the values:
    # initial = lr * start_factor, end = lr * end_factor (torch also restricts the
    # factors to [0, 1]). torch is recursive.
    (
        "LinearLR-warmup",
        lambda o: wls.LinearLR(o, LR * 0.25, LR, total_iters=300),
        lambda o: tls.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=300),
        RECURSIVE_RTOL,
    ),
    (
        "LinearLR-decay",
        lambda o: wls.LinearLR(o, LR, LR * 0.1, total_iters=600),
        lambda o: tls.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=600),
        RECURSIVE_RTOL,
    ),
    # torch multiplies by gamma every step; ours by decay_rate every total_iters steps:
    # total_iters=1, decay_rate=gamma. torch is recursive.
    (
        "ExponentialLR",
        lambda o: wls.ExponentialLR(o, LR, total_iters=1, decay_rate=0.995),
        lambda o: tls.ExponentialLR(o, gamma=0.995),
        RECURSIVE_RTOL,
    ),
    # With staircase, ExponentialLR(total_iters=k) is torch's StepLR(step_size=k).
    (
        "ExponentialLR-staircase",
        lambda o: wls.ExponentialLR(o, LR, total_iters=100, decay_rate=0.5, staircase=True),
        lambda o: tls.StepLR(o, step_size=100, gamma=0.5),
        RECURSIVE_RTOL,
    ),
    # Ours takes the initial lr explicitly and gamma has no default (torch: the
    # optimizer's lr and gamma=0.1). torch is recursive.
    (
        "StepLR",
        lambda o: wls.StepLR(o, LR, step_size=70, gamma=0.7),
        lambda o: tls.StepLR(o, step_size=70, gamma=0.7),
        RECURSIVE_RTOL,
    ),
    # Same mapping; a repeated milestone multiplies by gamma twice in both.
    (
        "MultiStepLR",
        lambda o: wls.MultiStepLR(o, LR, gamma=0.3, milestones=[100, 250, 250, 800]),
        lambda o: tls.MultiStepLR(o, milestones=[100, 250, 250, 800], gamma=0.3),
        RECURSIVE_RTOL,
    ),
    # torch's CosineAnnealingLR is a recursive approximation of the closed form ours
    # computes; both continue past T_max (1,000 steps cover more than three half periods).
    (
        "CosineAnnealingLR",
        lambda o: wls.CosineAnnealingLR(o, LR, T_max=300, eta_min=1e-3),
        lambda o: tls.CosineAnnealingLR(o, T_max=300, eta_min=1e-3),
        RECURSIVE_RTOL,
    ),
    # CosineDecayLR is torch's CosineAnnealingLR up to total_iters; after it ours holds
    # end_learning_rate while torch rises again (see test_cosine_decay_holds_the_end).
    (
        "CosineDecayLR",
        lambda o: wls.CosineDecayLR(o, LR, 1e-3, total_iters=STEPS),
        lambda o: tls.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-3),
        RECURSIVE_RTOL,
    ),
    # Same formula; torch tracks T_cur incrementally, ours derives it from the step.
    # (The reference accepts only T_mult=1; torch and ours any integer >= 1.)
    (
        "CosineAnnealingWarmRestarts",
        lambda o: wls.CosineAnnealingWarmRestarts(o, LR, T_0=64, eta_min=1e-3),
        lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=64, eta_min=1e-3),
        0.0,
    ),
    (
        "CosineAnnealingWarmRestarts-Tmult2",
        lambda o: wls.CosineAnnealingWarmRestarts(o, LR, T_0=10, T_mult=2, eta_min=1e-3),
        lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=2, eta_min=1e-3),
        0.0,
    ),
    (
        "CosineAnnealingWarmRestarts-Tmult3",
        lambda o: wls.CosineAnnealingWarmRestarts(o, LR, T_0=7, T_mult=3),
        lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=7, T_mult=3),
        0.0,
    ),
    # torch takes the lambda as an argument and calls it with the int epoch; ours takes
    # it from a subclass's set_lr_lambda() and calls it with the step as a float64
    # tensor, so it must use tensor-friendly ops (this one works with both).
    (
        "LambdaLR",
        lambda o: _DecayTimesRamp(o, LR),
        lambda o: tls.LambdaLR(o, lambda e: 0.99**e * (1 + e / 100)),
        0.0,
    ),
    # torch's MultiplicativeLR takes a per-step factor function and is recursive; ours
    # a constant coefficient in closed form.
    (
        "MultiplicativeLR",
        lambda o: wls.MultiplicativeLR(o, LR, coefficient=0.997),
        lambda o: tls.MultiplicativeLR(o, lambda e: 0.997),
        RECURSIVE_RTOL,
    ),
    # torch's children are recursive and restart at their closed form of step 0 at a
    # milestone; ours evaluate their closed form at t - milestone. Values map as above.
    (
        "SequentialLR",
        lambda o: wls.SequentialLR(
            o,
            [wls.LinearLR(o, LR * 0.1, LR, 100), wls.CosineAnnealingLR(o, LR, 900, eta_min=1e-4)],
            milestones=[100],
        ),
        lambda o: tls.SequentialLR(
            o,
            [tls.LinearLR(o, 0.1, 1.0, 100), tls.CosineAnnealingLR(o, T_max=900, eta_min=1e-4)],
            milestones=[100],
        ),
        RECURSIVE_RTOL,
    ),
    # torch steps every child, each multiplying the group's lr by its own factor; ours
    # multiplies s0(t) by s_k(t) / s_k.initial_value. They coincide when the later
    # schedules are multiplicative (here ExponentialLR). ChainedScheduler is our alias.
    (
        "ChainedScheduler",
        lambda o: wls.ChainedScheduler(
            [wls.LinearLR(o, LR * 0.2, LR, 50), wls.ExponentialLR(o, LR, 1, 0.998)]
        ),
        lambda o: tls.ChainedScheduler(
            [tls.LinearLR(o, 0.2, 1.0, 50), tls.ExponentialLR(o, 0.998)]
        ),
        RECURSIVE_RTOL,
    ),
    # torch's CyclicLR also cycles momentum (off here: ours schedules one key), takes a
    # custom scale_fn and per-group lists (ours: scalars, the three built-in modes).
    (
        "CyclicLR-triangular",
        lambda o: wls.CyclicLR(o, 0.01, LR, step_size_up=120, step_size_down=80),
        lambda o: tls.CyclicLR(o, 0.01, LR, 120, 80, cycle_momentum=False),
        0.0,
    ),
    (
        "CyclicLR-triangular2",
        lambda o: wls.CyclicLR(o, 0.01, LR, step_size_up=50, mode="triangular2"),
        lambda o: tls.CyclicLR(o, 0.01, LR, 50, mode="triangular2", cycle_momentum=False),
        0.0,
    ),
    (
        "CyclicLR-exp_range",
        lambda o: wls.CyclicLR(o, 0.01, LR, 60, 40, mode="exp_range", gamma=0.998),
        lambda o: tls.CyclicLR(
            o, 0.01, LR, 60, 40, mode="exp_range", gamma=0.998, cycle_momentum=False
        ),
        0.0,
    ),
    # Ours takes initial_learning_rate = torch's max_lr / div_factor and cycles no
    # momentum. torch's cycle ends at step total_steps - 1 (it raises past total_steps,
    # and step total_steps itself extrapolates back up the last phase); ours holds the
    # end from there (test_one_cycle_holds_after_total_steps): total_steps = 1001, so
    # the 1,000 steps compared are the cycle's.
    (
        "OneCycleLR-cos",
        lambda o: wls.OneCycleLR(o, LR / 25, LR, total_steps=STEPS + 1),
        lambda o: tls.OneCycleLR(o, LR, total_steps=STEPS + 1, cycle_momentum=False),
        0.0,
    ),
    (
        "OneCycleLR-linear-three-phase",
        lambda o: wls.OneCycleLR(
            o,
            LR / 10,
            LR,
            total_steps=STEPS + 1,
            pct_start=0.25,
            final_div_factor=100,
            three_phase=True,
            anneal_strategy="linear",
        ),
        lambda o: tls.OneCycleLR(
            o,
            LR,
            total_steps=STEPS + 1,
            pct_start=0.25,
            div_factor=10,
            final_div_factor=100,
            three_phase=True,
            anneal_strategy="linear",
            cycle_momentum=False,
        ),
        0.0,
    ),
]


class _DecayTimesRamp(wls.LambdaLR):
    def set_lr_lambda(self):
        return lambda t: 0.99**t * (1 + t / 100)


@pytest.mark.parametrize(
    ("ours", "theirs", "rtol"), [c[1:] for c in TORCH_CASES], ids=[c[0] for c in TORCH_CASES]
)
def test_matches_torch_over_1000_steps(ours, theirs, rtol):
    our_opt, torch_opt = make_optimizer(), make_optimizer()
    scheduler = ours(our_opt)
    reference = theirs(torch_opt)
    assert int(scheduler.last_epoch) == 0
    got = trace(scheduler, our_opt)
    assert_close(got, torch_trace(reference, torch_opt), rtol)
    assert scheduler.get_last_lr() == [got[-1]]
    assert int(scheduler.last_epoch) == STEPS
    assert all(type(v) is float for v in got)


# ---------------------------------------------------------------------------- closed forms


def _poly(t, init, end, total, power, cycle):
    if not cycle:
        return end if t >= total else (1 - t / total) ** power * (init - end) + end
    a = math.ceil((t + 1) / total)
    return (1 - t / (total * a)) ** power * (init - end) + end


CLOSED_FORMS = [
    (
        "PolynomialLR-end-power",
        lambda o: wls.PolynomialLR(o, 0.3, 0.02, total_iters=450, power=0.5),
        lambda t: _poly(t, 0.3, 0.02, 450, 0.5, False),
    ),
    (
        "PolynomialLR-cycle",
        lambda o: wls.PolynomialLR(o, 0.3, 0.02, total_iters=128, power=2.0, cycle=True),
        lambda t: _poly(t, 0.3, 0.02, 128, 2.0, True),
    ),
    (
        "LinearLR-cycle",
        lambda o: wls.LinearLR(o, 0.3, 0.02, total_iters=250, cycle=True),
        lambda t: _poly(t, 0.3, 0.02, 250, 1.0, True),
    ),
    (
        "ExponentialLR",
        lambda o: wls.ExponentialLR(o, 0.2, total_iters=50, decay_rate=0.3),
        lambda t: 0.2 * 0.3 ** (t / 50),
    ),
    (
        "InverseExponentialTimeDecayLR",
        lambda o: wls.InverseExponentialTimeDecayLR(o, 0.2, 1.5, total_iters=40, decay_rate=0.1),
        lambda t: 0.2 / (1 + 0.1 * (t**1.5 / 40)),
    ),
    (
        "InverseExponentialTimeDecayLR-staircase",
        lambda o: wls.InverseExponentialTimeDecayLR(
            o, 0.2, 1, total_iters=40, decay_rate=0.5, staircase=True
        ),
        lambda t: 0.2 / (1 + 0.5 * math.floor(t / 40)),
    ),
    (
        "InverseSquareRootDecayLR",
        lambda o: wls.InverseSquareRootDecayLR(o, 2.0, scale=0.05, warmup_steps=100),
        lambda t: 2.0 * 0.05 / math.sqrt(max(100, t)),
    ),
    (
        "InverseSquareRootDecayLR-defaults",
        lambda o: wls.InverseSquareRootDecayLR(o),
        lambda t: 1.0 / math.sqrt(max(1, t)),
    ),
    (
        "CosineDecayLR",
        lambda o: wls.CosineDecayLR(o, 0.2, 0.01, total_iters=400),
        lambda t: 0.01 + (0.2 - 0.01) * 0.5 * (1 + math.cos(math.pi * min(t, 400) / 400)),
    ),
    (
        "PiecewiseConstantLR",
        lambda o: wls.PiecewiseConstantLR(o, [0.1, 0.05, 0.01, 0.001], [100, 300, 700]),
        lambda t: [0.1, 0.05, 0.01, 0.001][sum(t >= m for m in (100, 300, 700))],
    ),
    (
        "MultiStepLR-unsorted",
        lambda o: wls.MultiStepLR(o, 0.2, gamma=0.5, milestones=[600, 200]),
        lambda t: 0.2 * 0.5 ** sum(t >= m for m in (200, 600)),
    ),
    (
        "LambdaLR-reference-default",
        lambda o: wls.LambdaLR(o, 0.2),
        lambda t: 0.2 * (t / 30) * 0.95**t,
    ),
    # A chained factor that is not multiplicative on its own: s0 * s1 / s1.initial.
    (
        "ChainedLR-cosine-times-step",
        lambda o: wls.ChainedLR(
            [wls.CosineDecayLR(o, 0.2, 0.02, 800), wls.StepLR(o, 0.5, step_size=150, gamma=0.8)]
        ),
        lambda t: (
            (0.02 + 0.18 * 0.5 * (1 + math.cos(math.pi * min(t, 800) / 800)))
            * (0.5 * 0.8 ** (t // 150) / 0.5)
        ),
    ),
    (
        "SequentialLR-three-stages",
        lambda o: wls.SequentialLR(
            o,
            [
                wls.LinearLR(o, 0.0, 0.2, 100),
                wls.ConstantLR(o, 0.2, 200),
                wls.ExponentialLR(o, 0.2, 100, 0.5),
            ],
            [100, 300],
        ),
        lambda t: 0.2 * t / 100 if t < 100 else 0.2 if t < 300 else 0.2 * 0.5 ** ((t - 300) / 100),
    ),
]


@pytest.mark.parametrize(
    ("ours", "formula"), [c[1:] for c in CLOSED_FORMS], ids=[c[0] for c in CLOSED_FORMS]
)
def test_matches_closed_form_over_1000_steps(ours, formula):
    optimizer = make_optimizer()
    got = trace(ours(optimizer), optimizer)
    assert_close(got, [formula(t) for t in range(STEPS + 1)], FORMULA_RTOL)


@pytest.mark.parametrize("t_mult", [2, 3, 10])
def test_warm_restarts_find_every_restart_far_out(t_mult):
    """The period index comes from a float log; check it at restarts up to ~1e11 steps."""
    optimizer = make_optimizer()
    scheduler = wls.CosineAnnealingWarmRestarts(optimizer, 1.0, T_0=7, T_mult=t_mult)
    state = scheduler.state_dict()
    for n in range(1, 12 if t_mult < 10 else 10):
        restart = 7 * (t_mult**n - 1) // (t_mult - 1)
        period = 7 * t_mult**n
        for t, t_cur in ((restart - 1, period // t_mult - 1), (restart, 0), (restart + 1, 1)):
            state["last_epoch"] = t - 1
            scheduler.load_state_dict(state)
            scheduler.step()
            t_i = period if t >= restart else period // t_mult
            expected = (1 + math.cos(math.pi * t_cur / t_i)) / 2
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-15), (n, t)


def test_cosine_decay_holds_the_end():
    optimizer = make_optimizer()
    got = trace(wls.CosineDecayLR(optimizer, 0.2, 0.01, total_iters=300), optimizer, 600)
    assert got[300:] == [0.01] * 301


def test_one_cycle_holds_after_total_steps():
    optimizer = make_optimizer()
    got = trace(wls.OneCycleLR(optimizer, 0.004, 0.1, total_steps=600), optimizer, 900)
    # torch's last step is 599 (the minimum) and it raises from step 600 on; the
    # minimum is held instead (it went back up the cosine).
    assert got[599] == pytest.approx(0.004 / 1e4, rel=1e-12)
    assert got[600:] == [got[599]] * 301


def test_construction_performs_one_step():
    optimizer = make_optimizer(lr=123.0)
    scheduler = wls.LinearLR(optimizer, 0.5, 1.0, 10)
    assert int(scheduler.last_epoch) == 0
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert scheduler.get_last_lr() == [0.5]
    assert wls.StepLR(optimizer, 1.0, 10, 0.1, param_group_tags=None).total_iters is None


def test_last_epoch_argument_starts_later():
    optimizer = make_optimizer()
    scheduler = wls.SequentialLR(
        optimizer, [wls.ConstantLR(optimizer, 0.1, 5), wls.ConstantLR(optimizer, 0.2)], [5], 9
    )
    assert int(scheduler.last_epoch) == 10
    assert optimizer.param_groups[0]["lr"] == 0.2


# ---------------------------------------------------------------------------- skipped steps


def _children_epochs(scheduler) -> list[int]:
    return [int(c.last_epoch) for c in getattr(scheduler, "_schedulers", [])]


@pytest.mark.parametrize(
    "make",
    [
        lambda o: wls.LinearLR(o, 0.01, 0.1, 50),
        lambda o: wls.SequentialLR(
            o, [wls.LinearLR(o, 0.01, 0.1, 5), wls.StepLR(o, 0.1, 3, 0.5)], [5]
        ),
        lambda o: wls.ChainedLR(
            [wls.LinearLR(o, 0.01, 0.1, 50), wls.ExponentialLR(o, 1.0, 1, 0.9)]
        ),
        lambda o: wls.ScalePerParamLR(o, wls.CosineDecayLR(o, 0.1, 0.0, 50)),
        lambda o: wls.CosineDecayWD(o, 0.1, 0.0, 50),
    ],
    ids=["plain", "sequential", "chained", "scale-per-param", "weight-decay"],
)
def test_skipped_optimizer_step_holds_the_schedule(make):
    optimizer = make_optimizer()
    scheduler = make(optimizer)
    key = scheduler.param_group_key
    for _ in range(7):
        scheduler.step()
    before = (
        int(scheduler.last_epoch),
        optimizer.param_groups[0][key],
        _children_epochs(scheduler),
    )
    record_step(optimizer, True)
    scheduler.step()
    scheduler.step()
    after = (int(scheduler.last_epoch), optimizer.param_groups[0][key], _children_epochs(scheduler))
    assert after == before
    assert scheduler.get_last_value() == [before[1]]
    record_step(optimizer, False)
    scheduler.step()
    assert int(scheduler.last_epoch) == before[0] + 1
    assert optimizer.param_groups[0][key] != before[1]


def test_skip_record_of_another_optimizer_does_not_hold():
    optimizer, other = make_optimizer(), make_optimizer()
    scheduler = wls.ExponentialLR(optimizer, 0.1, 1, 0.5)
    record_step(other, True)
    scheduler.step()
    assert int(scheduler.last_epoch) == 1


# ---------------------------------------------------------------------------- checkpoints

CHECKPOINT_CASES = {
    "PolynomialLR": lambda o: wls.PolynomialLR(o, 0.1, 0.001, 500, power=1.5),
    "CyclicLR": lambda o: wls.CyclicLR(o, 0.01, 0.1, 40, mode="triangular2"),
    "OneCycleLR": lambda o: wls.OneCycleLR(o, 0.004, 0.1, 600),
    "WarmRestarts": lambda o: wls.CosineAnnealingWarmRestarts(o, 0.1, 10, T_mult=2),
    "PiecewiseConstantLR": lambda o: wls.PiecewiseConstantLR(o, [0.1, 0.01, 0.001], [300, 400]),
    "SequentialLR": lambda o: wls.SequentialLR(
        o,
        [
            wls.LinearLR(o, 0.0, 0.1, 100),
            wls.CosineDecayLR(o, 0.1, 0.0, 300),
            wls.ConstantLR(o, 0.0),
        ],
        [100, 400],
    ),
    "ChainedLR": lambda o: wls.ChainedLR(
        [wls.CosineAnnealingLR(o, 0.1, 200), wls.StepLR(o, 1.0, 50, 0.9)]
    ),
    "ScalePerParamLR": lambda o: wls.ScalePerParamLR(
        o,
        wls.SequentialLR(
            o, [wls.LinearLR(o, 0.0, 0.1, 100), wls.ExponentialLR(o, 0.1, 100, 0.5)], [100]
        ),
    ),
    "SequentialWD": lambda o: wls.SequentialWD(
        o, [wls.ConstantWD(o, 0.0, 200), wls.LinearWD(o, 0.0, 0.1, 300)], [200]
    ),
}


@pytest.mark.parametrize("make", CHECKPOINT_CASES.values(), ids=CHECKPOINT_CASES.keys())
def test_state_dict_round_trip_continues_identically(make):
    running_opt = make_optimizer()
    running = make(running_opt)
    key = running.param_group_key
    for _ in range(357):
        running.step()
    state = running.state_dict()
    # Through torch.save / torch.load(weights_only=True): the state is plain data.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    resumed_opt = make_optimizer()
    resumed = make(resumed_opt)
    resumed.load_state_dict(loaded)
    assert int(resumed.last_epoch) == 357
    assert _children_epochs(resumed) == _children_epochs(running)
    expected = trace(running, running_opt, 300, key=key)[1:]
    assert int(state["last_epoch"]) == 357, "the state dict must not follow the scheduler"
    assert trace(resumed, resumed_opt, 300, key=key)[1:] == expected


def test_load_state_dict_rejects_foreign_state():
    optimizer = make_optimizer()
    sequential = CHECKPOINT_CASES["SequentialLR"](optimizer)
    with pytest.raises(ValueError, match="3 nested schedulers"):
        sequential.load_state_dict(wls.StepLR(optimizer, 0.1, 5, 0.5).state_dict())
    with pytest.raises(ValueError, match="last_epoch"):
        wls.StepLR(optimizer, 0.1, 5, 0.5).load_state_dict({"foo": 1})


def test_load_state_dict_rejects_another_kind_of_scheduler():
    optimizer = make_optimizer()
    polynomial = wls.PolynomialLR(optimizer, 0.1, 0.0, 10)
    with pytest.raises(
        ValueError, match=r"different kind of scheduler \(unexpected keys \['gamma'"
    ):
        polynomial.load_state_dict(wls.StepLR(optimizer, 0.1, 5, 0.5).state_dict())
    assert polynomial.total_iters == 10, "a refused state dict must change nothing"


def test_refused_nested_state_changes_nothing():
    optimizer = make_optimizer()
    sequential = CHECKPOINT_CASES["SequentialLR"](optimizer)
    for _ in range(150):
        sequential.step()
    state = sequential.state_dict()
    state["last_epoch"] = 10
    state["_schedulers"][0]["last_epoch"] = 10
    state["_schedulers"][2] = wls.StepLR(optimizer, 0.1, 5, 0.5).state_dict()
    with pytest.raises(
        ValueError, match=r"ConstantLR\.load_state_dict: the state dict comes from a different kind"
    ):
        sequential.load_state_dict(state)
    assert int(sequential.last_epoch) == 150
    assert _children_epochs(sequential) == [150, 50, 0]


def test_load_state_dict_accepts_int_step():
    optimizer = make_optimizer()
    scheduler = wls.StepLR(optimizer, 1.0, 10, 0.5)
    state = scheduler.state_dict()
    state["last_epoch"] = 25
    scheduler.load_state_dict(state)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.25


# ---------------------------------------------------------------------------- tags & scaling


def test_param_group_tags_select_groups():
    optimizer = tagged_optimizer()
    embed = wls.ConstantLR(optimizer, 0.5, param_group_tags="embed")
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 2.0, 3.0]
    assert embed.get_last_lr() == [0.5, None, None]
    untagged = wls.ExponentialLR(optimizer, 0.8, 1, 0.5, param_group_tags=[None])
    body_and_embed = wls.ConstantLR(optimizer, 0.25, param_group_tags=["norm", "embed"])
    untagged.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25, 0.4]
    assert body_and_embed.get_last_lr() == [0.25, 0.25, None]
    # A weight-decay schedule on other groups leaves the learning rates alone.
    wls.ConstantWD(optimizer, 0.5, param_group_tags="body")
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.5, 0.01]
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25, 0.4]


def test_param_group_tags_errors():
    optimizer = tagged_optimizer()
    with pytest.raises(ValueError, match=r"select no param group.*'body', 'embed', 'norm'"):
        wls.ConstantLR(optimizer, 0.1, param_group_tags="head")
    with pytest.raises(ValueError, match="duplicates"):
        wls.ConstantLR(optimizer, 0.1, param_group_tags=["embed", "embed"])
    with pytest.raises(ValueError, match="empty"):
        wls.ConstantLR(optimizer, 0.1, param_group_tags=[])
    with pytest.raises(TypeError, match="entries must be strings"):
        wls.ConstantLR(optimizer, 0.1, param_group_tags=[1])
    with pytest.raises(ValueError, match="same param_group_tags"):
        wls.SequentialLR(
            optimizer,
            [
                wls.ConstantLR(optimizer, 0.1, 5, "embed"),
                wls.ConstantLR(optimizer, 0.1, None, "body"),
            ],
            [5],
        )


def test_composite_takes_the_tags_of_its_children():
    optimizer = tagged_optimizer()
    sequential = wls.SequentialLR(
        optimizer,
        [wls.ConstantLR(optimizer, 0.1, 5, "embed"), wls.ConstantLR(optimizer, 0.2, None, "embed")],
        [5],
    )
    assert sequential.param_group_tags == frozenset({"embed"})
    for _ in range(5):
        sequential.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.2, 2.0, 3.0]


def test_scale_per_param_multiplies_by_each_groups_factor():
    optimizer = tagged_optimizer()
    inner = wls.CosineDecayLR(optimizer, 0.2, 0.0, 100)
    scaled = wls.ScalePerParamLR(optimizer, inner)
    assert scaled.scheduler is inner
    for step in range(101):
        base = 0.2 * 0.5 * (1 + math.cos(math.pi * min(step, 100) / 100))
        expected = [base * 0.5, base * 3.0, base * 1.0]
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(expected, rel=1e-14)
        assert scaled.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
        scaled.step()


def test_scale_per_param_weight_decay_reads_its_own_key():
    optimizer = tagged_optimizer()
    optimizer.param_groups[2]["adjust_weight_decay"] = 0.0
    wls.ScalePerParamWD(optimizer, wls.ConstantWD(optimizer, 0.1))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0]


def test_scale_per_param_rejects_non_numeric_factor():
    optimizer = tagged_optimizer()
    optimizer.param_groups[1]["adjust_learning_rate"] = "3"
    with pytest.raises(TypeError, match="param group 1 has adjust_learning_rate='3'"):
        wls.ScalePerParamLR(optimizer, wls.ConstantLR(optimizer, 0.1))


# ---------------------------------------------------------------------------- weight decay

# (WD class, its kwargs, LR class, the same kwargs under the LR names)
WD_PAIRS = [
    (wls.ConstantWD, {"val": 0.03}, wls.ConstantLR, {"learning_rate": 0.03}),
    (
        wls.PolynomialWD,
        {"initial_val": 0.1, "end_val": 0.01, "total_iters": 90, "power": 2.0},
        wls.PolynomialLR,
        {"initial_learning_rate": 0.1, "end_learning_rate": 0.01, "total_iters": 90, "power": 2.0},
    ),
    (
        wls.LinearWD,
        {"initial_val": 0.0, "end_val": 0.1, "total_iters": 90},
        wls.LinearLR,
        {"initial_learning_rate": 0.0, "end_learning_rate": 0.1, "total_iters": 90},
    ),
    (
        wls.ExponentialWD,
        {"initial_val": 0.1, "total_iters": 30, "decay_rate": 0.5},
        wls.ExponentialLR,
        {"initial_learning_rate": 0.1, "total_iters": 30, "decay_rate": 0.5},
    ),
    (
        wls.InverseExponentialTimeDecayWD,
        {"initial_val": 0.1, "step_exponent": 2, "total_iters": 30, "decay_rate": 0.5},
        wls.InverseExponentialTimeDecayLR,
        {"initial_learning_rate": 0.1, "step_exponent": 2, "total_iters": 30, "decay_rate": 0.5},
    ),
    (
        wls.InverseSquareRootDecayWD,
        {"initial_val": 0.1, "warmup_steps": 20},
        wls.InverseSquareRootDecayLR,
        {"initial_learning_rate": 0.1, "warmup_steps": 20},
    ),
    (
        wls.CosineDecayWD,
        {"initial_val": 0.1, "end_val": 0.0, "total_iters": 90},
        wls.CosineDecayLR,
        {"initial_learning_rate": 0.1, "end_learning_rate": 0.0, "total_iters": 90},
    ),
    (
        wls.PiecewiseConstantWD,
        {"vals": [0.1, 0.05], "milestones": [60]},
        wls.PiecewiseConstantLR,
        {"learning_rates": [0.1, 0.05], "milestones": [60]},
    ),
    (
        wls.MultiStepWD,
        {"initial_val": 0.1, "gamma": 0.5, "milestones": [30, 60]},
        wls.MultiStepLR,
        {"initial_learning_rate": 0.1, "gamma": 0.5, "milestones": [30, 60]},
    ),
    (
        wls.StepWD,
        {"initial_val": 0.1, "step_size": 25, "gamma": 0.5},
        wls.StepLR,
        {"initial_learning_rate": 0.1, "step_size": 25, "gamma": 0.5},
    ),
    (
        wls.CosineAnnealingWD,
        {"initial_val": 0.1, "T_max": 40, "eta_min": 0.01},
        wls.CosineAnnealingLR,
        {"initial_learning_rate": 0.1, "T_max": 40, "eta_min": 0.01},
    ),
    (
        wls.CosineAnnealingWarmRestartsWD,
        {"initial_val": 0.1, "T_0": 10, "T_mult": 2},
        wls.CosineAnnealingWarmRestarts,
        {"initial_learning_rate": 0.1, "T_0": 10, "T_mult": 2},
    ),
    (wls.LambdaWD, {"initial_val": 0.1}, wls.LambdaLR, {"initial_learning_rate": 0.1}),
    (
        wls.MultiplicativeWD,
        {"initial_val": 0.1, "coefficient": 0.97},
        wls.MultiplicativeLR,
        {"initial_learning_rate": 0.1, "coefficient": 0.97},
    ),
    (
        wls.CyclicWD,
        {"base_val": 0.01, "max_val": 0.1, "step_size_up": 15},
        wls.CyclicLR,
        {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 15},
    ),
    (
        wls.OneCycleWD,
        {"initial_val": 0.01, "max_val": 0.1, "total_steps": 80},
        wls.OneCycleLR,
        {"initial_learning_rate": 0.01, "max_lr": 0.1, "total_steps": 80},
    ),
]


@pytest.mark.parametrize(
    ("wd_cls", "wd_kwargs", "lr_cls", "lr_kwargs"), WD_PAIRS, ids=[p[0].__name__ for p in WD_PAIRS]
)
def test_weight_decay_scheduler_follows_its_lr_twin(wd_cls, wd_kwargs, lr_cls, lr_kwargs):
    wd_opt, lr_opt = make_optimizer(), make_optimizer()
    wd = wd_cls(wd_opt, **wd_kwargs)
    assert isinstance(wd, wls.WDScheduler) and wd.param_group_key == "weight_decay"
    wd_values = trace(wd, wd_opt, 100, key="weight_decay")
    assert wd_values == trace(lr_cls(lr_opt, **lr_kwargs), lr_opt, 100)
    assert wd_opt.param_groups[0]["lr"] == LR, "a WD scheduler must leave lr alone"


def test_weight_decay_composites():
    optimizer = make_optimizer()
    chained = wls.ChainedWD(
        [wls.ConstantWD(optimizer, 0.1), wls.ExponentialWD(optimizer, 1.0, 1, 0.5)]
    )
    chained.step()
    chained.step()
    assert optimizer.param_groups[0]["weight_decay"] == 0.025
    assert optimizer.param_groups[0]["lr"] == LR
    with pytest.raises(
        ValueError, match="schedules 'lr' but SequentialWD schedules 'weight_decay'"
    ):
        wls.SequentialWD(
            optimizer, [wls.ConstantWD(optimizer, 0.1, 5), wls.ConstantLR(optimizer, 0.1)], [5]
        )


# ---------------------------------------------------------------------------- configure


def _kinds(scheduler) -> list[str]:
    return [type(s).__name__ for s in scheduler._schedulers]


@pytest.mark.parametrize("value", [0.01, 1, "1e-2", "0.01"])
def test_configure_number_gives_constant(value):
    optimizer = make_optimizer()
    scheduler = wls.configure_lr_scheduler(optimizer, value)
    assert type(scheduler) is wls.ConstantLR
    assert optimizer.param_groups[0]["lr"] == float(value)


def test_configure_none_gives_none():
    assert wls.configure_lr_scheduler(make_optimizer(), None) is None


@pytest.mark.parametrize("name", ["CosineDecay", "cosinedecaylr", "COSINEDECAY", "CosineDecayLR"])
def test_configure_dict_matches_name_case_insensitively(name):
    optimizer = make_optimizer()
    config = {
        "scheduler": name,
        "initial_learning_rate": 0.2,
        "end_learning_rate": 0.0,
        "total_iters": 10,
    }
    original = copy.deepcopy(config)
    scheduler = wls.configure_lr_scheduler(optimizer, config)
    assert type(scheduler) is wls.CosineDecayLR
    assert scheduler.total_iters == 10 and optimizer.param_groups[0]["lr"] == 0.2
    assert config == original, "the caller's config must not be modified"


def test_configure_finds_names_without_lr_suffix_and_user_subclasses():
    optimizer = make_optimizer()
    assert (
        type(
            wls.configure_lr_scheduler(
                optimizer,
                {
                    "scheduler": "CosineAnnealingWarmRestarts",
                    "initial_learning_rate": 0.1,
                    "T_0": 5,
                },
            )
        )
        is wls.CosineAnnealingWarmRestarts
    )
    assert (
        type(
            wls.configure_lr_scheduler(
                optimizer, {"scheduler": "cyclic", "base_lr": 0.01, "max_lr": 0.1}
            )
        )
        is wls.CyclicLR
    )
    scheduler = wls.configure_lr_scheduler(optimizer, {"scheduler": "halving", "every": 4})
    assert type(scheduler) is HalvingLR
    for _ in range(8):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.25


class HalvingLR(wls.LRScheduler):
    """A custom scheduler as the seed shows it: store, super().__init__, closed form."""

    def __init__(self, optimizer, every: int, param_group_tags=None):
        self.every = every
        super().__init__(
            optimizer, total_iters=None, last_epoch=-1, param_group_tags=param_group_tags
        )

    def _get_closed_form_lr(self) -> torch.Tensor:
        return torch.pow(0.5, torch.div(self.last_epoch, self.every, rounding_mode="floor"))


def test_configure_list_gives_sequential_with_running_sum_milestones():
    optimizer = make_optimizer()
    config = [
        {
            "scheduler": "Linear",
            "initial_learning_rate": 0.0,
            "end_learning_rate": 0.1,
            "total_iters": 100,
        },
        {"scheduler": "Constant", "learning_rate": 0.1, "total_iters": 200},
        {
            "scheduler": "CosineDecay",
            "initial_learning_rate": 0.1,
            "end_learning_rate": 0.0,
            "total_iters": 50,
        },
    ]
    scheduler = wls.configure_lr_scheduler(optimizer, config)
    assert type(scheduler) is wls.SequentialLR
    assert scheduler._milestones == [100, 300]
    assert _kinds(scheduler) == ["LinearLR", "ConstantLR", "CosineDecayLR"]
    assert scheduler.total_iters == 350
    manual_opt = make_optimizer()
    manual = wls.SequentialLR(
        manual_opt,
        [
            wls.LinearLR(manual_opt, 0.0, 0.1, 100),
            wls.ConstantLR(manual_opt, 0.1, 200),
            wls.CosineDecayLR(manual_opt, 0.1, 0.0, 50),
        ],
        [100, 300],
    )
    assert trace(scheduler, optimizer, 400) == trace(manual, manual_opt, 400)


def test_configure_sequential_needs_total_iters_on_all_but_the_last():
    optimizer = make_optimizer()
    config = [
        {
            "scheduler": "Linear",
            "initial_learning_rate": 0.0,
            "end_learning_rate": 0.1,
            "total_iters": 10,
        },
        {"scheduler": "Step", "initial_learning_rate": 0.1, "step_size": 5, "gamma": 0.5},
        {"scheduler": "Constant", "learning_rate": 0.01},
    ]
    with pytest.raises(ValueError, match=r"learning_rate\[1\] \(StepLR\) has no total_iters"):
        wls.configure_lr_scheduler(optimizer, config)
    # The last entry needs none.
    assert type(wls.configure_lr_scheduler(optimizer, [config[0], config[2]])) is wls.SequentialLR


@pytest.mark.parametrize("main", ["chained", "ChainedLR", "CHAINED"])
def test_configure_main_scheduler_chained(main):
    optimizer = make_optimizer()
    config = [
        {
            "scheduler": "Linear",
            "initial_learning_rate": 0.02,
            "end_learning_rate": 0.1,
            "total_iters": 10,
        },
        {
            "scheduler": "Exponential",
            "initial_learning_rate": 1.0,
            "total_iters": 1,
            "decay_rate": 0.9,
            "main_scheduler": main,
        },
    ]
    scheduler = wls.configure_lr_scheduler(optimizer, config)
    assert type(scheduler) is wls.ChainedLR
    for _ in range(20):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**20, rel=1e-14)


def test_configure_main_scheduler_errors():
    optimizer = make_optimizer()
    a = {"scheduler": "Constant", "learning_rate": 0.1, "total_iters": 5}
    with pytest.raises(ValueError, match="disagree on main_scheduler"):
        wls.configure_lr_scheduler(
            optimizer, [dict(a, main_scheduler="chained"), dict(a, main_scheduler="sequential")]
        )
    with pytest.raises(ValueError, match="main_scheduler='parallel'; use 'chained'"):
        wls.configure_lr_scheduler(optimizer, [dict(a, main_scheduler="parallel"), a])
    with pytest.raises(ValueError, match="cannot be combined with adjust_learning_rate"):
        wls.configure_lr_scheduler(
            optimizer, [dict(a, main_scheduler="chained"), a], {"Linear": 0.5}
        )


def test_configure_adjust_learning_rate_wraps_in_scale_per_param():
    optimizer = tagged_optimizer()
    single = wls.configure_lr_scheduler(optimizer, 0.2, adjust_learning_rate={"embedding": 0.5})
    assert type(single) is wls.ScalePerParamLR and type(single.scheduler) is wls.ConstantLR
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.6000000000000001, 0.2]
    config = [
        {"scheduler": "Constant", "learning_rate": 0.1, "total_iters": 5},
        {"scheduler": "Constant", "learning_rate": 0.2},
    ]
    sequence = wls.configure_lr_scheduler(optimizer, config, adjust_learning_rate={"x": 2.0})
    assert type(sequence) is wls.ScalePerParamLR and type(sequence.scheduler) is wls.SequentialLR


@pytest.mark.parametrize(
    ("entry", "retired", "replacement"),
    [
        (
            {
                "scheduler": "Polynomial",
                "initial_learning_rate": 0.1,
                "end_learning_rate": 0.0,
                "steps": 5,
            },
            "steps",
            "total_iters",
        ),
        (
            {
                "scheduler": "CosineDecay",
                "initial_learning_rate": 0.1,
                "end_learning_rate": 0.0,
                "decay_steps": 5,
            },
            "decay_steps",
            "total_iters",
        ),
        (
            {"scheduler": "Exponential", "learning_rate": 0.1, "total_iters": 5, "decay_rate": 0.5},
            "learning_rate",
            "initial_learning_rate",
        ),
        (
            {"scheduler": "Step", "base_lr": 0.1, "step_size": 5, "gamma": 0.5},
            "base_lr",
            "initial_learning_rate",
        ),
        ({"scheduler": "Cyclic", "learning_rate": 0.01, "max_lr": 0.1}, "learning_rate", "base_lr"),
        (
            {"scheduler": "PiecewiseConstant", "values": [0.1, 0.01], "milestones": [5]},
            "values",
            "learning_rates",
        ),
        (
            {"scheduler": "PiecewiseConstant", "learning_rates": [0.1, 0.01], "boundaries": [5]},
            "boundaries",
            "milestones",
        ),
        (
            {
                "scheduler": "MultiStep",
                "initial_learning_rate": 0.1,
                "gamma": 0.5,
                "boundaries": [5],
            },
            "boundaries",
            "milestones",
        ),
    ],
)
def test_configure_retired_aliases_name_the_replacement(entry, retired, replacement):
    with pytest.raises(
        ValueError, match=f"'{retired}' is a retired name; rename it to '{replacement}'"
    ):
        wls.configure_lr_scheduler(make_optimizer(), entry)


def test_configure_unknown_and_missing_keys():
    optimizer = make_optimizer()
    with pytest.raises(
        ValueError,
        match=r"unknown key\(s\) \['t_max'\].*takes \['initial_learning_rate', 'T_max', 'eta_min', 'param_group_tags'\].*'t_max' -> 'T_max'",
    ):
        wls.configure_lr_scheduler(
            optimizer, {"scheduler": "CosineAnnealing", "initial_learning_rate": 0.1, "t_max": 5}
        )
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['warmup'\]"):
        wls.configure_lr_scheduler(
            optimizer, {"scheduler": "Constant", "learning_rate": 0.1, "warmup": 3}
        )
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['gamma'\]"):
        wls.configure_lr_scheduler(
            optimizer, {"scheduler": "Step", "initial_learning_rate": 0.1, "step_size": 5}
        )


def test_configure_shape_errors():
    optimizer = make_optimizer()
    with pytest.raises(ValueError, match=r"unknown scheduler 'warmup'.*'CosineDecayLR'"):
        wls.configure_lr_scheduler(optimizer, {"scheduler": "warmup"})
    with pytest.raises(ValueError, match="no 'scheduler' key"):
        wls.configure_lr_scheduler(optimizer, {"learning_rate": 0.1})
    with pytest.raises(TypeError, match="must be a scheduler name"):
        wls.configure_lr_scheduler(optimizer, {"scheduler": 3})
    with pytest.raises(ValueError, match="wraps other scheduler objects"):
        wls.configure_lr_scheduler(optimizer, {"scheduler": "Sequential", "milestones": [1]})
    with pytest.raises(ValueError, match="'fast' is not a number"):
        wls.configure_lr_scheduler(optimizer, "fast")
    with pytest.raises(TypeError, match="got the bool"):
        wls.configure_lr_scheduler(optimizer, True)
    with pytest.raises(ValueError, match="empty list"):
        wls.configure_lr_scheduler(optimizer, [])
    with pytest.raises(TypeError, match=r"learning_rate\[1\] must be a dict"):
        wls.configure_lr_scheduler(
            optimizer, [{"scheduler": "Constant", "learning_rate": 0.1}, 0.2]
        )
    with pytest.raises(TypeError, match="must be a number, a dict or a list"):
        wls.configure_lr_scheduler(optimizer, object())


def test_configure_passes_param_group_tags():
    optimizer = tagged_optimizer()
    config = [
        {
            "scheduler": "Constant",
            "learning_rate": 0.1,
            "total_iters": 2,
            "param_group_tags": "embed",
        },
        {"scheduler": "Constant", "learning_rate": 0.2, "param_group_tags": "embed"},
    ]
    scheduler = wls.configure_lr_scheduler(optimizer, config)
    scheduler.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.2, 2.0, 3.0]


# ---------------------------------------------------------------------------- argument errors

ARGUMENT_ERRORS = [
    (
        "not-an-optimizer",
        lambda o: wls.ConstantLR(object(), 0.1),
        TypeError,
        "must be a torch.optim.Optimizer",
    ),
    (
        "total_iters-zero",
        lambda o: wls.PolynomialLR(o, 0.1, 0.0, 0),
        ValueError,
        "total_iters must be >= 1",
    ),
    (
        "step_size-str",
        lambda o: wls.StepLR(o, 0.1, "10", 0.5),
        TypeError,
        "step_size must be an integer",
    ),
    (
        "lr-str",
        lambda o: wls.ExponentialLR(o, "0.1", 1, 0.5),
        TypeError,
        "initial_learning_rate must be a real number",
    ),
    (
        "wd-arg-names",
        lambda o: wls.ExponentialWD(o, "0.1", 1, 0.5),
        TypeError,
        "initial_val must be a real number",
    ),
    (
        "piecewise-count",
        lambda o: wls.PiecewiseConstantLR(o, [0.1, 0.2], [5, 10]),
        ValueError,
        "one more value than milestones",
    ),
    (
        "piecewise-order",
        lambda o: wls.PiecewiseConstantLR(o, [0.1, 0.2, 0.3], [10, 5]),
        ValueError,
        "strictly increasing",
    ),
    (
        "warmup-zero",
        lambda o: wls.InverseSquareRootDecayLR(o, warmup_steps=0),
        ValueError,
        "warmup_steps must be > 0",
    ),
    (
        "cyclic-mode",
        lambda o: wls.CyclicLR(o, 0.01, 0.1, mode="sine"),
        ValueError,
        "mode must be one of",
    ),
    (
        "onecycle-phase",
        lambda o: wls.OneCycleLR(o, 0.01, 0.1, 100, pct_start=0.01),
        ValueError,
        "phase of the cycle with no steps",
    ),
    (
        "onecycle-strategy",
        lambda o: wls.OneCycleLR(o, 0.01, 0.1, anneal_strategy="cosine"),
        ValueError,
        "anneal_strategy must be one of",
    ),
    (
        "tmult-zero",
        lambda o: wls.CosineAnnealingWarmRestarts(o, 0.1, 10, T_mult=0),
        ValueError,
        "T_mult must be >= 1",
    ),
    (
        "seq-count",
        lambda o: wls.SequentialLR(o, [wls.ConstantLR(o, 0.1)], [5]),
        ValueError,
        "one milestone fewer than schedulers",
    ),
    (
        "seq-float-milestone",
        lambda o: wls.SequentialLR(o, [wls.ConstantLR(o, 0.1), wls.ConstantLR(o, 0.2)], [5.0]),
        TypeError,
        "milestones must be integers",
    ),
    (
        "seq-other-optimizer",
        lambda o: wls.SequentialLR(
            o, [wls.ConstantLR(o, 0.1), wls.ConstantLR(make_optimizer(), 0.2)], [5]
        ),
        ValueError,
        "belongs to another optimizer",
    ),
    (
        "seq-torch-child",
        lambda o: wls.SequentialLR(o, [wls.ConstantLR(o, 0.1), tls.StepLR(o, 5)], [5]),
        TypeError,
        "only weightstream.optim.lr_scheduler schedulers",
    ),
    ("seq-empty", lambda o: wls.SequentialLR(o, [], []), ValueError, "at least one scheduler"),
    (
        "chain-zero-factor",
        lambda o: wls.ChainedLR([wls.ConstantLR(o, 0.1), wls.LinearLR(o, 0.0, 0.1, 5)]),
        ValueError,
        "starts from 0",
    ),
    (
        "chain-no-initial",
        lambda o: wls.ChainedLR([wls.ConstantLR(o, 0.1), HalvingLR(o, 3)]),
        TypeError,
        "has no initial value",
    ),
    (
        "chain-positional-optimizer",
        lambda o: wls.ChainedScheduler([wls.ConstantLR(o, 0.1)], o),
        TypeError,
        "pass the optimizer by keyword",
    ),
    (
        "chain-other-optimizer",
        lambda o: wls.ChainedLR([wls.ConstantLR(o, 0.1)], optimizer=make_optimizer()),
        ValueError,
        "belongs to another optimizer",
    ),
    (
        "scale-in-chain",
        lambda o: wls.ChainedLR([wls.ScalePerParamLR(o, wls.ConstantLR(o, 0.1))]),
        ValueError,
        "Wrap the ChainedLR in it",
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [c[1:] for c in ARGUMENT_ERRORS],
    ids=[c[0] for c in ARGUMENT_ERRORS],
)
def test_argument_errors(make, error, message):
    with pytest.raises(error, match=message):
        make(make_optimizer())


def test_weight_decay_scheduler_needs_the_key():
    optimizer = make_optimizer()
    del optimizer.param_groups[0]["weight_decay"]
    with pytest.raises(ValueError, match="param group 0 has no 'weight_decay' entry"):
        wls.ConstantWD(optimizer, 0.1)


def test_subclass_contracts():
    class NoClosedForm(wls.LRScheduler):
        pass

    class NoKey(wls.Scheduler):
        def _get_closed_form(self):
            return torch.tensor(1.0)

    class ReturnsFloat(wls.LRScheduler):
        def _get_closed_form_lr(self):
            return 0.1

    optimizer = make_optimizer()
    with pytest.raises(TypeError, match="abstract"):
        NoClosedForm(optimizer)
    with pytest.raises(TypeError, match=r"subclass LRScheduler .* or WDScheduler"):
        NoKey(optimizer)
    with pytest.raises(TypeError, match=r"must return a one-element torch\.Tensor"):
        ReturnsFloat(optimizer)


def test_cyclic_warns_when_scale_mode_is_ignored():
    with pytest.warns(UserWarning, match="scale_mode='iterations' is ignored"):
        scheduler = wls.CyclicLR(make_optimizer(), 0.01, 0.1, scale_mode="iterations")
    assert scheduler.scale_mode == "cycle"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wls.CyclicLR(make_optimizer(), 0.01, 0.1, mode="exp_range")


def test_works_with_other_torch_optimizers_and_tensor_lr():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([weight], lr=torch.tensor(0.01))
    lr_tensor = optimizer.param_groups[0]["lr"]
    scheduler = wls.StepLR(optimizer, 0.01, step_size=2, gamma=0.5)
    for _ in range(4):
        weight.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr_tensor, "a tensor lr is updated in place"
    assert float(lr_tensor) == float(torch.tensor(0.0025))  # the tensor keeps its float32
    assert scheduler.get_last_lr() == [0.0025]


def test_public_names():
    assert wls.ChainedScheduler is wls.ChainedLR
    assert wls.WeightDecayScheduler is wls.WDScheduler
    lr_names = [n for n in wls.__all__ if n.endswith("LR")] + [
        "CosineAnnealingWarmRestarts",
        "ChainedScheduler",
    ]
    assert len(set(lr_names)) == 20  # the 19 of the reference table plus the alias
    for name in wls.__all__:
        assert hasattr(wls, name), name

"""Periodic and one-cycle shapes: cosine annealing (with warm restarts), CLR, 1cycle.

Generic over the param-group key, like ``_decay.py``. The formulas follow the torch
schedulers of the same names written in closed form, with the same order of operations
where torch has one, so that a schedule here and its torch counterpart agree to a few
ulps (the tests state the tolerance for each).
"""

from __future__ import annotations

import itertools
import math
import warnings

import torch

from . import _checks
from ._base import ParamGroupTags, Scheduler, f64


class CosineAnnealingScheduler(Scheduler):
    """``eta_min + (initial - eta_min) * (1 + cos(pi * t / T_max)) / 2``, continuing past ``T_max``.

    This is the closed form torch's CosineAnnealingLR approximates recursively: after
    ``T_max`` the value rises again towards ``initial`` (no restart, no clamp).
    """

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        T_max: int,
        eta_min: float = 0.0,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.T_max = _checks.real(owner, "T_max", T_max)
        if self.T_max <= 0:
            raise ValueError(f"{owner}: T_max must be > 0 (the half period), got {T_max}.")
        self.eta_min = _checks.real(owner, "eta_min", eta_min)
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        cosine = 1.0 + torch.cos(math.pi * self._step_as_float() / self.T_max)
        return self.eta_min + (self.initial_val - self.eta_min) * cosine / 2.0


class CosineAnnealingWarmRestartsScheduler(Scheduler):
    """Cosine annealing restarted every ``T_i`` steps, ``T_i = T_0 * T_mult ** (restarts)``.

    ``T_cur`` (steps since the last restart) and ``T_i`` are computed from ``t`` in closed
    form. The reference accepts only ``T_mult=1``; torch accepts any integer ``T_mult >= 1``
    and so does this class.
    """

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        T_0: int,
        T_mult: int = 1,
        eta_min: float = 0.0,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.T_0 = _checks.integer(owner, "T_0", T_0, minimum=1)
        self.T_mult = _checks.integer(owner, "T_mult", T_mult, minimum=1)
        self.eta_min = _checks.real(owner, "eta_min", eta_min)
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _restart_start(self, n: torch.Tensor) -> torch.Tensor:
        """The step at which period ``n`` (0-based) starts: T_0 * (T_mult**n - 1) / (T_mult - 1)."""
        return self.T_0 * (self.T_mult**n - 1.0) / (self.T_mult - 1.0)

    def _get_closed_form(self) -> torch.Tensor:
        t = self._step_as_float()
        if self.T_mult == 1:
            t_i = f64(float(self.T_0))
            t_cur = torch.remainder(t, self.T_0)
        else:
            # Invert the start formula for the period index, then correct the floor of
            # the logarithm by one either way where rounding put it across a restart.
            n = torch.floor(
                torch.log(t / self.T_0 * (self.T_mult - 1.0) + 1.0) / math.log(self.T_mult)
            )
            n = torch.where(self._restart_start(n + 1.0) <= t, n + 1.0, n)
            n = torch.where(self._restart_start(n) > t, n - 1.0, n)
            t_i = self.T_0 * f64(float(self.T_mult)) ** n
            t_cur = t - self._restart_start(n)
        cosine = 1.0 + torch.cos(math.pi * t_cur / t_i)
        return self.eta_min + (self.initial_val - self.eta_min) * cosine / 2.0


class CyclicScheduler(Scheduler):
    """Cyclical schedule (CLR) between ``base_val`` and ``max_val``, as torch's CyclicLR.

    ``mode`` picks the amplitude scaling: ``triangular`` (none), ``triangular2`` (halved
    each cycle), ``exp_range`` (``gamma ** t``). As in torch and the reference, the mode
    decides ``scale_mode`` (``cycle`` for the triangular modes, ``iterations`` for
    ``exp_range``); a conflicting ``scale_mode`` is ignored with a warning.
    """

    _initial_attr = "base_val"

    _MODES = ("triangular", "triangular2", "exp_range")
    _SCALE_MODES = ("cycle", "iterations")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        base_val: float,
        max_val: float,
        step_size_up: int = 2000,
        step_size_down: int | None = None,
        mode: str = "triangular",
        gamma: float = 1.0,
        scale_mode: str = "cycle",
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.base_val = _checks.real(owner, self._arg("base_val"), base_val)
        self.max_val = _checks.real(owner, self._arg("max_val"), max_val)
        self.step_size_up = _checks.integer(owner, "step_size_up", step_size_up, minimum=1)
        self.step_size_down = (
            self.step_size_up
            if step_size_down is None
            else _checks.integer(owner, "step_size_down", step_size_down, minimum=0)
        )
        self.mode = _checks.choice(owner, "mode", mode, self._MODES)
        self.gamma = _checks.real(owner, "gamma", gamma)
        _checks.choice(owner, "scale_mode", scale_mode, self._SCALE_MODES)
        implied = "iterations" if self.mode == "exp_range" else "cycle"
        if scale_mode == "iterations" and implied == "cycle":
            warnings.warn(
                f"{owner}: scale_mode='iterations' is ignored with mode={self.mode!r}, which "
                f"always scales per cycle (as in torch.optim.lr_scheduler.CyclicLR). Use "
                f"mode='exp_range' for per-iteration scaling.",
                UserWarning,
                stacklevel=3,
            )
        self.scale_mode = implied
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        t = self._step_as_float()
        total_size = float(self.step_size_up + self.step_size_down)
        step_ratio = self.step_size_up / total_size
        cycle = torch.floor(1.0 + t / total_size)
        x = 1.0 + t / total_size - cycle
        scale_factor = torch.where(x <= step_ratio, x / step_ratio, (x - 1.0) / (step_ratio - 1.0))
        base_height = (self.max_val - self.base_val) * scale_factor
        if self.mode == "triangular":
            scale = f64(1.0)
        elif self.mode == "triangular2":
            scale = 1.0 / (2.0 ** (cycle - 1.0))
        else:
            scale = f64(self.gamma) ** t
        return self.base_val + base_height * scale


class OneCycleScheduler(Scheduler):
    """The 1cycle policy: ``initial -> max_val -> initial / final_div_factor``, as torch's OneCycleLR.

    ``initial_val`` is torch's ``max_lr / div_factor``. Phases end at
    ``pct_start * total_steps - 1`` and ``total_steps - 1`` (with ``three_phase``, a
    middle phase back to ``initial`` ends at ``2 * pct_start * total_steps - 2``).
    The cycle ends at step ``total_steps - 1``, whose value holds from there on.
    Torch's step ``total_steps`` extrapolates the last phase back up (for 20 steps:
    from 4e-6 to 1.25e-3), and it raises after; the reference extrapolates on.
    """

    _initial_attr = "initial_val"

    _STRATEGIES = ("cos", "linear")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        max_val: float,
        total_steps: int = 1000,
        pct_start: float = 0.3,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        anneal_strategy: str = "cos",
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.max_val = _checks.real(owner, self._arg("max_val"), max_val)
        self.total_steps = _checks.integer(owner, "total_steps", total_steps, minimum=1)
        self.pct_start = _checks.real(owner, "pct_start", pct_start)
        self.final_div_factor = _checks.real(owner, "final_div_factor", final_div_factor)
        if self.final_div_factor == 0:
            raise ValueError(f"{owner}: final_div_factor must be non-zero.")
        self.three_phase = bool(three_phase)
        self.anneal_strategy = _checks.choice(
            owner, "anneal_strategy", anneal_strategy, self._STRATEGIES
        )
        ends = [end for end, _, _ in self._phases()]
        if any(end <= start for start, end in itertools.pairwise([0.0, *ends])):
            raise ValueError(
                f"{owner}: pct_start={pct_start} with total_steps={total_steps} leaves a "
                f"phase of the cycle with no steps (phase ends {ends})."
                f" Use 0 < pct_start < 1 with pct_start * total_steps > 1 "
                f"(and < total_steps / 2 with three_phase)."
            )
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _phases(self) -> list[tuple[float, float, float]]:
        """(end step, start value, end value) of each phase, as torch lays them out."""
        min_val = self.initial_val / self.final_div_factor
        rise_end = float(self.pct_start * self.total_steps) - 1
        if self.three_phase:
            return [
                (rise_end, self.initial_val, self.max_val),
                (float(2 * self.pct_start * self.total_steps) - 2, self.max_val, self.initial_val),
                (float(self.total_steps - 1), self.initial_val, min_val),
            ]
        return [
            (rise_end, self.initial_val, self.max_val),
            (float(self.total_steps - 1), self.max_val, min_val),
        ]

    def _anneal(self, start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1.0)
        return (end - start) * pct + start

    def _get_closed_form(self) -> torch.Tensor:
        t = torch.clamp(self._step_as_float(), max=self.total_steps - 1)  # holds its end
        value = None
        start_step = 0.0
        for end_step, start_val, end_val in self._phases():
            phase_value = self._anneal(
                start_val, end_val, (t - start_step) / (end_step - start_step)
            )
            # A later phase takes over once t is past the end of the previous one.
            value = (
                phase_value if value is None else torch.where(t > start_step, phase_value, value)
            )
            start_step = end_step
        assert value is not None
        return value

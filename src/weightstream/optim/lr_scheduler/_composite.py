"""Schedulers built from other schedulers: sequential, chained, scaled per param group.

A composite owns its children: their step counters are *derived* from the composite's
own (``_set_last_epoch``) instead of being stepped, so a child never writes the param
groups after construction, a skipped step holds every counter at once, and a checkpoint
restores the whole tree consistently.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from . import _checks
from ._base import ParamGroupTags, Scheduler


class _CompositeScheduler(Scheduler):
    """A scheduler computed from children on the same optimizer and param-group key."""

    _schedulers: list[Scheduler]
    _nested_state = ("_schedulers",)

    def _adopt(
        self,
        schedulers: Any,
        optimizer: torch.optim.Optimizer | None,
        param_group_tags: ParamGroupTags,
    ) -> tuple[torch.optim.Optimizer, frozenset[str | None] | None]:
        """Check the children; return the shared optimizer and the tags of the composite.

        Tags left as None are taken from the children (which must agree), so that a
        composite of tagged schedulers needs no second copy of the tags.
        """
        owner = type(self).__name__
        if isinstance(schedulers, Scheduler) or not isinstance(schedulers, Sequence):
            raise TypeError(
                f"{owner}: schedulers must be a list of schedulers, got "
                f"{type(schedulers).__name__}."
            )
        if not schedulers:
            raise ValueError(f"{owner}: needs at least one scheduler, got an empty list.")
        for index, child in enumerate(schedulers):
            if not isinstance(child, Scheduler):
                raise TypeError(
                    f"{owner}: schedulers[{index}] is a {type(child).__name__}; only "
                    f"weightstream.optim.lr_scheduler schedulers can be combined (torch's "
                    f"recursive schedulers have no closed form). Use the scheduler of the same "
                    f"name from weightstream.optim.lr_scheduler."
                )
            if isinstance(child, ScalePerParamScheduler):
                raise ValueError(
                    f"{owner}: schedulers[{index}] is a {type(child).__name__}, whose per-group "
                    f"scaling would be lost inside another scheduler. Wrap the {owner} in it "
                    f"instead."
                )
            if child.param_group_key != self.param_group_key:
                raise ValueError(
                    f"{owner}: schedulers[{index}] ({type(child).__name__}) schedules "
                    f"{child.param_group_key!r} but {owner} schedules "
                    f"{self.param_group_key!r}; combine schedulers of the same kind (LR with "
                    f"LR, WD with WD)."
                )
        optimizer = schedulers[0].optimizer if optimizer is None else optimizer
        for index, child in enumerate(schedulers):
            if child.optimizer is not optimizer:
                raise ValueError(
                    f"{owner}: schedulers[{index}] ({type(child).__name__}) belongs to another "
                    f"optimizer; every scheduler combined must be built on the same optimizer."
                )
        tags = _checks.tags(owner, param_group_tags)
        if tags is None:
            tags = schedulers[0].param_group_tags
        for index, child in enumerate(schedulers):
            if child.param_group_tags != tags:
                raise ValueError(
                    f"{owner}: schedulers[{index}] has param_group_tags "
                    f"{_show(child.param_group_tags)} but {owner} schedules {_show(tags)}. Pass "
                    f"the same param_group_tags to every scheduler in it."
                )
        return optimizer, tags

    @property
    def initial_value(self) -> float:
        return self._schedulers[0].initial_value

    def _set_last_epoch(self, last_epoch: torch.Tensor) -> None:
        super()._set_last_epoch(last_epoch)
        for child in self._schedulers:
            child._set_last_epoch(last_epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["_schedulers"] = [child.state_dict() for child in self._schedulers]
        return state

    def _checked_state(self, state_dict: Any) -> dict[str, Any]:
        children = state_dict.get("_schedulers") if isinstance(state_dict, dict) else None
        if not isinstance(children, list) or len(children) != len(self._schedulers):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected the state of "
                f"{len(self._schedulers)} nested schedulers under '_schedulers'; the state dict "
                f"comes from a scheduler built differently."
            )
        restored = super()._checked_state(
            {key: value for key, value in state_dict.items() if key != "_schedulers"}
        )
        restored["_schedulers"] = [
            child._checked_state(child_state)
            for child, child_state in zip(self._schedulers, children)
        ]
        return restored

    def _apply_state(self, restored: dict[str, Any]) -> None:
        restored = dict(restored)
        for child, child_state in zip(self._schedulers, restored.pop("_schedulers")):
            child._apply_state(child_state)
        # The base restores our counter and re-derives the children's from it.
        super()._apply_state(restored)


def _show(tags: frozenset[str | None] | None) -> str:
    return "None (all groups)" if tags is None else str(sorted(map(str, tags)))


class SequentialScheduler(_CompositeScheduler):
    """Runs ``schedulers[k]`` from ``milestones[k-1]`` on; each sees ``t - milestones[k-1]``.

    Needs ``len(milestones) == len(schedulers) - 1`` integer, increasing milestones and
    schedulers of one optimizer. ``total_iters`` is the last milestone plus the last
    scheduler's ``total_iters`` (None when that is None).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        schedulers: Sequence[Scheduler],
        milestones: Sequence[int],
        last_epoch: int = -1,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        optimizer, tags = self._adopt(schedulers, optimizer, param_group_tags)
        if isinstance(milestones, numpy.ndarray):
            milestones = milestones.tolist()
        if isinstance(milestones, (list, tuple)) and any(
            isinstance(m, bool) or not isinstance(m, numbers.Integral) for m in milestones
        ):
            raise TypeError(
                f"{owner}: milestones must be integers (step indices), got "
                f"{[type(m).__name__ for m in milestones]}."
            )
        self._milestones = _checks.integer_list(owner, "milestones", milestones, increasing=True)
        if len(self._milestones) != len(schedulers) - 1:
            raise ValueError(
                f"{owner}: needs one milestone fewer than schedulers (a milestone between each "
                f"pair), got {len(schedulers)} schedulers and {len(self._milestones)} "
                f"milestones."
            )
        self._schedulers = list(schedulers)
        last_total = self._schedulers[-1].total_iters
        start = self._milestones[-1] if self._milestones else 0
        total_iters = None if last_total is None else start + last_total
        super().__init__(optimizer, total_iters, last_epoch, tags)

    def _set_last_epoch(self, last_epoch: torch.Tensor) -> None:
        Scheduler._set_last_epoch(self, last_epoch)  # not the composite's: children are shifted
        self._schedulers[0]._set_last_epoch(last_epoch)
        for milestone, child in zip(self._milestones, self._schedulers[1:]):
            child._set_last_epoch(torch.clamp(last_epoch - milestone, min=0))

    def _get_closed_form(self) -> torch.Tensor:
        value = self._schedulers[0]._get_closed_form()
        for milestone, child in zip(self._milestones, self._schedulers[1:]):
            value = torch.where(self.last_epoch < milestone, value, child._get_closed_form())
        return value


class ChainedScheduler(_CompositeScheduler):
    """``s0(t) * prod(s_k(t) / s_k.initial_value)``: the later schedules act as factors.

    Every scheduler sees the same step. ``optimizer`` (keyword only, as in torch) is
    checked against the schedulers' when given.
    """

    def __init__(
        self,
        schedulers: Sequence[Scheduler],
        param_group_tags: ParamGroupTags = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        owner = type(self).__name__
        if isinstance(param_group_tags, torch.optim.Optimizer):
            raise TypeError(
                f"{owner}: the second positional argument is param_group_tags; pass the "
                f"optimizer by keyword (optimizer=...) as in torch, or leave it out."
            )
        optimizer, tags = self._adopt(schedulers, optimizer, param_group_tags)
        for index, child in enumerate(schedulers[1:], start=1):
            if child.initial_value == 0:
                raise ValueError(
                    f"{owner}: schedulers[{index}] ({type(child).__name__}) starts from 0, so "
                    f"it cannot act as a factor (value / initial value). Put it first or give "
                    f"it a non-zero initial value."
                )
        self._schedulers = list(schedulers)
        super().__init__(optimizer, None, -1, tags)

    def _get_closed_form(self) -> torch.Tensor:
        value = self._schedulers[0]._get_closed_form()
        for child in self._schedulers[1:]:
            value = value * (child._get_closed_form() / child.initial_value)
        return value


class ScalePerParamScheduler(_CompositeScheduler):
    """Writes ``scheduler``'s value times each group's ``group[adjustment_key]`` (default 1).

    The factors are read from the groups at every step (muP-style per-layer scaling).
    """

    #: The param-group entry holding the factor; set by the LR / WD subclass.
    adjustment_key: str

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Scheduler,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        optimizer, tags = self._adopt([scheduler], optimizer, param_group_tags)
        self._schedulers = [scheduler]
        super().__init__(optimizer, scheduler.total_iters, -1, tags)

    @property
    def scheduler(self) -> Scheduler:
        """The wrapped scheduler."""
        return self._schedulers[0]

    def _get_closed_form(self) -> torch.Tensor:
        return self._schedulers[0]._get_closed_form()

    def _value_for_group(self, group: dict, index: int, value: float) -> float:
        factor = group.get(self.adjustment_key, 1.0)
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(
                f"{type(self).__name__}: param group {index} has {self.adjustment_key}="
                f"{factor!r}; it must be a number (the factor its value is multiplied by)."
            )
        return value * float(factor)

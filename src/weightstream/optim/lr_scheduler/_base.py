"""The machinery every schedule shares: a step counter, a closed form, one param-group key.

A :class:`Scheduler` owns an integer step counter (``last_epoch``) and a closed-form
function of it. ``step()`` advances the counter and writes the function's value into one
key of the optimizer's param groups: ``"lr"`` for :class:`LRScheduler`, ``"weight_decay"``
for :class:`WDScheduler`. The shapes (polynomial, cosine, ...) are written once against
this generic base and specialised by key, so learning rate and weight decay share every
line of stepping, skipping, tag selection and checkpointing.

Note [schedule precision]
    The closed forms are evaluated on float64 0-d CPU tensors. The value ends up in a
    Python float (a double) in the param group, which is what every torch optimizer
    reads, so float64 loses nothing; float32 (what the reference computes in) would put
    about 1e-7 relative error between a schedule here and the same schedule computed by
    ``torch.optim.lr_scheduler``, which does its arithmetic in Python floats. User
    subclasses may return any floating 0-d tensor; it is converted with ``float()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch

from weightstream.amp.skip import step_was_skipped

from . import _checks

ParamGroupTags = str | Iterable[str | None] | None


def f64(value: float) -> torch.Tensor:
    """A float64 0-d tensor: the dtype every built-in closed form computes in."""
    return torch.tensor(value, dtype=torch.float64)


def _cloned(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` whose tensors are copies too."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


class Scheduler(ABC):
    """Schedules one param-group value as a closed-form function of the step.

    Args:
        optimizer: the optimizer whose param groups receive the value (any
            ``torch.optim.Optimizer``).
        total_iters: how many steps the schedule lasts, when it has an end; used by
            ``configure_lr_scheduler`` to place the milestones of a SequentialLR.
        last_epoch: the step before the first one; construction performs one
            ``step()``, so the default -1 starts the schedule at step 0.
        param_group_tags: schedule only the param groups whose ``tags`` contain one of
            these (a string or a list of strings; ``None`` in the list selects untagged
            groups). ``None`` schedules every group.

    Subclasses set ``param_group_key`` (via :class:`LRScheduler` / :class:`WDScheduler`),
    store their arguments *before* calling ``super().__init__`` (construction computes
    the first value) and implement :meth:`_get_closed_form`.
    """

    #: The param-group entry this scheduler writes, e.g. ``"lr"``.
    param_group_key: str
    #: Public argument name of each generic one (``initial_val`` is ``initial_learning_rate``
    #: on the LR schedulers), so that error messages name what the user actually passed.
    _arg_names: dict[str, str] = {}
    #: Attributes holding nested schedulers, checkpointed by their own state dicts.
    _nested_state: tuple[str, ...] = ()
    #: The argument attribute that is the value at step 0 (``initial_value``), if one is.
    _initial_attr: str | None = None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_iters: int | None = None,
        last_epoch: int = -1,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(getattr(type(self), "param_group_key", None), str):
            raise TypeError(
                f"{owner} does not say which param-group value it schedules: subclass "
                f"LRScheduler (learning rate) or WDScheduler (weight decay), not Scheduler."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{owner}: optimizer must be a torch.optim.Optimizer (a weightstream.optim "
                f"optimizer or any torch one), got {type(optimizer).__name__}."
            )
        self.optimizer = optimizer
        self.total_iters = _checks.optional_integer(owner, "total_iters", total_iters, 0)
        self.param_group_tags = _checks.tags(owner, param_group_tags)
        self._check_groups()
        start = _checks.integer(owner, "last_epoch", last_epoch, minimum=-1)
        # last_epoch is a tensor, as in the reference, so that closed forms written for it
        # (torch.where(self.last_epoch < m, ...)) run unchanged.
        self.last_epoch = torch.tensor(start, dtype=torch.int64)
        self._last_value: list[float | None] = [None] * len(optimizer.param_groups)
        # Construction performs one step (-1 -> 0) so that the first optimizer step
        # already uses the value of step 0. It is never skipped: no optimizer step
        # belongs to it.
        self._advance()

    # ------------------------------------------------------------------ closed form

    @abstractmethod
    def _get_closed_form(self) -> torch.Tensor:
        """The value at step ``self.last_epoch``, as a 0-d tensor computed with tensor ops."""

    @property
    def initial_value(self) -> float:
        """The schedule's scale at step 0; ChainedLR divides the later schedules by it."""
        if self._initial_attr is not None:
            return getattr(self, self._initial_attr)
        raise TypeError(
            f"{type(self).__name__} has no initial value, so it cannot be chained after "
            f"another scheduler. Define an `initial_value` property on it."
        )

    def _arg(self, generic: str) -> str:
        return self._arg_names.get(generic, generic)

    def _step_as_float(self) -> torch.Tensor:
        """``last_epoch`` as a float64 0-d tensor (see Note [schedule precision])."""
        return self.last_epoch.to(torch.float64)

    # ------------------------------------------------------------------ stepping

    def step(self) -> None:
        """Advance one step and write the new value into the selected param groups.

        Call it after ``optimizer.step()``. When the loss scaler skipped that optimizer
        step (non-finite gradients), the schedule does not advance either: the step
        counter and the param groups are left as they were.
        """
        if step_was_skipped(self.optimizer):
            return
        self._advance()

    def _advance(self) -> None:
        self._set_last_epoch(self.last_epoch + 1)
        self._write_groups()

    def _set_last_epoch(self, last_epoch: torch.Tensor) -> None:
        """Set the step counter; composite schedulers also move their children's."""
        # A new tensor rather than += so that a state_dict taken earlier never changes.
        self.last_epoch = last_epoch.clone()

    def _applies_to(self, group: dict, tags: frozenset[str | None] | None = None) -> bool:
        """Whether ``group`` is scheduled (by ``tags``, default this scheduler's own)."""
        tags = self.param_group_tags if tags is None else tags
        return tags is None or bool(tags & _checks.group_tags(group))

    def _value_for_group(self, group: dict, index: int, value: float) -> float:
        """The value written into one group; ScalePerParam multiplies it by a factor."""
        return value

    def _write_groups(self) -> None:
        result = self._get_closed_form()
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            raise TypeError(
                f"{type(self).__name__}: the closed form must return a one-element "
                f"torch.Tensor, got {type(result).__name__} {result!r}."
            )
        # Host sync: the value becomes a Python float so that any optimizer reads it.
        value = float(result)
        for index, group in enumerate(self.optimizer.param_groups):
            if not self._applies_to(group):
                self._last_value[index] = None
                continue
            group_value = self._value_for_group(group, index, value)
            current = group[self.param_group_key]
            if isinstance(current, torch.Tensor):
                # A tensor-valued lr (capturable / compiled optimizers) is updated in
                # place, so the optimizer keeps the tensor (and device) it was built with.
                current.fill_(group_value)
            else:
                group[self.param_group_key] = group_value
            self._last_value[index] = group_value

    def get_last_value(self) -> list[float | None]:
        """The last value written, per param group (``None`` for groups not scheduled)."""
        return list(self._last_value)

    # ------------------------------------------------------------------ checks

    def _check_groups(self, tags: frozenset[str | None] | None = None) -> None:
        """The groups ``tags`` (default: ours) select exist and all carry our key."""
        owner = type(self).__name__
        key = self.param_group_key
        tags = self.param_group_tags if tags is None else tags
        groups = self.optimizer.param_groups
        for index, group in enumerate(groups):
            if self._applies_to(group, tags) and key not in group:
                raise ValueError(
                    f"{owner}: param group {index} has no {key!r} entry to schedule. Use an "
                    f"optimizer that takes {key} (or add it to the group), or select other "
                    f"groups with param_group_tags."
                )
        if not any(self._applies_to(group, tags) for group in groups):
            available = set().union(*map(_checks.group_tags, groups))
            raise ValueError(
                f"{owner}: param_group_tags {sorted(map(str, tags or ()))} select no param "
                f"group of the optimizer. Tags present: {sorted(map(str, available))} "
                f"('None' means untagged groups)."
            )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Every attribute except the optimizer (torch and reference semantics).

        Tensors are copies, so the dict does not change when the schedule moves on.
        """
        state = _cloned({key: value for key, value in self.__dict__.items() if key != "optimizer"})
        # A plain list, so that the checkpoint writer and torch.load(weights_only=True)
        # take it (a frozenset is neither flattened nor allow-listed).
        state["param_group_tags"] = _checks.tags_as_list(self.param_group_tags)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``step()`` continues from its step.

        The whole state (nested schedulers included) is checked before anything changes.
        Like torch, this does not rewrite the param groups: restore the optimizer's own
        state dict as well (it holds the value the groups had).
        """
        self._apply_state(self._checked_state(state_dict))

    def _checked_state(self, state_dict: Any) -> dict[str, Any]:
        """A private copy of ``state_dict``, normalised, or an error naming what is wrong."""
        owner = type(self).__name__
        if not isinstance(state_dict, dict) or "last_epoch" not in state_dict:
            raise ValueError(
                f"{owner}.load_state_dict: expected a dict returned by state_dict() (with a "
                f"'last_epoch' entry), got {type(state_dict).__name__}."
            )
        expected = {key for key in self.__dict__ if key != "optimizer"} - set(self._nested_state)
        unexpected, missing = set(state_dict) - expected, expected - set(state_dict)
        if unexpected or missing:
            # Loading it anyway would leave this scheduler with another one's arguments.
            raise ValueError(
                f"{owner}.load_state_dict: the state dict comes from a different kind of "
                f"scheduler (unexpected keys {sorted(unexpected)}, missing keys "
                f"{sorted(missing)}). Build the same scheduler as the one that was saved."
            )
        restored = _cloned(state_dict)
        step = restored["last_epoch"]
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        # Checkpoint formats may hand the step back as a plain int.
        step = _checks.integer(owner, "last_epoch", step, minimum=0)
        restored["last_epoch"] = torch.tensor(step, dtype=torch.int64)
        restored["param_group_tags"] = _checks.tags(owner, restored["param_group_tags"])
        self._check_groups(restored["param_group_tags"])
        return restored

    def _apply_state(self, restored: dict[str, Any]) -> None:
        self.__dict__.update(restored)
        self._set_last_epoch(self.last_epoch)


class LRScheduler(Scheduler):
    """Base class of the learning-rate schedulers: writes ``param_group["lr"]``.

    A custom schedule subclasses it, stores its arguments, calls
    ``super().__init__(optimizer, total_iters=..., last_epoch=...)`` and implements
    :meth:`_get_closed_form_lr`, the value at ``self.last_epoch`` written with tensor ops
    (``torch.where`` rather than ``if`` on the step).
    """

    param_group_key = "lr"
    _arg_names = {
        "val": "learning_rate",
        "vals": "learning_rates",
        "initial_val": "initial_learning_rate",
        "end_val": "end_learning_rate",
        "base_val": "base_lr",
        "max_val": "max_lr",
    }

    @abstractmethod
    def _get_closed_form_lr(self) -> torch.Tensor:
        """The learning rate at step ``self.last_epoch`` as a 0-d tensor."""

    def _get_closed_form(self) -> torch.Tensor:
        return self._get_closed_form_lr()

    def get_last_lr(self) -> list[float | None]:
        """The last learning rate written, per param group (``None`` if not scheduled)."""
        return self.get_last_value()


class WDScheduler(Scheduler):
    """Base class of the weight-decay schedulers: writes ``param_group["weight_decay"]``.

    A custom schedule subclasses it and implements :meth:`_get_closed_form`.
    """

    param_group_key = "weight_decay"

"""``configure_lr_scheduler``: a learning-rate schedule from a params-file value.

The value is a number (constant), a dict naming one scheduler, or a list of such dicts
(run one after the other, or multiplied together with ``main_scheduler: chained``).
Every mistake in it raises a ValueError/TypeError naming the entry, the key and the fix.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import itertools
import numbers
from typing import Any

import torch

from weightstream.common.schema import named_subclasses

from . import _lr
from ._base import LRScheduler
from ._lr import ChainedLR, ScalePerParamLR, SequentialLR

#: Retired argument names -> their replacements, in order of preference; the first
#: replacement the scheduler actually takes is named in the error.
_RETIRED = {
    "steps": ("total_iters",),
    "decay_steps": ("total_iters",),
    "learning_rate": ("initial_learning_rate", "base_lr"),
    "base_lr": ("initial_learning_rate",),
    "initial_learning_rate": ("base_lr",),
    "values": ("learning_rates",),
    "boundaries": ("milestones",),
}

_CHAINED = ("chained", "chainedlr", "chainedscheduler")
_SEQUENTIAL = ("sequential", "sequentiallr")


def configure_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    learning_rate: Any,
    adjust_learning_rate: Any = None,
) -> LRScheduler | None:
    """Build the learning-rate scheduler a params file describes.

    Args:
        optimizer: the optimizer whose ``lr`` is scheduled.
        learning_rate: one of
            - a number, or a numeric string such as ``"1e-3"``: a :class:`ConstantLR`;
            - a dict whose ``scheduler`` key names the scheduler (case-insensitive, the
              ``LR`` suffix optional: ``"cosinedecay"``, ``"CosineDecayLR"``) and whose
              other keys are its arguments;
            - a list of such dicts: a :class:`SequentialLR` whose milestones are the
              running sum of the ``total_iters`` of all entries but the last, or, when an
              entry has ``main_scheduler: chained``, a :class:`ChainedLR`;
            - None: no scheduler (returns None).
        adjust_learning_rate: when set (the per-layer factors of the run config), the
            result is wrapped in :class:`ScalePerParamLR`, which multiplies each group's
            lr by its ``adjust_learning_rate`` entry. Not allowed with ChainedLR.
    """
    if learning_rate is None:
        return None
    entries = _entries(learning_rate)
    chained = _main_scheduler_is_chained(entries)
    schedulers = [
        _build_one(
            optimizer, entry, f"learning_rate[{index}]" if len(entries) > 1 else "learning_rate"
        )
        for index, entry in enumerate(entries)
    ]
    if chained:
        if adjust_learning_rate:
            raise ValueError(
                "configure_lr_scheduler: main_scheduler 'chained' cannot be combined with "
                "adjust_learning_rate (per-layer lr scaling). Drop main_scheduler to run the "
                "schedulers one after the other, or drop adjust_learning_rate."
            )
        return ChainedLR(schedulers)
    if len(schedulers) == 1:
        scheduler = schedulers[0]
    else:
        for index, scheduler in enumerate(schedulers[:-1]):
            if scheduler.total_iters is None:
                raise ValueError(
                    f"configure_lr_scheduler: learning_rate[{index}] "
                    f"({type(scheduler).__name__}) has no total_iters, so the sequence cannot "
                    f"tell when learning_rate[{index + 1}] starts. Add 'total_iters: <steps>' "
                    f"to it (every entry but the last needs one), or set 'main_scheduler: "
                    f"chained' to multiply the schedules instead."
                )
        milestones = list(itertools.accumulate(s.total_iters for s in schedulers[:-1]))
        scheduler = SequentialLR(optimizer, schedulers, milestones)
    if adjust_learning_rate:
        return ScalePerParamLR(optimizer, scheduler)
    return scheduler


def _entries(learning_rate: Any) -> list[dict[str, Any]]:
    """The value as a list of scheduler dicts (copies: the caller's value is not touched)."""
    if isinstance(learning_rate, bool):
        raise TypeError(
            f"configure_lr_scheduler: learning_rate must be a number, a dict or a list of "
            f"dicts, got the bool {learning_rate!r}."
        )
    if isinstance(learning_rate, numbers.Real):
        return [{"scheduler": "constant", "learning_rate": float(learning_rate)}]
    if isinstance(learning_rate, str):
        try:
            value = float(learning_rate)
        except ValueError:
            raise ValueError(
                f"configure_lr_scheduler: learning_rate {learning_rate!r} is not a number. "
                f"Give a number such as 1e-3, or a dict {{'scheduler': <name>, ...}} for a "
                f"schedule."
            ) from None
        return [{"scheduler": "constant", "learning_rate": value}]
    if isinstance(learning_rate, dict):
        entries = [learning_rate]
    elif isinstance(learning_rate, (list, tuple)):
        entries = list(learning_rate)
    else:
        raise TypeError(
            f"configure_lr_scheduler: learning_rate must be a number, a dict or a list of "
            f"dicts, got {type(learning_rate).__name__}."
        )
    if not entries:
        raise ValueError(
            "configure_lr_scheduler: learning_rate is an empty list; give at least one "
            "scheduler dict, or None for no scheduler."
        )
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise TypeError(
                f"configure_lr_scheduler: learning_rate[{index}] must be a dict "
                f"{{'scheduler': <name>, ...}}, got {type(entry).__name__} {entry!r}."
            )
    return [copy.deepcopy(entry) for entry in entries]


def _main_scheduler_is_chained(entries: list[dict[str, Any]]) -> bool:
    """Pop ``main_scheduler`` from every entry; True when they ask for ChainedLR."""
    kinds = set()
    for index, entry in enumerate(entries):
        if "main_scheduler" not in entry:
            continue
        value = entry.pop("main_scheduler")
        name = value.lower() if isinstance(value, str) else value
        if name in _CHAINED:
            kinds.add("chained")
        elif name in _SEQUENTIAL:
            kinds.add("sequential")
        else:
            raise ValueError(
                f"configure_lr_scheduler: learning_rate[{index}] has main_scheduler={value!r}; "
                f"use 'chained' (multiply the schedules) or 'sequential' (run them one after "
                f"the other, the default)."
            )
    if len(kinds) > 1:
        raise ValueError(
            "configure_lr_scheduler: the entries disagree on main_scheduler (both 'chained' "
            "and 'sequential'); set it on one entry or to the same value everywhere."
        )
    return kinds == {"chained"}


def _scheduler_classes() -> dict[str, type[LRScheduler]]:
    """Lower-cased class name -> class: the built-ins, then user LRScheduler subclasses."""
    found: dict[str, type[LRScheduler]] = {
        name.lower(): cls
        for name, cls in vars(_lr).items()
        if isinstance(cls, type)
        and issubclass(cls, LRScheduler)
        and cls is not LRScheduler
        and not name.startswith("_")
    }
    for cls in named_subclasses(LRScheduler):
        found.setdefault(cls.__name__.lower(), cls)
    return found


def _lookup(name: Any, where: str) -> type[LRScheduler]:
    classes = _scheduler_classes()
    if not isinstance(name, str):
        raise TypeError(
            f"configure_lr_scheduler: {where}['scheduler'] must be a scheduler name, got "
            f"{type(name).__name__} {name!r}."
        )
    for candidate in (name.lower(), name.lower() + "lr"):
        if candidate in classes:
            return classes[candidate]
    names = sorted({cls.__name__ for cls in classes.values()} | {"ChainedScheduler"})
    raise ValueError(
        f"configure_lr_scheduler: {where} names an unknown scheduler {name!r}. Valid names "
        f"(case-insensitive, the 'LR' suffix optional): {names}."
    )


def _build_one(optimizer: torch.optim.Optimizer, entry: dict[str, Any], where: str) -> LRScheduler:
    """One scheduler from one dict, checking its keys against the class's signature."""
    if "scheduler" not in entry:
        raise ValueError(
            f"configure_lr_scheduler: {where} has no 'scheduler' key naming the schedule; "
            f"add e.g. 'scheduler: CosineDecay'."
        )
    cls = _lookup(entry.pop("scheduler"), where)
    owner = f"configure_lr_scheduler: {where} ({cls.__name__})"
    signature = inspect.signature(cls.__init__)
    params = {
        name: p
        for name, p in list(signature.parameters.items())[1:]
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name != "optimizer"
    }
    if "schedulers" in params or "scheduler" in params:
        raise ValueError(
            f"{owner} wraps other scheduler objects and cannot be built from a dict. Give a "
            f"list of scheduler dicts instead (a SequentialLR by default, a ChainedLR with "
            f"'main_scheduler: chained')."
        )
    unknown = [key for key in entry if key not in params]
    for key in unknown:
        replacement = next((r for r in _RETIRED.get(key, ()) if r in params), None)
        if replacement is not None:
            raise ValueError(f"{owner}: '{key}' is a retired name; rename it to '{replacement}'.")
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), params, n=1) or [
                p for p in params if p.lower() == str(key).lower()
            ]
            if close:
                hints.append(f"'{key}' -> '{close[0]}'?")
        raise ValueError(
            f"{owner}: unknown key(s) {unknown}. {cls.__name__} takes {list(params)}."
            + (f" Did you mean: {', '.join(hints)}" if hints else "")
        )
    missing = [name for name, p in params.items() if p.default is p.empty and name not in entry]
    if missing:
        raise ValueError(f"{owner}: missing required key(s) {missing}.")
    return cls(optimizer, **entry)

"""Optimizer update costs of the machine profile (``UpdateCost``).

Measured the first time a run asks for an optimizer setting and kept in the
profile's ``update_costs`` (``machine.update_cost``): the update sequence of the
trainer (unscale, clip, step, scaler update, zero_grad, the learning-rate
scheduler's step) timed on 1 tensor of 16 elements, on 64 such tensors, and on
1 tensor as large as the model's trainable parameters (rounded up to a power of
two; :func:`update_spec`), which gives a fixed cost, a cost per parameter tensor
and a cost per element; 4 such models are updated in turn, so that each update
finds its tensors cold, and each update follows a few tiny training steps (Note
[update in context]).

Note [update in context]
------------------------
In a run the update follows a forward and a backward, and what they ran leaves
the caches to the update's code and data cold. Updates timed back to back miss
that: on a 2-vCPU Xeon (AVX-512), the trainer's update of FC-MNIST's six
tensors (SGD with momentum, 235,146 elements) took a median 533 us in a
rotation of 4 such models; when each update followed forwards and backwards of
the tiny chain, 831 us after one, 916 after two, 932 after three and 939-943
after five to twelve; 0.91 ms inside the run command's steps. With one OpenMP
thread it grew just as much (671, 963, 1,125 us after none, one and three), so
it is not the thread pool waking. The
growth is mostly the fixed part, the Python of the update sequence (155 -> 352
us after one tiny step), with the per-element cost 0.82 -> 1.19 ns; AdamW on 2^20 elements with
clipping and a scheduler: fixed 590 -> 831 us, per element 4.7 ns either way.
So each timed update follows the stand-in for a step's other work that the
input's timing uses too (``software.tiny_training_steps``: three tiny training
steps, after which more leave the update no slower), and the estimate does not
scale the update by the in-situ factor (Note [in situ] in software.py): it is
measured in its context already.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import warnings

import torch

from weightstream.amp import GradScaler
from weightstream.compiler.profile import UpdateCost
from weightstream.compiler.software import tiny_training_steps
from weightstream.compiler.timing import Sizes, seconds_after
from weightstream.optim import configure_lr_scheduler, configure_optimizer


def update_spec(
    optimizer_type: str,
    kwargs: dict | None = None,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
    grad_scaler: dict | None = None,
    device: torch.device | str = "cpu",
    schedule=None,
    numel: int | None = None,
) -> dict:
    """What an update's cost depends on: the optimizer and its numeric arguments
    (the learning rate's value does not change the cost and is left out),
    gradient clipping, the loss scaler's settings, the device holding the
    parameters (the host in weight streaming) and the learning-rate schedule
    (``schedule``: the params file's ``learning_rate``, None for none), whose
    Python step runs once per step: a sequence of schedulers costs a few hundred
    microseconds, several percent of a small model's step. ``numel``: the
    model's trainable elements; the cost per element is timed on a tensor of
    that many, rounded up to a power of two in [2^14, 2^22] (None: 2^20), as
    what fits the caches decides it: SGD with momentum updates a 0.2M-element
    model at 2-3 ns an element and 4 sets of 1M elements at 5."""
    kwargs = {
        k: v
        for k, v in (kwargs or {}).items()
        if k not in ("learning_rate", "lr") and isinstance(v, (bool, int, float, str, list, tuple))
    }
    return {
        "optimizer_type": optimizer_type,
        "kwargs": kwargs,
        "max_gradient_norm": max_gradient_norm,
        "max_gradient_value": max_gradient_value,
        "grad_scaler": {k: v for k, v in (grad_scaler or {}).items() if v is not None},
        "device": str(torch.device(device)),
        "schedule": copy.deepcopy(schedule),
        "numel": None if numel is None else _update_numel(numel),
    }


def _update_numel(numel: int) -> int:
    """``numel`` rounded up to a power of two in [2^14, 2^22] (see :func:`update_spec`)."""
    return 2 ** min(22, max(14, math.ceil(math.log2(max(1, numel)))))


def update_key(spec: dict) -> str:
    """The ``update_costs`` key of an update setting (see :func:`update_spec`)."""
    text = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure_update(spec: dict, sizes: Sizes) -> UpdateCost:
    """Time the trainer's update sequence for ``spec`` (see the module docstring)."""
    device = torch.device(spec["device"])
    big = sizes.update_numel or spec.get("numel") or 2**20

    def update_seconds(tensors: int, numel: int) -> float:
        # Several independent models updated in turn, each update after tiny
        # training steps: its parameters, gradients and state cold, and its code,
        # as a run's update finds them (Note [update in context]).
        updates = []
        for _ in range(sizes.update_sets):
            params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(tensors)]
            grads = [torch.full((numel,), 1e-3, device=device) for _ in range(tensors)]
            opt = configure_optimizer(
                spec["optimizer_type"], params=params, learning_rate=1e-3, **spec["kwargs"]
            )
            schedule = spec.get("schedule")
            sched = None if schedule is None else configure_lr_scheduler(opt, schedule)
            updates.append((params, grads, opt, GradScaler(**spec["grad_scaler"]), sched))

        def update(params, grads, opt, scaler, sched):
            # The update part of Trainer._optimizer_step, in its order.
            for p, g in zip(params, grads):
                p.grad = g
            scaler.unscale_(opt)
            if spec["max_gradient_norm"] is not None:
                torch.nn.utils.clip_grad_norm_(params, spec["max_gradient_norm"])
            elif spec["max_gradient_value"] is not None:
                torch.nn.utils.clip_grad_value_(params, spec["max_gradient_value"])
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()

        rotation = itertools.cycle(updates)
        with warnings.catch_warnings(), tiny_training_steps(device) as step:
            warnings.simplefilter("ignore")
            return seconds_after(
                lambda: update(*next(rotation)), step, device, sizes.update_seconds
            )

    small = 16
    t1 = update_seconds(1, small)
    t64 = update_seconds(64, small)
    t_big = update_seconds(1, big)
    per_tensor = max(0.0, (t64 - t1) / 63)
    per_element = max(0.0, (t_big - t1) / (big - small))
    fixed = max(0.0, t1 - per_tensor - small * per_element)
    return UpdateCost(spec, fixed, per_tensor, per_element)

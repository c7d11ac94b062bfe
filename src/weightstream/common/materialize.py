"""Give a model's parameters storage and initial values, one module at a time.

A model too large for host memory is built under ``torch.device("meta")``:
shapes, no storage. :func:`materialize` walks it module by module, gives each
module's new parameters storage from ``allocate`` (host memory, or the disk
store's files) and initializes them, so only one module's tensors need to be
touched at a time. The zoo's constructors run the same walk on their real
tensors, which is what makes the two ways of building one model equal bit for
bit: the random numbers are drawn in the same order, by the same rules.

The rule for a module is the root model's ``init_module(name, module)`` when
the model defines one (the zoo's models do: their normal(0.02) matrices, scaled
residual projections, zero biases), else the module's own
``reset_parameters()`` (every ``torch.nn`` layer with parameters has one).

A module is initialized when it owns a parameter not seen earlier in the walk
(``named_modules`` order). A parameter tied to an earlier one is pointed at its
materialized twin and not drawn again, so a tied LM head keeps the embedding's
values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

Allocate = Callable[[nn.Parameter], torch.Tensor]


def init_rule(model: nn.Module) -> Callable[[str, nn.Module], None]:
    """How :func:`materialize` initializes one module of ``model`` (see the module doc)."""
    own = getattr(model, "init_module", None)
    if own is not None:
        return own

    def reset(name: str, module: nn.Module) -> None:
        if not hasattr(module, "reset_parameters"):
            raise ValueError(
                f"parameters of module {name or '<root>'!r} ({type(module).__name__}) on the "
                "meta device cannot be initialized: the module has no reset_parameters() and "
                "the model no init_module(name, module). Fix: give the module a "
                "reset_parameters() method, or build the model on the CPU."
            )
        module.reset_parameters()

    return reset


def materialize(
    model: nn.Module,
    allocate: Allocate | None = None,
    after: Callable[[Iterable[torch.Tensor]], None] | None = None,
) -> nn.Module:
    """Initialize ``model`` module by module. With ``allocate``, only the modules that own
    meta parameters: those get storage first (``allocate(meta_param)`` returns a
    tensor of its shape and dtype) and parameters that have storage are kept.

    ``after(tensors)`` is called with each module's newly initialized parameters
    (the disk store gives their pages back). Returns ``model``.
    """
    init = init_rule(model)
    twins: dict[int, nn.Parameter] = {}  # id(parameter as built) -> the parameter kept
    for name, m in model.named_modules():
        fresh: list[nn.Parameter] = []
        for key, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in twins:  # tied to a parameter met earlier: already initialized
                m._parameters[key] = twins[id(p)]
                continue
            q = p
            if allocate is None:
                fresh.append(q)
            elif p.is_meta:
                q = nn.Parameter(allocate(p), requires_grad=p.requires_grad)
                m._parameters[key] = q
                fresh.append(q)
            twins[id(p)] = q
        if fresh:
            with torch.no_grad():
                init(name, m)
            if after is not None:
                after(fresh)
    return model


def build_materialized(
    build: Callable[[], nn.Module], device: torch.device | str = "cpu"
) -> nn.Module:
    """``build()`` on the meta device, then materialized on ``device`` (``"meta"``: left
    without storage), for models that define ``init_module``; others are built
    directly on ``device`` by their own constructor (as are models with buffers,
    which the walk does not materialize)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = build()
    if device.type == "meta":
        return model
    if getattr(model, "init_module", None) is None or any(b.is_meta for b in model.buffers()):
        with torch.device(device):
            return build()
    return materialize(model, lambda p: torch.empty(p.shape, dtype=p.dtype, device=device))

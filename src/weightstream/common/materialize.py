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
residual projections, zero biases); for a transformers model, the library's
``_init_weights(module)`` (its ``initializer_range`` normals, unit norms, each
architecture's own overrides: what ``from_config`` gives), after the module's
``reset_parameters()`` where it has one, for what the library's rule leaves
alone; else ``reset_parameters()`` (every ``torch.nn`` layer with parameters has
one). Parameters a
checkpoint will provide can be left undrawn (``skip``); so can those of modules
without any rule, for a load to fill (``without_rule="leave"``).

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


def _initialize(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Initialize ``module``'s own parameters by ``model``'s rule (see the module doc);
    False when there is no rule for it."""
    hf_init = getattr(model, "_init_weights", None)  # a transformers PreTrainedModel
    if getattr(model, "init_module", None) is not None:
        model.init_module(name, module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
        if hf_init is not None:
            hf_init(module)  # torch's defaults are not the library's (std 1 embeddings)
    elif hf_init is not None:
        hf_init(module)
    else:
        return False
    return True


def init_normal(m: nn.Module, std: float = 0.02) -> None:
    """The zoo's rule (a model's ``init_module``): N(0, std) for the matrix of an
    ``nn.Linear`` or ``nn.Embedding``, zero biases; other modules (norms) reset."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    else:
        m.reset_parameters()


def materialize(
    model: nn.Module,
    allocate: Allocate | None = None,
    after: Callable[[Iterable[torch.Tensor]], None] | None = None,
    *,
    skip: Callable[[str], bool] | None = None,
    without_rule: str = "error",
) -> list[str]:
    """Initialize ``model`` module by module. With ``allocate``, only the modules that own
    meta parameters: those get storage first (``allocate(meta_param)`` returns a
    tensor of its shape and dtype, zeros) and parameters that have storage are kept.

    ``after(tensors)`` is called with each module's newly initialized parameters
    (the disk store gives their pages back). ``skip(name)``: parameters whose
    values will come from elsewhere (a checkpoint) are not drawn; a module is
    initialized when any of its new parameters is not skipped. ``without_rule``:
    a module without an initialization rule is an error (``"error"``), or its
    parameters are left at zero for a later load (``"leave"``).

    Returns the qualified names of the parameters left without initial values.
    """
    twins: dict[int, nn.Parameter] = {}  # id(parameter as built) -> the parameter kept
    left: list[str] = []
    for name, m in model.named_modules():
        fresh: list[nn.Parameter] = []
        names: list[str] = []
        for key, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in twins:  # tied to a parameter met earlier: already initialized
                m._parameters[key] = twins[id(p)]
                continue
            q = p
            if allocate is not None and p.is_meta:
                q = m._parameters[key] = nn.Parameter(allocate(p), requires_grad=p.requires_grad)
            if allocate is None or p.is_meta:
                fresh.append(q)
                names.append(f"{name}.{key}" if name else key)
            twins[id(p)] = q
        if not fresh:
            continue
        if skip is not None and all(skip(n) for n in names):
            left.extend(names)
        else:
            with torch.no_grad():
                done = _initialize(model, name, m)
            if not done and without_rule == "leave":
                left.extend(names)
            elif not done:
                raise ValueError(
                    f"parameters of module {name or '<root>'!r} ({type(m).__name__}) on the "
                    "meta device cannot be initialized: the module has no reset_parameters() "
                    "and the model no init_module(name, module). Fix: give the module a "
                    "reset_parameters() method, build the model on the CPU, or load its "
                    "weights from a checkpoint (load_state_dict, or the run command's "
                    "load_checkpoint_states)."
                )
        if after is not None:
            after(fresh)
    return left


def materialize_buffers(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Compute ``model``'s buffers that are on the meta device, on ``device``.

    Buffers (rotary frequency tables, causal masks, embedding scales) are derived
    from the configuration, not trained: a module holding one on meta is built
    again on ``device`` from the configuration it was built with
    (``type(m)(m.config)``, the convention of transformers' modules), and its
    buffers are taken from that copy. A module without a ``config`` of a
    transformers model gets its floating buffers from the library's own
    ``_init_weights(module)``, which computes them (Gemma's ``embed_scale``) and
    leaves the meta parameters as they are; a buffer it leaves unset (still NaN)
    is not guessed. A buffer computed neither way is an error naming it.
    """
    hf_init = getattr(model, "_init_weights", None)  # a transformers PreTrainedModel
    for name, m in model.named_modules():
        meta = [k for k, b in m._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        config = getattr(m, "config", None)
        fresh = None
        if config is not None:
            try:
                with torch.device(device):
                    fresh = type(m)(config)
            except Exception:  # any constructor failure: reported below
                fresh = None
        if fresh is None and hf_init is not None:
            floating = [k for k in meta if m._buffers[k].is_floating_point()]
            for key in floating:
                b = m._buffers[key]
                m._buffers[key] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=device)
            with torch.no_grad():
                hf_init(m)
            meta = [k for k in meta if k not in floating or m._buffers[k].isnan().any()]
        for key in meta:
            value = None if fresh is None else fresh._buffers.get(key)
            if value is None or value.shape != m._buffers[key].shape:
                raise ValueError(
                    f"buffer {key!r} of module {name or '<root>'!r} ({type(m).__name__}) is on "
                    "the meta device and cannot be computed: the module cannot be built again "
                    "from a `config` attribute. Fix: create the model's buffers on the CPU "
                    "(e.g. register them after building on meta)."
                )
            m._buffers[key] = value.to(device)


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
    materialize(model, lambda p: torch.empty(p.shape, dtype=p.dtype, device=device))
    return model

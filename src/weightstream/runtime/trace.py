"""Dry run of a model on the meta device: which modules run, in which order, and
which parameters each one touches.

The model is shadowed by a copy whose parameters and buffers are FakeTensors
over meta storages (``shadow_copy``: no data is copied), and the shadow runs one
forward on meta inputs of the real batch shape. Module hooks on the shadow
record the call tree; a TorchFunctionMode sees every torch call and records
which parameters it received while which modules were running. The RNG state is
restored afterwards, so tracing changes no random number a later real step
draws.

The forward runs under the FakeTensorMode of the shadow's tensors (the meta
inputs become FakeTensors as they enter an operator): libraries that skip
data-dependent checks while being traced recognise FakeTensors, not plain meta
tensors. transformers' mask helper,
for one, asks ``(mask == 0).all()`` of the position ids of a model run without
its cache (training) unless it is traced, which a meta tensor cannot answer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

# The grouped matrix product (a mixture-of-experts layer's experts, transformers 5);
# None in a torch without it.
GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


@dataclass
class Trace:
    """What one forward did, in terms of the real model's objects (by ``id``)."""

    # Modules in the order their forward started, with the modules open around each.
    entries: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # id(parameter) -> module stacks (outermost first) at each use of that parameter.
    uses: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    @property
    def called(self) -> set[int]:
        return {m for m, _ in self.entries}


class _UseRecorder(TorchFunctionMode):
    def __init__(self, shadow_params: dict[int, int], stack: list[int], uses: dict):
        super().__init__()
        self._shadow_params = shadow_params  # id(meta param) -> id(real param)
        self._stack = stack
        self._uses = uses

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            real = self._shadow_params.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if real is not None:
                self._uses.setdefault(real, []).append(tuple(self._stack))
        return call_on_fakes(func, args, kwargs)


# Note [fake kernels]
# -------------------
# A few operators' fake kernels refuse calls that their real CPU kernels take.
# torch's meta ``_grouped_mm`` (the experts' product of transformers 5's
# mixtures of experts) checks the CUDA kernel's rule, bf16 only, while the CPU
# kernel multiplies float32 too: a float32 mixture would not run on fakes, and
# its plan and estimate would be the module structure's, with no FLOPs for its
# experts. The dry runs' own modes (the trace's ``_UseRecorder``, which sees
# ``torch._grouped_mm``; the cost run's counter, which sees the aten operator
# and counts the call as the model made it) call operators through
# ``call_on_fakes``, which runs such a call on bf16 twins of its fake inputs
# and gives the output in the caller's dtype: the shapes the real kernel makes.
# No mode of its own: one more Python mode on every operator cost the trace of
# a 40-layer Llama 7%.

# The calls of Note [fake kernels]: torch's function and its aten operator.
_BF16_ONLY = {f for f in (GROUPED_MM, getattr(torch, "_grouped_mm", None)) if f is not None}


def call_on_fakes(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` in a dry run, a call of Note [fake kernels] on bf16
    twins of its inputs."""
    if func in _BF16_ONLY and args[0].dtype != torch.bfloat16:
        wanted = kwargs.get("out_dtype") or args[0].dtype
        half = [
            a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        ]
        return func(*half, **{**kwargs, "out_dtype": None}).to(wanted)
    return func(*args, **kwargs)


def shadow_copy(
    model: torch.nn.Module, fake: FakeTensorMode, device: torch.device | None = None
) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are FakeTensors of ``fake`` over
    meta storages (no data is copied: ``deepcopy`` is handed a memo that maps every
    real tensor to its twin) and whose modules have no hooks.

    The weights are fake from the start, not converted as they enter an operator,
    so a view of a weight shares the weight's storage (the cost run tells weights
    from activations by it). Hooks are not copied: they may hold the runtime (a
    streaming engine's state-dict hooks, with its threads and locks), and none may
    run in a dry run. ``device``: the device the fakes claim (default meta; a real
    device type makes autocast apply to them).
    """
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(fake_like(p, fake, device), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake_like(b, fake, device)
    for m in model.modules():
        for name, value in vars(m).items():
            if name.endswith("_hooks") and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(model, memo)


def fake_like(t: torch.Tensor, fake: FakeTensorMode, device: torch.device | None = None):
    """A FakeTensor of ``fake`` shaped as ``t`` over a meta storage, claiming ``device``."""
    meta = torch.empty_like(t, device="meta")
    return fake.from_tensor(meta) if device is None else FakeTensor(fake, meta, device)


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
    return x


def trace_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> Trace:
    """Run ``model(*args, **kwargs)`` on meta tensors and record what it did.

    Raises whatever the model raises on meta tensors (for example a
    data-dependent ``.item()``); the caller falls back to a structural plan.
    """
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    shadow = shadow_copy(model, fake)
    shadow_params = {id(s): id(r) for r, s in zip(model.parameters(), shadow.parameters())}
    real_of = {id(s): id(r) for s, r in zip(shadow.modules(), model.modules())}

    trace = Trace()
    stack: list[int] = []
    handles = []

    def pre(mod, _args):
        trace.entries.append((real_of[id(mod)], tuple(stack)))
        stack.append(real_of[id(mod)])

    def post(mod, _args, _out):
        stack.pop()

    for m in shadow.modules():  # the shadow has none of the user's hooks (shadow_copy)
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    meta_args, meta_kwargs = pytree.tree_map(_to_meta, (args, kwargs))
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    try:
        with (
            torch.random.fork_rng(devices=devices),
            fake,
            _UseRecorder(shadow_params, stack, trace.uses),
        ):
            shadow(*meta_args, **meta_kwargs)
    finally:
        for h in handles:
            h.remove()
    return trace

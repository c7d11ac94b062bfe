"""What one training step costs per streaming unit, counted without computing.

The model is shadowed by the trace's copy (``trace.shadow_copy``: FakeTensors
over meta storages that claim the run's device, so that the device's own kernels
are chosen, CPU flash attention rather than its math decomposition, and autocast
applies; no data is copied), and the shadow runs one forward and one backward of
a scalar loss on fake inputs of the real batch shape, under the RNG fork.
``_Counter`` (a TorchDispatchMode) sees every aten operator: it counts it, its
FLOPs (``FlopCounterMode``'s formulas, for matmul-like operators and attention)
and the bytes it moves (Note [operator bytes] in operators.py), keeps the large
ones as kernels for the probe to time (Note [timed kernels]) and adds the new
outputs that take fresh pages (Note [fresh pages]). A saved-tensors hook sees
every tensor autograd keeps: the activation bytes (not weights or buffers; each
storage once). Module hooks on the units open and close their windows.

Note [attributing FLOPs]
------------------------
Forward: work goes to the innermost unit whose forward window is open (a unit
that encloses others gets only what runs outside its children's windows); with
no window open, to the "outside units" entry (the loss, root-level operators).
Backward: autograd numbers its nodes in the order they are made, so the
sequence number at each window switch of the forward says which unit made a
node, and the node running an operator in the backward
(``torch._C._current_autograd_node``) says whose backward it is. Gradient
accumulation into the leaves goes to the outside entry. (``FlopCounterMode``'s
own module tracking misattributes backward FLOPs around identity modules such
as ``Dropout(0.0)``.) If the backward cannot run on fakes, it counts as twice
the forward per entry (exact for products whose inputs all need gradients) and
``StepCosts.backward_measured`` is False.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._C._autograd import _get_sequence_nr
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from weightstream.compiler.operators import (
    EXTRA_FLOP_FORMULAS,
    KERNEL_BYTES,
    NO_TRAFFIC,
    QUERIES,
    Kernel,
    fresh_bytes,
    tensor_bytes,
)
from weightstream.runtime.partition import Plan
from weightstream.runtime.trace import clear_hooks, fake_like, shadow_copy

OUTSIDE_NAME = "<outside units>"


@dataclass
class UnitCost:
    """One step's cost of one unit (or of everything outside the units, index -1)."""

    index: int
    name: str
    numel: int = 0  # parameters fetched with the unit
    trainable_numel: int = 0  # of which require grad (gradients sent back, updated)
    weight_bytes: int = 0  # host master bytes
    trainable_bytes: int = 0  # host master bytes of the trainable parameters
    fwd_flops: int = 0
    bwd_flops: int = 0
    activation_bytes: int = 0  # saved for backward while its window was open
    pinned: bool = False
    trainable_tensors: int = 0  # parameter tensors the optimizer updates
    tensors: int = 0  # parameter tensors fetched with the unit
    fwd_ops: int = 0  # aten operators run in forward (views included)
    bwd_ops: int = 0
    fwd_bytes: int = 0  # bytes read + written by the operators that are not kernels
    bwd_bytes: int = 0
    fresh_bytes: int = 0  # new outputs in fresh pages, both passes
    # each kernel as (key, FLOPs, bytes it moves)
    fwd_kernels: list[tuple[str, int, int]] = field(default_factory=list)
    bwd_kernels: list[tuple[str, int, int]] = field(default_factory=list)

    flops = property(lambda self: self.fwd_flops + self.bwd_flops)
    ops = property(lambda self: self.fwd_ops + self.bwd_ops)

    @property
    def op_bytes(self) -> int:
        """Bytes every operator of both passes moves (kernels included)."""
        kernels = self.fwd_kernels + self.bwd_kernels
        return self.fwd_bytes + self.bwd_bytes + sum(b for *_, b in kernels)


@dataclass
class StepCosts:
    """Per-unit costs in plan order, what ran outside every unit window, the kernels."""

    units: list[UnitCost]
    outside: UnitCost
    backward_measured: bool = True
    backward_error: str | None = None  # why backward is 2 x forward
    batch: list = field(default_factory=list)  # (shape, dtype) of the example inputs
    kernels: dict[str, Kernel] = field(default_factory=dict)  # by key

    @property
    def entries(self) -> list[UnitCost]:
        return [*self.units, self.outside]

    def total(self, name: str) -> int:
        return sum(getattr(e, name) for e in self.entries)

    fwd_flops = property(lambda self: self.total("fwd_flops"))
    bwd_flops = property(lambda self: self.total("bwd_flops"))
    flops = property(lambda self: self.total("flops"))
    activation_bytes = property(lambda self: self.total("activation_bytes"))
    ops = property(lambda self: self.total("ops"))
    op_bytes = property(lambda self: self.total("op_bytes"))
    weight_bytes = property(lambda self: sum(u.weight_bytes for u in self.units))


def default_loss(output) -> torch.Tensor | None:
    """Sum of every floating output that requires grad (None: nothing to differentiate)."""
    leaves = [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return sum((t.sum() for t in leaves[1:]), leaves[0].sum()) if leaves else None


class _Counter(TorchDispatchMode):
    """Credits every operator to the entry and pass that own it (Note [attributing FLOPs])."""

    def __init__(self, n_units: int):
        super().__init__()
        flops = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
        self.formulas, self.outside, self.backward = flops.flop_registry, n_units, False
        self.stack: list[int] = []  # open unit windows, innermost last
        self.marks, self.owners = [-1], [n_units]  # sequence numbers at the switches, their unit
        # per pass and entry: FLOPs, operators, bytes, fresh bytes, kernels
        self.stats = {p: [[0, 0, 0, 0, []] for _ in range(n_units + 1)] for p in ("fwd", "bwd")}
        self.kernels: dict[str, Kernel] = {}

    def open_unit(self) -> int:
        return self.stack[-1] if self.stack else self.outside

    def switch(self) -> None:
        self.marks.append(_get_sequence_nr())
        self.owners.append(self.open_unit())

    def _owner(self) -> tuple[str, int]:
        node = torch._C._current_autograd_node()
        if node is None:
            return ("bwd", self.outside) if self.backward else ("fwd", self.open_unit())
        if type(node).__name__ == "AccumulateGrad":
            return "bwd", self.outside
        return "bwd", self.owners[bisect.bisect_right(self.marks, node._sequence_nr()) - 1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in QUERIES:
            return out
        formula = self.formulas.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        if func is torch.ops.aten.embedding.default:
            nbytes = tensor_bytes(args[1]) + 2 * tensor_bytes(out)
        elif func.is_view or func in NO_TRAFFIC:
            nbytes = 0
        else:
            nbytes = tensor_bytes((args, kwargs)) + tensor_bytes(out)
        phase, entry = self._owner()
        stats = self.stats[phase][entry]
        stats[0] += flops
        stats[1] += 1
        if not (func.is_view or func._schema.is_mutable):  # a new tensor
            stats[3] += fresh_bytes(out)
        if flops or nbytes >= KERNEL_BYTES:
            k = Kernel.of(func, args, kwargs, flops)
            k = self.kernels.setdefault(k.key, k)
            stats[4].append((k.key, flops, nbytes))
        else:
            stats[2] += nbytes
        return out


def unit_costs(
    model: torch.nn.Module,
    plan: Plan,
    example_args: tuple = (),
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    device: torch.device | str = "cpu",
    autocast: torch.dtype | None = None,
) -> StepCosts:
    """Count one training step of ``model`` per unit of ``plan`` on FakeTensors.

    ``example_args`` / ``example_kwargs``: a batch (only shapes, dtypes and
    ``requires_grad`` are used). ``loss_fn(output)`` makes the scalar whose
    backward is counted (default: :func:`default_loss`). ``device``: the device
    the run computes on, ``autocast``: its forward's autocast dtype (mixed
    precision). Raises what the model raises on fakes in forward.
    """
    n, device = len(plan.units), torch.device(device)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    shadow = shadow_copy(model, fake, device)
    resident = {t.untyped_storage()._cdata for t in (*shadow.parameters(), *shadow.buffers())}
    shadow_of = {id(r): s for r, s in zip(model.modules(), shadow.modules())}
    for m in shadow.modules():
        clear_hooks(m)  # the user's hooks (and a streamer's) must not run in a dry run
    c = _Counter(n)
    activation = [0] * (n + 1)
    saved: dict[int, torch.Tensor] = {}  # keeps the storages alive: ids stay unique

    def pre(index: int):
        def hook(_mod, _args) -> None:  # returns None: the arguments stay
            c.stack.append(index)
            c.switch()

        return hook

    def post(_mod, _args, _out):
        c.stack.pop()
        c.switch()

    handles = []
    for u in plan.units:
        mod = shadow_of[id(u.module)]
        handles.append(mod.register_forward_pre_hook(pre(u.index)))
        handles.append(mod.register_forward_hook(post, always_call=True))

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in resident and key not in saved:
            saved[key] = t
            activation[c.open_unit()] += t.untyped_storage().nbytes()
        return t

    def to_fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        return fake_like(x, fake, device).requires_grad_(x.requires_grad)

    args, kwargs = pytree.tree_map(to_fake, (tuple(example_args), example_kwargs or {}))
    batch = [(list(t.shape), str(t.dtype)) for t in pytree.tree_leaves((args, kwargs))
             if isinstance(t, torch.Tensor)]  # fmt: skip
    mixed = torch.autocast(device.type, autocast) if autocast else contextlib.nullcontext()
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    error = None
    try:
        with torch.random.fork_rng(devices=devices), fake, c, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with mixed:
                    out = shadow(*args, **kwargs)
                loss = (loss_fn or default_loss)(out)
            c.backward = True
            if loss is not None:
                try:
                    loss.backward()
                except Exception as exc:  # an operator without a fake backward
                    error = f"{type(exc).__name__}: {exc}"
    finally:
        for h in handles:
            h.remove()
    fwd, bwd = c.stats["fwd"], c.stats["bwd"]
    if error is not None:  # twice the forward (see the Note)
        bwd = [[*(2 * x for x in s[:4]), [(k, 2 * f, 2 * b) for k, f, b in s[4]]] for s in fwd]

    def fields(i: int) -> dict:
        (ff, fo, fb, fr, fk), (bf, bo, bb, br, bk) = fwd[i], bwd[i]
        return dict(
            fwd_flops=ff, bwd_flops=bf, activation_bytes=activation[i], fwd_ops=fo, bwd_ops=bo,
            fwd_bytes=fb, bwd_bytes=bb, fresh_bytes=fr + br, fwd_kernels=fk, bwd_kernels=bk,
        )  # fmt: skip

    units = []
    for u in plan.units:
        trainable = [p for p in u.params if p.requires_grad]
        units.append(
            UnitCost(
                u.index,
                u.display_name,
                numel=u.numel,
                trainable_numel=sum(p.numel() for p in trainable),
                weight_bytes=u.weight_bytes,
                trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
                pinned=u.pinned,
                trainable_tensors=len(trainable),
                tensors=len(u.params),
                **fields(u.index),
            )
        )
    outside = UnitCost(-1, OUTSIDE_NAME, **fields(n))
    return StepCosts(units, outside, error is None, error, batch, c.kernels)

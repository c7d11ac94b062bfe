"""What one training step costs per streaming unit, counted without computing.

The model is shadowed by the trace's copy (``trace.shadow_copy``: FakeTensors
over meta storages that claim the run's device, so that the device's own kernels
are chosen, CPU flash attention rather than its math decomposition, and autocast
applies; no data is copied), and the shadow runs one forward and one backward of
a scalar loss on fake inputs of the real batch shape, under the RNG fork.
``_Counter`` (a TorchDispatchMode, with ``FlopCounterMode`` counting the FLOPs
of matmul-like operators) sees every aten operator: it counts them, adds the
bytes each moves (Note [operator bytes] in operators.py), keeps the large ones
as kernels for the probe to time (Note [timed kernels]) and adds the new outputs
that take fresh pages (Note [fresh pages]). A saved-tensors hook sees every
tensor autograd keeps: the activation bytes (not weights or buffers; each
storage once). Module hooks on the units open and close their windows.

Note [attributing FLOPs]
------------------------
Forward: work goes to the innermost unit whose forward window is open (a unit
that encloses others gets only what runs outside its children's windows); with
no window open, to the "outside units" entry (the loss, root-level operators).
Backward: every autograd node created while a window was open is tagged with
that unit (a TorchFunctionMode walks the new part of the graph after each torch
call), and a pre-hook / post-hook pair on the node gives the unit the work done
while it runs. The FLOP counter is read at each switch, so the entries sum to
``FlopCounterMode``'s total (whose own module tracking misattributes backward
FLOPs around identity modules such as ``Dropout(0.0)``). If the backward cannot
run on fakes, it counts as twice the forward per entry (exact for products whose
inputs all need gradients) and ``StepCosts.backward_measured`` is False.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
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
    """Credits every operator to the entry and pass that own it now (see the module
    docstring); reads the FLOP counter at every switch."""

    def __init__(self, flops: FlopCounterMode, n_units: int):
        super().__init__()
        self.counter = flops
        entries = range(n_units + 1)  # index n_units: outside
        # per pass and entry: FLOPs, operators, bytes, fresh bytes, kernels
        self.stats = {p: [[0, 0, 0, 0, []] for _ in entries] for p in ("fwd", "bwd")}
        self.kernels: dict[str, Kernel] = {}
        self.outside = self.current = n_units
        self.phase, self._seen = "fwd", 0

    def switch(self, phase: str, entry: int) -> None:
        total = self.counter.get_total_flops()
        self.stats[self.phase][self.current][0] += total - self._seen
        self._seen, self.phase, self.current = total, phase, entry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in QUERIES:
            return out
        formula = self.counter.flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        if func is torch.ops.aten.embedding.default:
            nbytes = tensor_bytes(args[1]) + 2 * tensor_bytes(out)
        elif func.is_view or func in NO_TRAFFIC:
            nbytes = 0
        else:
            nbytes = tensor_bytes((args, kwargs)) + tensor_bytes(out)
        stats = self.stats[self.phase][self.current]
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


class _NodeTagger(TorchFunctionMode):
    """Tags the autograd nodes each torch call creates with the open unit (Note
    [attributing FLOPs])."""

    def __init__(self, current_unit: Callable[[], int], on_new_node: Callable):
        super().__init__()
        self._current_unit, self._on_new_node = current_unit, on_new_node
        self.tagged: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        todo = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        entry = self._current_unit()
        while todo:
            node = todo.pop()
            if node is None or node in self.tagged:
                continue
            self.tagged.add(node)
            if type(node).__name__ != "AccumulateGrad":  # a leaf: no compute of its own
                self._on_new_node(node, entry)
            todo.extend(n for n, _ in node.next_functions)
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
    flops = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    c = _Counter(flops, n)
    stack: list[int] = []  # open unit windows, innermost last
    activation = [0] * (n + 1)
    saved: dict[int, torch.Tensor] = {}  # keeps the storages alive: ids stay unique

    def open_unit() -> int:
        return stack[-1] if stack else n

    def pre(index: int):
        def hook(_mod, _args) -> None:  # returns None: the arguments stay
            c.switch("fwd", index)
            stack.append(index)

        return hook

    def post(_mod, _args, _out):
        stack.pop()
        c.switch("fwd", open_unit())

    handles = []
    for u in plan.units:
        mod = shadow_of[id(u.module)]
        handles.append(mod.register_forward_pre_hook(pre(u.index)))
        handles.append(mod.register_forward_hook(post, always_call=True))

    def on_new_node(node, entry: int) -> None:
        node.register_prehook(lambda _grad_outputs: c.switch("bwd", entry))
        node.register_hook(lambda _grad_inputs, _grad_outputs: c.switch("bwd", c.outside))

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in resident and key not in saved:
            saved[key] = t
            activation[open_unit()] += t.untyped_storage().nbytes()
        return t

    def to_fake(x):
        return (
            fake_like(x, fake, device).requires_grad_(x.requires_grad)
            if isinstance(x, torch.Tensor)
            else x
        )

    args, kwargs = pytree.tree_map(to_fake, (tuple(example_args), example_kwargs or {}))
    batch = [
        (list(t.shape), str(t.dtype))
        for t in pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor)
    ]
    mixed = torch.autocast(device.type, autocast) if autocast else contextlib.nullcontext()
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    error = None
    try:
        with torch.random.fork_rng(devices=devices), fake, flops, c:
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            with torch.enable_grad(), _NodeTagger(open_unit, on_new_node), hooks:
                with mixed:
                    out = shadow(*args, **kwargs)
                loss = (loss_fn or default_loss)(out)
            c.switch("bwd", c.outside)
            if loss is not None:
                try:
                    loss.backward()
                except Exception as exc:  # an operator without a fake backward
                    error = f"{type(exc).__name__}: {exc}"
            c.switch("bwd", c.outside)
    finally:
        for h in handles:
            h.remove()
    fwd, bwd = c.stats["fwd"], c.stats["bwd"]
    if error is not None:  # twice the forward (see the Note)
        bwd = [
            [2 * s[0], 2 * s[1], 2 * s[2], 2 * s[3], [(k, 2 * f, 2 * b) for k, f, b in s[4]]]
            for s in fwd
        ]

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


class _Function(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def function_costs(fn: Callable, example_args: tuple) -> UnitCost:
    """The costs of one forward and backward of ``fn(*example_args)``, as one entry
    (the probe counts the operators it times with this)."""
    return unit_costs(_Function(fn), Plan([], traced=True), example_args).outside

"""What one training step costs per streaming unit, measured on the meta device.

The model is shadowed by the trace's copy (``trace.shadow_copy``: FakeTensors
over meta storages, no data copied; the run is under their FakeTensorMode, so
that libraries skip their data-dependent checks), and the shadow runs one
forward and one backward of a scalar loss on meta inputs of the real batch
shape, under the RNG fork, so no real random number is drawn.
Three instruments watch that run:

* ``FlopCounterMode`` (torch.utils.flop_counter) counts FLOPs. It counts
  matmul-like operators only (mm, addmm, bmm, convolution, attention);
  elementwise work, norms and reductions count 0. See Note [attributing FLOPs].
* a saved-tensors pack hook sees every tensor autograd keeps for backward:
  the activation bytes of the unit whose window is open when it is saved.
  Weights (views of a parameter) and buffers are not counted: the streamer
  replaces saved weights by a record and fetches them again in backward, and
  buffers stay resident anyway. Each storage counts once (a tensor saved by
  two operators, or a view of an already saved tensor, is memory held once).
* module hooks on the unit modules, which open and close the unit windows.
* a TorchDispatchMode (``_OpCounter``) sees every aten operator that runs: it
  counts them (each costs a fixed dispatch and autograd overhead on a real
  run, whatever its size), keeps each matmul-like operator as (FLOPs, bytes)
  and adds the bytes that the other operators read and write (elementwise,
  norms, reductions, casts: Note [operator bytes]). The same attribution as
  the FLOPs decides which entry gets them.

Note [attributing FLOPs]
------------------------
Forward: FLOPs go to the innermost unit whose forward window is open (so a
pinned unit that encloses others, like a root with its own parameters, gets
only what runs outside its children's windows); with no window open, to the
"outside units" entry (the loss, root-level operators of a root that is not
a unit). Backward: every autograd node created while a window was open is
tagged with that unit (a TorchFunctionMode walks the new part of the graph
after each torch call), and a pre-hook / post-hook pair on the node makes the
FLOPs counted while the node runs belong to the unit. The counter is read at
each switch, so each FLOP goes to exactly one entry, and the entries sum to
``FlopCounterMode``'s global total. FlopCounterMode's own module hierarchy is
not used for backward: it tracks modules through hooks on module inputs and
outputs and misattributes backward FLOPs around identity modules (a
``Dropout(0.0)`` returns its input).

If the backward cannot run on the meta device, backward FLOPs fall back to
2 x forward per entry (exact for matmul-like operators whose inputs all need
gradients: one product for the input gradient, one for the weight gradient)
and ``StepCosts.backward_measured`` is False.
"""

from __future__ import annotations

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
    FUSED_ON_DEVICE,
    NO_TRAFFIC,
    QUERIES,
    tensor_bytes,
)
from weightstream.runtime.partition import Plan
from weightstream.runtime.trace import _to_meta, clear_hooks, shadow_copy

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
    tensors: int = 0  # parameter tensors fetched with the unit (each costs streaming work)
    fwd_ops: int = 0  # aten operators run in forward (views included)
    bwd_ops: int = 0
    fwd_bytes: int = 0  # bytes read + written by the operators without FLOPs
    bwd_bytes: int = 0
    # each matmul-like operator (attention included) as (FLOPs, bytes it moves);
    # their FLOPs sum to fwd_flops / bwd_flops
    fwd_products: list[tuple[int, int]] = field(default_factory=list)
    bwd_products: list[tuple[int, int]] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    @property
    def op_bytes(self) -> int:
        """Bytes every operator of both passes moves (products included)."""
        products = sum(b for _, b in (*self.fwd_products, *self.bwd_products))
        return self.fwd_bytes + self.bwd_bytes + products

    @property
    def ops(self) -> int:
        return self.fwd_ops + self.bwd_ops


@dataclass
class StepCosts:
    """Per-unit costs in plan order, and what ran outside every unit window."""

    units: list[UnitCost]
    outside: UnitCost
    backward_measured: bool = True
    backward_error: str | None = None  # why backward FLOPs are 2 x forward
    batch: list = field(default_factory=list)  # (shape, dtype) of the example inputs

    @property
    def entries(self) -> list[UnitCost]:
        return [*self.units, self.outside]

    @property
    def fwd_flops(self) -> int:
        return sum(e.fwd_flops for e in self.entries)

    @property
    def bwd_flops(self) -> int:
        return sum(e.bwd_flops for e in self.entries)

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    @property
    def weight_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units)

    @property
    def activation_bytes(self) -> int:
        return sum(e.activation_bytes for e in self.entries)

    @property
    def ops(self) -> int:
        return sum(e.ops for e in self.entries)

    @property
    def op_bytes(self) -> int:
        return sum(e.op_bytes for e in self.entries)


def default_loss(output) -> torch.Tensor | None:
    """Sum of every floating output that requires grad (None: nothing to differentiate)."""
    leaves = [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not leaves:
        return None
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


@dataclass
class _PassStats:
    """What ``_OpCounter`` saw of one entry in one pass."""

    ops: int = 0
    bytes: int = 0  # moved by the operators without FLOPs
    products: list[tuple[int, int]] = field(default_factory=list)  # (FLOPs, bytes) each

    def scaled(self, k: int) -> _PassStats:
        return _PassStats(k * self.ops, k * self.bytes, [(k * f, k * b) for f, b in self.products])


class _Attribution:
    """Reads the FLOP counter at every switch of the entry that owns the work."""

    def __init__(self, counter: FlopCounterMode, n_units: int):
        self.counter = counter
        self.fwd = [0] * (n_units + 1)  # index n_units: outside
        self.bwd = [0] * (n_units + 1)
        self.fwd_stats = [_PassStats() for _ in range(n_units + 1)]
        self.bwd_stats = [_PassStats() for _ in range(n_units + 1)]
        self.outside = n_units
        self.phase = self.fwd
        self.current = n_units
        self._seen = 0

    def switch(self, phase: list[int], entry: int) -> None:
        total = self.counter.get_total_flops()
        self.phase[self.current] += total - self._seen
        self._seen = total
        self.phase, self.current = phase, entry

    def stats(self) -> _PassStats:
        """The operator statistics of the entry and pass open now."""
        return (self.fwd_stats if self.phase is self.fwd else self.bwd_stats)[self.current]


class _OpCounter(TorchDispatchMode):
    """Counts operators, their bytes and the products' FLOPs into the open entry."""

    def __init__(self, att: _Attribution, flop_registry: dict):
        super().__init__()
        self.att = att
        self.flop_registry = flop_registry
        self.suspended = 0  # > 0: inside a fused call (its cost was credited as a whole)

    def credit(self, nbytes: int, flops: int) -> None:
        """One fused operator (Note [operator bytes])."""
        stats = self.att.stats()
        stats.ops += 1
        stats.products.append((flops, nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended or func in QUERIES:
            return out
        stats = self.att.stats()
        stats.ops += 1
        formula = self.flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            stats.products.append((flops, tensor_bytes((args, kwargs)) + tensor_bytes(out)))
        elif func is torch.ops.aten.embedding.default:
            stats.bytes += tensor_bytes(args[1]) + 2 * tensor_bytes(out)
        elif not (func.is_view or func in NO_TRAFFIC):
            stats.bytes += tensor_bytes((args, kwargs)) + tensor_bytes(out)
        return out


class _NodeTagger(TorchFunctionMode):
    """Tags the autograd nodes each torch call creates with the open unit (see the Note).

    A call in ``FUSED_ON_DEVICE`` is counted by ``ops`` as one operator (see
    Note [operator bytes]); its new nodes are tagged ``fused`` ("top" for the
    node of its output, which carries the backward's credit, "inner" else).
    """

    def __init__(self, current_unit: Callable[[], int], on_new_node: Callable, ops: _OpCounter):
        super().__init__()
        self._current_unit = current_unit
        self._on_new_node = on_new_node
        self._ops = ops
        self.tagged: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        fused = func in FUSED_ON_DEVICE and not self._ops.suspended
        if fused:
            flops_before = self._ops.att.counter.get_total_flops()
            self._ops.suspended += 1
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            if fused:
                self._ops.suspended -= 1
        bwd_credit = None  # (bytes, FLOPs) of the fused call's backward
        if fused:
            fwd_bytes = tensor_bytes((args, kwargs)) + tensor_bytes(out)
            fwd_flops = self._ops.att.counter.get_total_flops() - flops_before
            self._ops.credit(fwd_bytes, fwd_flops)
            # Backward of the math path: 4 products for forward's 2 (dQ, dK, dV, dP).
            bwd_credit = (2 * fwd_bytes, 2 * fwd_flops)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        tops = {t.grad_fn for t in outs if t.grad_fn is not None}
        todo = list(tops)
        entry = self._current_unit()
        while todo:
            node = todo.pop()
            if node is None or node in self.tagged:
                continue
            self.tagged.add(node)
            if type(node).__name__ != "AccumulateGrad":  # a leaf: no compute of its own
                if bwd_credit is None:
                    self._on_new_node(node, entry)
                else:
                    role = "top" if node in tops else "inner"
                    self._on_new_node(node, entry, role, bwd_credit)
            todo.extend(n for n, _ in node.next_functions)
        return out


def unit_costs(
    model: torch.nn.Module,
    plan: Plan,
    example_args: tuple = (),
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
) -> StepCosts:
    """Measure one training step of ``model`` per unit of ``plan`` on the meta device.

    ``example_args`` / ``example_kwargs``: a batch (real or meta tensors; only
    shapes, dtypes and ``requires_grad`` are used). ``loss_fn(output)`` makes
    the scalar whose backward is measured; default: the sum of the floating
    outputs (:func:`default_loss`). Raises what the model raises on meta
    tensors in forward (the caller decides what to do without costs).
    """
    example_kwargs = example_kwargs or {}
    loss_fn = loss_fn or default_loss
    n = len(plan.units)
    # Under a FakeTensorMode, as in trace.py: libraries skip their data-dependent
    # checks for FakeTensors (transformers' mask helpers), not for meta tensors.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    shadow = shadow_copy(model, fake)
    # The weights' storages: a saved view of one is not an activation (``pack``).
    resident = {t.untyped_storage()._cdata for t in (*shadow.parameters(), *shadow.buffers())}
    shadow_of = {id(r): s for r, s in zip(model.modules(), shadow.modules())}
    for m in shadow.modules():
        clear_hooks(m)  # the user's hooks (and a streamer's) must not run in a dry run

    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    att = _Attribution(counter, n)
    ops = _OpCounter(att, counter.flop_registry)
    stack: list[int] = []  # open unit windows (unit indices), innermost last
    activation = [0] * (n + 1)
    saved_storages: dict[int, torch.Tensor] = {}  # keeps the storages alive: ids stay unique
    handles = []

    def open_unit() -> int:
        return stack[-1] if stack else n

    def make_pre(index: int):
        def pre(_mod, _args):
            att.switch(att.fwd, index)
            stack.append(index)

        return pre

    def post(_mod, _args, _out):
        stack.pop()
        att.switch(att.fwd, open_unit())

    for u in plan.units:
        mod = shadow_of[id(u.module)]
        handles.append(mod.register_forward_pre_hook(make_pre(u.index)))
        handles.append(mod.register_forward_hook(post, always_call=True))

    def on_new_node(node, entry: int, fused: str | None = None, credit=None) -> None:
        def node_pre(_grad_outputs):
            att.switch(att.bwd, entry)
            if fused == "top":
                ops.credit(*credit)
            if fused is not None:
                ops.suspended += 1

        def node_post(_grad_inputs, _grad_outputs):
            if fused is not None:
                ops.suspended -= 1
            att.switch(att.bwd, att.outside)

        node.register_prehook(node_pre)
        node.register_hook(node_post)

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in resident and key not in saved_storages:
            saved_storages[key] = t
            activation[open_unit()] += storage.nbytes()
        return t

    meta_args, meta_kwargs = pytree.tree_map(_to_meta, (tuple(example_args), example_kwargs))
    batch = [
        (list(t.shape), str(t.dtype))
        for t in pytree.tree_leaves((meta_args, meta_kwargs))
        if isinstance(t, torch.Tensor)
    ]
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    backward_error = None
    try:
        with torch.random.fork_rng(devices=devices), fake, counter, ops:
            tagger = _NodeTagger(open_unit, on_new_node, ops)
            with torch.enable_grad(), tagger, torch.autograd.graph.saved_tensors_hooks(pack, _id):
                out = shadow(*meta_args, **meta_kwargs)
                loss = loss_fn(out)
            att.switch(att.bwd, att.outside)
            if loss is not None:
                try:
                    loss.backward()
                except Exception as exc:  # an operator without a meta backward
                    backward_error = f"{type(exc).__name__}: {exc}"
            att.switch(att.bwd, att.outside)
    finally:
        for h in handles:
            h.remove()

    fwd, bwd = att.fwd, att.bwd
    fwd_stats, bwd_stats = att.fwd_stats, att.bwd_stats
    if backward_error is not None:
        # Twice the forward, also for the operators: a backward operator per
        # input of each forward one, roughly.
        bwd = [2 * f for f in fwd]
        bwd_stats = [s.scaled(2) for s in fwd_stats]

    def op_fields(i: int) -> dict:
        f, b = fwd_stats[i], bwd_stats[i]
        return dict(
            fwd_flops=fwd[i],
            bwd_flops=bwd[i],
            activation_bytes=activation[i],
            fwd_ops=f.ops,
            bwd_ops=b.ops,
            fwd_bytes=f.bytes,
            bwd_bytes=b.bytes,
            fwd_products=f.products,
            bwd_products=b.products,
        )

    units = []
    for u in plan.units:
        trainable = [p for p in u.params if p.requires_grad]
        units.append(
            UnitCost(
                index=u.index,
                name=u.display_name,
                numel=u.numel,
                trainable_numel=sum(p.numel() for p in trainable),
                weight_bytes=u.weight_bytes,
                trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
                pinned=u.pinned,
                trainable_tensors=len(trainable),
                tensors=len(u.params),
                **op_fields(u.index),
            )
        )
    outside = UnitCost(index=-1, name=OUTSIDE_NAME, **op_fields(n))
    return StepCosts(units, outside, backward_error is None, backward_error, batch)


def _id(x):
    return x


class _Function(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def function_costs(fn: Callable, example_args: tuple, loss_fn: Callable | None = None) -> UnitCost:
    """The costs of one forward and backward of ``fn(*example_args)``, as one entry.

    The same instruments as :func:`unit_costs` (the probe counts the operators
    it times with this, so that counting and timing agree).
    """
    costs = unit_costs(_Function(fn), Plan([], traced=True), example_args, loss_fn=loss_fn)
    return costs.outside

"""What one training step costs per streaming unit, measured on the meta device.

The model is shadowed by a meta copy (the technique of ``trace.py``: ``deepcopy``
with a memo mapping every real tensor to a meta twin, so no data is copied), and
the shadow runs one forward and one backward of a scalar loss on meta inputs of
the real batch shape, under the RNG fork, so no real random number is drawn.
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

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from weightstream.compiler.partition import Plan
from weightstream.compiler.trace import _to_meta

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

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops


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


def _flash_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _flash_cpu_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel
# (it would count 0 for attention on a real CPU run). On meta, attention takes
# the math path (bmm, counted); these make a real CPU run count the same.
EXTRA_FLOP_FORMULAS: dict = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward_flop,
}


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


class _Attribution:
    """Reads the FLOP counter at every switch of the entry that owns the work."""

    def __init__(self, counter: FlopCounterMode, n_units: int):
        self.counter = counter
        self.fwd = [0] * (n_units + 1)  # index n_units: outside
        self.bwd = [0] * (n_units + 1)
        self.outside = n_units
        self.phase = self.fwd
        self.current = n_units
        self._seen = 0

    def switch(self, phase: list[int], entry: int) -> None:
        total = self.counter.get_total_flops()
        self.phase[self.current] += total - self._seen
        self._seen = total
        self.phase, self.current = phase, entry


class _NodeTagger(TorchFunctionMode):
    """Tags the autograd nodes each torch call creates with the open unit (see the Note)."""

    def __init__(self, current_unit: Callable[[], int], on_new_node: Callable):
        super().__init__()
        self._current_unit = current_unit
        self._on_new_node = on_new_node
        self.tagged: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        todo = [
            t.grad_fn
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
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


def _shadow(model: torch.nn.Module):
    """A meta copy of ``model`` (see trace.py), the ids of its weight storages."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    shadow = copy.deepcopy(model, memo)
    resident = {t.untyped_storage()._cdata for t in (*shadow.parameters(), *shadow.buffers())}
    return shadow, resident


def _clear_hooks(m: torch.nn.Module) -> None:
    # The user's hooks (and an installed streamer's) must not run in a dry run.
    m._forward_pre_hooks.clear()
    m._forward_hooks.clear()
    m._forward_hooks_always_called.clear()
    m._forward_hooks_with_kwargs.clear()
    m._forward_pre_hooks_with_kwargs.clear()
    m._backward_hooks.clear()
    m._backward_pre_hooks.clear()


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
    shadow, resident = _shadow(model)
    shadow_of = {id(r): s for r, s in zip(model.modules(), shadow.modules())}
    for m in shadow.modules():
        _clear_hooks(m)

    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    att = _Attribution(counter, n)
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

    def on_new_node(node, entry: int) -> None:
        def node_pre(_grad_outputs):
            att.switch(att.bwd, entry)

        def node_post(_grad_inputs, _grad_outputs):
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
        with torch.random.fork_rng(devices=devices), counter:
            tagger = _NodeTagger(open_unit, on_new_node)
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
    if backward_error is not None:
        bwd = [2 * f for f in fwd]
    units = []
    for u in plan.units:
        units.append(
            UnitCost(
                index=u.index,
                name=u.display_name,
                numel=u.numel,
                trainable_numel=sum(p.numel() for p in u.params if p.requires_grad),
                weight_bytes=u.weight_bytes,
                trainable_bytes=sum(
                    p.numel() * p.element_size() for p in u.params if p.requires_grad
                ),
                fwd_flops=fwd[u.index],
                bwd_flops=bwd[u.index],
                activation_bytes=activation[u.index],
                pinned=u.pinned,
            )
        )
    outside = UnitCost(
        index=-1,
        name=OUTSIDE_NAME,
        fwd_flops=fwd[n],
        bwd_flops=bwd[n],
        activation_bytes=activation[n],
    )
    return StepCosts(units, outside, backward_error is None, backward_error, batch)


def _id(x):
    return x

"""What one training step costs per streaming unit, counted without computing.

The model's shadow (``trace.shadow_copy``: FakeTensors over meta storages that
claim the run's device, so that its own kernels are chosen and autocast applies)
runs one forward and one backward of a scalar loss on fake inputs of the batch's
shape, under the RNG fork. ``_Counter`` (a TorchDispatchMode) sees every aten
operator and credits its FLOPs (``FlopCounterMode``'s formulas), its bytes (Note
[operator bytes]), its kernel (Note [timed kernels]) and its fresh pages (Note
[fresh pages]) to a unit. A saved-tensors hook counts what autograd keeps
(activations, not weights or buffers, each storage once).

Note [attributing FLOPs]
------------------------
Forward: work goes to the innermost unit whose forward window is open, else to
the "outside units" entry (the loss, root-level operators). Backward: autograd
numbers its nodes in the order they are made, so the sequence number at each
window switch says which unit made a node, and the node running an operator
(``torch._C._current_autograd_node``) whose backward it is; accumulation into
the leaves goes outside. (``FlopCounterMode``'s own module tracking misplaces
backward FLOPs around identity modules such as ``Dropout(0.0)``.) A backward
that cannot run on fakes counts as twice the forward (exact for products whose
inputs all need gradients), and ``backward_measured`` is False.

Note [operator bytes]
---------------------
An operator moves ``inputs + outputs`` bytes (an expanded input counts its
storage, an in-place result counts as written); ``embedding`` reads the gathered
rows, not the whole table. Views and allocations move nothing but still count as
operators: each costs its dispatch.

Note [timed kernels]
--------------------
The large kernels of a step are far from the roofline's max(FLOPs / peak, bytes
/ bandwidth): on a 2-core EPYC bf16 attention runs at 35 to 300 GFLOP/s by shape
against a 930 GFLOP/s matmul peak, a bf16 GELU at a sixth of the memory
bandwidth. So every operator with FLOPs, and every other one moving at least
``KERNEL_BYTES``, is a *kernel*, keyed by the operator and its arguments'
shapes, strides, dtypes and scalars. The probe runs it once per machine on
tensors of that specification, cycling through argument copies larger than the
caches (in a step its operands were written long before), and caches its
seconds (``probe.time_kernels``). The small operators are priced by bytes and count.

Note [fresh pages]
------------------
On the CPU glibc maps every allocation over its mmap threshold (32 MiB at most)
afresh, and the kernel faults its pages in and zeroes them, in the step, on the
threads that compute: in a GPT-2 small step (batch 8 x 1024) 9 s of 17 s, while
a kernel timed in a small process sees little of it (a vocabulary-wide
log-softmax: 0.13 s timed, 1.8 s in the step). So each new output of at least
``FRESH_BYTES`` counts as fresh bytes, priced at the probe's first-touch rate of
fresh 4 KiB pages (huge pages are not to be counted on in a long run's
fragmented memory). A disk store fixes the threshold at 128 KiB (Note [disk
tier] in runtime/store.py): its runs count from there (gpt2_tiny_ws: 101
samples/s against 170 in RAM). An accelerator's caching allocator reuses its
blocks.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch._C._autograd import _get_sequence_nr
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from weightstream.runtime.partition import Plan
from weightstream.runtime.trace import GROUPED_MM, call_on_fakes, fake_like, shadow_copy

OUTSIDE_NAME = "<outside units>"
KERNEL_BYTES = 1 << 20  # Note [timed kernels]
COLD_BYTES, COLD_COPIES = 64 << 20, 16  # argument copies a timing cycles through
FRESH_BYTES = 32 << 20  # Note [fresh pages]

_aten = torch.ops.aten
# FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel.
EXTRA_FLOP_FORMULAS: dict = {
    _aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
    ),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *a, out_shape=None, **kw: sdpa_backward_flop_count(g, q, k, v)
    ),
}


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``_grouped_mm(a, b, offs)`` from the shapes: each output value is a
    product of ``a``'s last dimension, but for 2-D x 2-D, where ``offs`` splits that
    dimension over the groups (a weight's gradient: K x M, M x N -> groups x K x N)."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


if GROUPED_MM is not None:  # FlopCounterMode has no formula for it
    EXTRA_FLOP_FORMULAS[_aten._grouped_mm] = _grouped_mm_flops


def _balanced_offsets(args: tuple, kwargs: dict) -> None:
    """A grouped product's ``offs`` (the groups' ends along the split dimension) as an
    even split, in place: a timing of it sees every group at work, as an even
    routing of tokens to experts would (``TensorSpec.make`` gives zeros: all groups
    empty)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if offs is None:
        return
    # 2-D x 2-D (a weight's gradient): offs splits the shared dimension; 2-D x 3-D (the
    # forward, an input's gradient): the rows of ``a``, the tokens.
    total = a.shape[1] if b.dim() == 2 else a.shape[0]
    groups = offs.numel()
    ends = [(i + 1) * total // groups for i in range(groups)]
    offs.copy_(torch.tensor(ends, dtype=offs.dtype))


_QUERIES = "sym_size sym_stride sym_numel sym_storage_offset size stride numel dim is_contiguous"
# Queries of tensor metadata: not operators a real run dispatches as kernels.
QUERIES = {getattr(_aten, n).default for n in f"{_QUERIES} storage_offset".split()}
QUERIES |= {_aten.is_contiguous.memory_format, torch.ops.prim.device.default}
QUERIES.add(torch.ops.prim.layout.default)
# Operators that allocate or alias without touching data.
NO_TRAFFIC = {_aten.empty.memory_format, _aten._unsafe_view.default, _aten.lift_fresh.default}
NO_TRAFFIC |= {getattr(_aten, n).default for n in "empty_like empty_strided new_empty".split()}
NO_TRAFFIC.add(_aten.new_empty_strided.default)


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in ``tree`` (an expanded tensor: its storage)."""
    leaves = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in leaves)


def fresh_bytes(tree, smallest: int = FRESH_BYTES) -> int:
    """Bytes of the tensors in ``tree`` of at least ``smallest`` each (Note [fresh pages])."""
    sizes = [tensor_bytes(t) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return sum(n for n in sizes if n >= smallest)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def storage_numel(self) -> int:
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return span if all(self.shape) else 0

    def make(self, device: torch.device) -> torch.Tensor:
        """Floats in [0.5, 1.5) (safe for log, sqrt, division), integers 0 (valid
        indices), booleans True."""
        base = torch.empty(self.storage_numel, dtype=self.dtype, device=device)
        if self.dtype.is_floating_point:
            return base.uniform_(0.5, 1.5).as_strided(self.shape, self.stride)
        return base.fill_(self.dtype == torch.bool).as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class Kernel:
    """One operator call to time again: ``fn(*args, **kwargs)`` with ``TensorSpec`` leaves."""

    fn: Callable
    args: tuple
    kwargs: dict
    flops: int = 0  # not part of the key

    @functools.cached_property
    def key(self) -> str:  # a repr of every argument: made once
        return f"{self.fn}{(self.args, self.kwargs)!r}"

    @property
    def nbytes(self) -> int:
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return sum(t.storage_numel * t.dtype.itemsize for t in leaves if isinstance(t, TensorSpec))

    def runner(self, device: torch.device) -> Callable[[], object]:
        """Calls on tensors of ``device``, cycling through copies of the arguments."""

        def real(x):
            if isinstance(x, TensorSpec):
                return x.make(device)
            return device if isinstance(x, torch.device) else x

        copies = max(1, min(COLD_COPIES, COLD_BYTES // max(1, self.nbytes)))
        made = [pytree.tree_map(real, (self.args, self.kwargs)) for _ in range(copies)]
        if self.fn is GROUPED_MM:
            for a, k in made:
                _balanced_offsets(a, k)
        turn = itertools.cycle([functools.partial(self.fn, *a, **k) for a, k in made])
        return lambda: next(turn)()

    @classmethod
    def of(cls, fn: Callable, args, kwargs, flops: int = 0) -> Kernel:
        """The kernel of a call seen under the cost counter (fake tensors -> specs)."""

        def spec(x):
            is_tensor = isinstance(x, torch.Tensor)
            return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype) if is_tensor else x

        return cls(fn, *pytree.tree_map(spec, (tuple(args), dict(kwargs or {}))), flops)


@dataclass
class UnitCost:
    """One step's cost of one unit (or of everything outside the units, index -1)."""

    index: int
    name: str
    numel: int = 0  # parameters fetched with the unit
    # of which require grad and are updated here (gradients sent back): a tied
    # parameter's update is its first unit's
    trainable_numel: int = 0
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


def default_loss(output) -> torch.Tensor | None:
    """Sum of every floating output that requires grad (None: nothing to differentiate)."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    leaves = [t for t in leaves if t.requires_grad and t.is_floating_point()]
    return sum((t.sum() for t in leaves[1:]), leaves[0].sum()) if leaves else None


class _Counter(TorchDispatchMode):
    """Credits every operator to the entry and pass that own it (Note [attributing FLOPs])."""

    def __init__(self, n_units: int, fresh_from: int):
        super().__init__()
        self.fresh_from = fresh_from
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
        out = call_on_fakes(func, args, kwargs)  # Note [fake kernels] in runtime/trace.py
        if func in QUERIES:
            return out
        formula = self.formulas.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        if func is _aten.embedding.default:
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
            stats[3] += fresh_bytes(out, self.fresh_from)
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
    fresh_from: int = FRESH_BYTES,
    recompute: Collection[int] = (),
) -> StepCosts:
    """Count one training step of ``model`` per unit of ``plan`` on FakeTensors.

    ``example_args`` / ``example_kwargs``: a batch (only shapes, dtypes and
    ``requires_grad`` are used). ``loss_fn(output)`` makes the scalar whose
    backward is counted (default: :func:`default_loss`). ``device``: the device
    the run computes on, ``autocast``: its forward's autocast dtype (mixed
    precision); ``fresh_from``: the smallest allocation mapped afresh (Note [fresh
    pages]). ``recompute``: the units whose forward runs again in the backward
    (activation checkpointing): what they keep is their input, not what their
    operators save. Raises what the model raises on fakes in forward.
    """
    n, device = len(plan.units), torch.device(device)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    shadow = shadow_copy(model, fake, device)
    resident = {t.untyped_storage()._cdata for t in (*shadow.parameters(), *shadow.buffers())}
    shadow_of = {id(r): s for r, s in zip(model.modules(), shadow.modules())}
    c = _Counter(n, fresh_from)
    activation = [0] * (n + 1)
    saved: dict[int, torch.Tensor] = {}  # keeps the storages alive: ids stay unique

    recompute = frozenset(recompute)

    def window(index: int | None):
        def hook(_module, args, *_) -> None:  # returns None: the arguments and outputs stay
            if index is None:
                c.stack.pop()
            else:
                if index in recompute and not recompute.intersection(c.stack):
                    for t in pytree.tree_leaves(args):  # what the checkpoint keeps
                        if isinstance(t, torch.Tensor):
                            keep(t, index)
                c.stack.append(index)
            c.switch()

        return hook

    def keep(t: torch.Tensor, index: int) -> None:
        key = t.untyped_storage()._cdata
        if key not in resident and key not in saved:
            saved[key] = t
            activation[index] += t.untyped_storage().nbytes()

    handles = []
    for u in plan.units:
        mod = shadow_of[id(u.module)]
        handles.append(mod.register_forward_pre_hook(window(u.index)))
        handles.append(mod.register_forward_hook(window(None), always_call=True))

    def pack(t: torch.Tensor):
        if not recompute.intersection(c.stack):  # a recomputed unit keeps its input only
            keep(t, c.open_unit())
        return t

    def to_fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        return fake_like(x, fake, device).requires_grad_(x.requires_grad)

    args, kwargs = pytree.tree_map(to_fake, (tuple(example_args), example_kwargs or {}))
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
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

    units, updated = [], set()  # a tied parameter is fetched by each unit, updated by one
    for u in plan.units:
        trainable = [p for p in u.params if p.requires_grad and id(p) not in updated]
        updated.update(id(p) for p in trainable)
        units.append(
            UnitCost(
                u.index,
                u.display_name,
                numel=u.numel,
                trainable_numel=sum(p.numel() for p in trainable),
                weight_bytes=u.weight_bytes,
                trainable_bytes=sum(p.nbytes for p in trainable),
                pinned=u.pinned,
                trainable_tensors=len(trainable),
                tensors=len(u.params),
                **fields(u.index),
            )
        )
    batch = [(list(t.shape), str(t.dtype)) for t in leaves]
    return StepCosts(
        units, UnitCost(-1, OUTSIDE_NAME, **fields(n)), error is None, error, batch, c.kernels
    )

"""What one aten operator moves and how to run it again (Note [operator bytes],
Note [timed kernels], Note [fresh pages]).

Note [operator bytes]
---------------------
An operator moves ``inputs + outputs`` bytes (tensor arguments read, results
written; an expanded input counts its storage, not its broadcast size; an
in-place result counts as written). Views (``is_view``) and allocations move
nothing but still count as operators (each costs its dispatch). ``embedding``
reads the gathered rows, not the whole table: indices + 2 x output.

Note [timed kernels]
--------------------
A roofline prices a kernel at max(FLOPs / peak, bytes / bandwidth), and the
large kernels of a step are far from either: on a 2-core EPYC, bf16 attention
runs at 35 to 300 GFLOP/s by shape against a 930 GFLOP/s matmul peak, a bf16
GELU at a sixth of the memory bandwidth. So every operator with FLOPs, and every
other one moving at least ``KERNEL_BYTES``, is a *kernel*: its key names the
operator and its arguments (shapes, strides, dtypes, scalars), and the probe
runs it once per machine on tensors of that specification, cycling through
copies of its arguments larger together than the caches (in a step its operands
were written long before), and caches its seconds (``probe.time_kernels``). The
many small operators left are priced by their bytes and their count.

Note [fresh pages]
------------------
On the CPU glibc maps every allocation over its mmap threshold (32 MiB at most)
afresh, and the kernel faults its pages in and zeroes them, in the step, on the
threads that compute. In a GPT-2 small step (batch 8 x 1024) that was 9 s of
17 s in the kernel (73,000 faults, with huge pages; 14 s and 2.6 million faults
without), and a kernel timed in a small process sees little of it (a
vocabulary-wide log-softmax: 0.13 s timed, 1.8 s in the step). So each new
output tensor of at least ``FRESH_BYTES`` counts as fresh bytes, priced at the
probe's first-touch bandwidth of fresh 4 KiB pages (huge pages are not to be
counted on in a long run's fragmented memory). An accelerator's caching
allocator reuses its blocks: no fresh pages there.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

KERNEL_BYTES = 1 << 20  # Note [timed kernels]
COLD_BYTES, COLD_COPIES = 64 << 20, 16  # argument copies a timing cycles through
FRESH_BYTES = 32 << 20  # Note [fresh pages]

# FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel.
EXTRA_FLOP_FORMULAS: dict = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *a, out_shape=None, **kw: sdpa_backward_flop_count(g, q, k, v)
    ),
}

_aten = torch.ops.aten
# Queries of tensor metadata: not operators a real run dispatches as kernels.
QUERIES = {
    *(_aten.sym_size.default, _aten.sym_stride.default, _aten.sym_numel.default),
    *(_aten.sym_storage_offset.default, _aten.size.default, _aten.stride.default),
    *(_aten.numel.default, _aten.dim.default, _aten.is_contiguous.default),
    *(_aten.is_contiguous.memory_format, _aten.storage_offset.default),
    *(torch.ops.prim.device.default, torch.ops.prim.layout.default),
}
# Operators that allocate or alias without touching data.
NO_TRAFFIC = {
    *(_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default),
    *(_aten.new_empty.default, _aten.new_empty_strided.default, _aten._unsafe_view.default),
    _aten.lift_fresh.default,
}


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in ``tree`` (an expanded tensor: its storage)."""
    total = 0
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            total += min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    return total


def fresh_bytes(tree) -> int:
    """Bytes of the tensors in ``tree`` of at least ``FRESH_BYTES`` each (Note [fresh pages])."""
    sizes = [tensor_bytes(t) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return sum(n for n in sizes if n >= FRESH_BYTES)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def storage_numel(self) -> int:
        return (
            1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0
        )

    def make(self, device: torch.device) -> torch.Tensor:
        """Floats in [0.5, 1.5) (safe for log, sqrt, division), integers 0 (valid
        indices), booleans True."""
        base = torch.empty(self.storage_numel, dtype=self.dtype, device=device)
        base = (
            base.uniform_(0.5, 1.5)
            if self.dtype.is_floating_point
            else base.fill_(1 if self.dtype == torch.bool else 0)
        )
        return base.as_strided(self.shape, self.stride)


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
        specs = [
            t for t in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(t, TensorSpec)
        ]
        return sum(t.storage_numel * t.dtype.itemsize for t in specs)

    def runner(self, device: torch.device) -> Callable[[], object]:
        """Calls on tensors of ``device``, cycling through copies of the arguments."""

        def real(x):
            if isinstance(x, TensorSpec):
                return x.make(device)
            return device if isinstance(x, torch.device) else x

        copies = max(1, min(COLD_COPIES, COLD_BYTES // max(1, self.nbytes)))
        calls = []
        for _ in range(copies):
            args, kwargs = pytree.tree_map(real, (self.args, self.kwargs))
            calls.append(functools.partial(self.fn, *args, **kwargs))
        turn = itertools.cycle(calls)
        return lambda: next(turn)()

    @classmethod
    def of(cls, fn: Callable, args, kwargs, flops: int = 0) -> Kernel:
        """The kernel of a call seen under the cost counter (fake tensors -> specs)."""

        def spec(x):
            if isinstance(x, torch.Tensor):
                return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
            return x

        return cls(fn, *pytree.tree_map(spec, (tuple(args), dict(kwargs or {}))), flops)

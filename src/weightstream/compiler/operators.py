"""What one aten operator costs: its throughput class, the bytes it moves, the
effective size of a product or an attention, and the FLOP formulas
``FlopCounterMode`` lacks. Pure functions and tables used by the cost counter
(``cost.py``) and the operator curves of the machine profile (``hardware.py``).

Note [operator bytes]
---------------------
An operator that is not matmul-like moves ``inputs + outputs`` bytes (tensor
arguments read, results written; an expanded input counts its storage, not
its broadcast size; an in-place result counts as written). View operators
(``is_view``: transpose, view, split...) and allocations move nothing; they
still count as operators. ``embedding`` reads the gathered rows, not the whole
table: indices + 2 x output. Matmul-like operators move bytes too, but their
time is priced by FLOPs. Scaled dot-product attention runs as one fused kernel
on the CPU and on CUDA but as its math decomposition on meta: while it runs
(forward, and the backward nodes it created) the counter is suspended and the
call counts as one operator moving q, k, v and the output (forward), and as
one operator moving twice that (backward: reads q, k, v, out, grad out and
writes three gradients). Its FLOPs still come from the decomposition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count


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


_aten = torch.ops.aten
# Queries of tensor metadata: not operators a real run dispatches as kernels.
QUERIES = {
    _aten.sym_size.default,
    _aten.sym_stride.default,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
    _aten.size.default,
    _aten.stride.default,
    _aten.numel.default,
    _aten.dim.default,
    _aten.is_contiguous.default,
    _aten.is_contiguous.memory_format,
    _aten.storage_offset.default,
    torch.ops.prim.device.default,
    torch.ops.prim.layout.default,
}
# Operators that allocate or alias without touching data (Note [operator bytes]).
NO_TRAFFIC = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten._unsafe_view.default,
    _aten.lift_fresh.default,
}
# Matmul-like operators whose effective size has a formula: (position of A, of B).
_MATMUL_OPERANDS = {
    _aten.mm.default: (0, 1),
    _aten.addmm.default: (1, 2),
    _aten.bmm.default: (0, 1),
    _aten.baddbmm.default: (1, 2),
}
# Python functions that run as one fused kernel on a real device (Note [operator bytes]).
FUSED_ON_DEVICE = {F.scaled_dot_product_attention}

# Non-matmul operators whose time per byte is far from a copy's (transcendental
# functions, normalizations): each class has its own measured throughput
# (machine.py); every other operator is "simple" (elementwise arithmetic,
# copies, casts, reductions, gathers), priced by the measured throughput of a
# simple operator of its size. Names are aten overload packets.
OP_CLASSES: dict[str, frozenset[str]] = {
    "gelu": frozenset({"gelu", "gelu_backward"}),
    "silu": frozenset({"silu", "silu_backward"}),
    "layer_norm": frozenset({"native_layer_norm", "native_layer_norm_backward"}),
    "softmax": frozenset(
        {"_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data"}
    ),
    "transcendental": frozenset(
        {"tanh", "tanh_backward", "sigmoid", "sigmoid_backward", "exp", "log", "erf", "sin", "cos"}
    ),
}
SIMPLE = "simple"
_CLASS_OF = {name: cls for cls, names in OP_CLASSES.items() for name in names}


def op_class(func) -> str:
    """The throughput class of an aten operator (a key of OP_CLASSES, or "simple")."""
    return _CLASS_OF.get(func._overloadpacket.__name__, SIMPLE)


def tensor_bytes(tree) -> int:
    total = 0
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            n = t.numel() * t.element_size()
            try:
                n = min(n, t.untyped_storage().nbytes())  # an expanded tensor: its storage
            except (RuntimeError, NotImplementedError):
                pass
            total += n
    return total


def attention_size(args, kwargs) -> int:
    """The effective size n of one attention: round((T * S * head_dim) ** (1/3))."""
    q = args[0] if args else kwargs["query"]
    k = args[1] if len(args) > 1 else kwargs["key"]
    return max(1, round((q.shape[-2] * k.shape[-2] * q.shape[-1]) ** (1 / 3)))


def matmul_size(func, args) -> int:
    """The effective size n of one [M, K] x [K, N] product; 0 if unknown.

    The geometric mean of the two smallest of M, K and N: the square product
    that runs as efficiently. A thin dimension limits a product's efficiency
    whatever the others (measured on a CPU, 2048 x 128 x 64 runs like 90^3,
    not like its cube root 254^3); for a square product it is n itself.
    """
    pos = _MATMUL_OPERANDS.get(func)
    if pos is None:
        return 0
    a, b = args[pos[0]], args[pos[1]]
    small, mid, _ = sorted((a.shape[-2], a.shape[-1], b.shape[-1]))
    return max(1, round((small * mid) ** 0.5))

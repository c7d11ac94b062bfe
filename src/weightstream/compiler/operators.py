"""What one aten operator moves: the bytes of its tensors, the operators that move
nothing, and the FLOP formulas ``FlopCounterMode`` lacks. Pure functions and
tables used by the cost counter (``cost.py``).

Note [operator bytes]
---------------------
An operator moves ``inputs + outputs`` bytes (tensor arguments read, results
written; an expanded input counts its storage, not its broadcast size; an
in-place result counts as written). View operators (``is_view``: transpose,
view, split...) and allocations move nothing; they still count as operators
(each costs its dispatch). ``embedding`` reads the gathered rows, not the whole
table: indices + 2 x output. Matmul-like operators (those with a FLOP formula)
are kept one by one as (FLOPs, bytes), so that the roofline prices each at the
larger of its two times (estimate.py); every other operator has no FLOPs and is
priced by its bytes alone. Scaled dot-product attention runs as one fused
kernel on the CPU and on CUDA but as its math decomposition on meta: while it
runs (forward, and the backward nodes it created) the counter is suspended and
the call counts as one matmul-like operator with the decomposition's FLOPs,
moving q, k, v and the output (forward), or twice that (backward: reads q, k, v,
out, grad out and writes three gradients).
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
# Python functions that run as one fused kernel on a real device (Note [operator bytes]).
FUSED_ON_DEVICE = {F.scaled_dot_product_attention}


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in ``tree`` (an expanded tensor: its storage)."""
    total = 0
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            n = t.numel() * t.element_size()
            try:
                n = min(n, t.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):
                pass
            total += n
    return total

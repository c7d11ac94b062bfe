"""common.flat: flattening tensors into one buffer and views back, against torch's own."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from weightstream.common.flat import flatten, unflatten_views


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(5, generator=g).requires_grad_(),
        torch.randn(2, 3, 2, generator=g).transpose(0, 2),  # strided
        torch.tensor(7.0),  # 0-d
        torch.empty(0, 3),
    ]


def test_flatten_is_torchs_flatten_and_views_are_torchs_unflatten():
    ts = tensors()
    flat = flatten(ts)
    assert flat.dim() == 1 and flat.is_contiguous() and not flat.requires_grad
    assert torch.equal(flat, _flatten_dense_tensors([t.detach() for t in ts]))
    views = unflatten_views(flat, ts)
    for view, theirs, t in zip(views, _unflatten_dense_tensors(flat, ts), ts):
        assert view.shape == t.shape and torch.equal(view, theirs) and torch.equal(view, t)
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    views[0].fill_(1.0)  # views: writing one writes the buffer
    assert torch.equal(flat[:12], torch.ones(12))


def test_flatten_into_a_buffer_of_another_dtype_casts_as_copy_does():
    ts = [t.detach() for t in tensors()]
    out = torch.empty(sum(t.numel() for t in ts), dtype=torch.bfloat16)
    assert flatten(ts, out=out) is out
    for view, t in zip(unflatten_views(out, ts), ts):
        assert torch.equal(view, t.to(torch.bfloat16))

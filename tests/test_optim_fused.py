"""fused=True Adam/AdamW: torch's fused CPU kernel, bitwise equal to torch.optim's fused path."""

from __future__ import annotations

import pytest
import torch

import weightstream as cstorch


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize(
    "options",
    [{}, {"amsgrad": True}, {"maximize": True}, {"weight_decay": 0.1}],
    ids=["plain", "amsgrad", "maximize", "weight_decay"],
)
def test_fused_matches_torch_fused_bitwise(name, options):
    torch.manual_seed(0)
    shapes = [(17, 33), (2, 3, 40), (5,), ()]
    ours_p = [torch.randn(s, requires_grad=True) for s in shapes]
    ref_p = [p.detach().clone().requires_grad_() for p in ours_p]
    kw = {"lr": 1e-2, "weight_decay": 0.0, **options}
    ours = getattr(cstorch.optim, name)(ours_p, fused=True, **kw)
    ref = getattr(torch.optim, name)(ref_p, fused=True, eps=1e-6, **kw)
    for _ in range(30):
        for a, b in zip(ours_p, ref_p):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):
        assert torch.equal(a, b)
    for a, b in zip(ours_p, ref_p):
        assert torch.equal(ours.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"])


def test_fused_needs_bias_correction():
    with pytest.raises(ValueError, match="correct_bias"):
        cstorch.optim.AdamW([torch.zeros(2, requires_grad=True)], fused=True, correct_bias=False)

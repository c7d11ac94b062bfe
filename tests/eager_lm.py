"""The run command's language-model step in plain PyTorch, for tests that compare a run
with eager training on the same batches (transformers' own model, or peft's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def train_eagerly(model, params, loader, steps: int, lr: float, router: bool = False):
    """``steps`` steps of torch.optim.AdamW over ``params`` on ``loader``'s lm batches;
    returns the losses and the optimizer. ``router``: add the model's load-balancing
    loss, ``router_aux_loss_coef`` x its ``aux_loss``, as its forward does with labels."""
    # weightstream's AdamW defaults to eps=1e-6 (the reference API), torch's to 1e-8.
    opt = torch.optim.AdamW(params, lr=lr, eps=1e-6, weight_decay=0.0, foreach=False)
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        out = model(input_ids=batch["input_ids"])
        logits = out.logits
        # The run's LM loss: the mean of the per-token losses, as a weighted sum.
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none"
        )
        weights = torch.ones_like(per_token)
        loss = (per_token * weights).sum() / weights.sum().clamp_min(1.0)
        if router:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt

"""Losses of the tasks' batch formats (see models/registry.py), and the model call's inputs.

Note [packed batches]
~~~~~~~~~~~~~~~~~~~~~
An lm batch with ``position_ids`` [B, T] holds several documents per row
(``data/hf_dataset/rows.py``, Note [packing]): positions restart at 0 where a document starts.
Restarting the positions alone does not keep the documents apart: transformers 5 builds
its causal mask over the whole row (a training forward holds a cache object, which turns
its own packed-sequence detection off), so the second document attends to the first
(measured: its logits off by 0.5 on a small Llama). The model call therefore gets
``position_ids`` and a 4-D mask [B, 1, T, T] in which a token sees the earlier tokens of
its own document only. transformers passes a 4-D mask through to the attention unchanged,
so its format is the attention's: ``sdpa`` takes a boolean mask (True: attend), ``eager``
adds the mask to the scores, so it gets a float one (0 or the float32 minimum; a bool
there would add 1). Other implementations (flash, flex) take no such tensor and are
refused. The mask costs B * T * T bytes (four times that for eager), built per batch on
the batch's device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Note [router loss]
# ------------------
# A transformers mixture of experts whose config sets ``output_router_logits`` adds
# ``router_aux_loss_coef`` x its load-balancing loss (``aux_loss``, which keeps the
# router from sending every token to the same experts) to the loss its forward returns
# with labels. The run's lm loss is computed here, not by the model, so it adds the
# same term: with one micro-batch a step, the step's loss is transformers' (our token
# mean of the cross-entropy + coef x aux_loss); over several micro-batches (and ranks)
# each one's aux_loss counts by its share of the step's tokens, as its cross-entropy
# does. Evaluation reports the cross-entropy alone (its perplexity is the text's). The
# config's default, ``output_router_logits: false``, trains on the cross-entropy alone,
# as transformers does; the model section sets it (``output_router_logits: true``).

IGNORE_INDEX = -100  # labels not to learn (cross_entropy's default ignore_index)
# Attention implementations whose 4-D mask format is known (Note [packed batches]).
PACKED_ATTENTION = ("sdpa", "eager")


def model_inputs(task: str, batch: dict) -> tuple:
    """The model's positional inputs in a batch of ``task``'s format."""
    return (batch["input_ids"],) if task == "lm" else (batch["inputs"],)


def attention_of(model: object) -> str | None:
    """A transformers model's attention implementation (``config._attn_implementation``);
    None for other models."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def router_loss_coef(model: object) -> float:
    """The weight of a transformers mixture of experts' load-balancing loss in its training
    loss (``router_aux_loss_coef``) when its config asks for that loss
    (``output_router_logits``); 0.0 otherwise (Note [router loss])."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def model_kwargs(task: str, batch: dict, attention: str | None = None) -> dict:
    """The model's keyword inputs in a batch of ``task``'s format.

    Empty except for packed lm batches (with ``position_ids``): then ``position_ids`` and
    the 4-D mask that keeps the documents apart, in the format of ``attention``, the
    model's attention implementation (:func:`attention_of`; Note [packed batches]).
    """
    if task != "lm" or batch.get("position_ids") is None:
        return {}
    if attention not in PACKED_ATTENTION:
        what = "a model that is not a transformers model" if attention is None else attention
        raise ValueError(
            f"packed batches (packing: true) need a transformers model with attention "
            f"{' or '.join(PACKED_ATTENTION)}, which take the mask that keeps the documents "
            f"apart; this is {what}. Fix: set packing: false, or use model: {{name: hf}} "
            "(its attention sdpa or eager: the model section's attn_implementation)."
        )
    position_ids = batch["position_ids"]
    return {
        "position_ids": position_ids,
        "attention_mask": packed_attention_mask(position_ids, attention),
    }


def packed_attention_mask(position_ids: torch.Tensor, attention: str = "sdpa") -> torch.Tensor:
    """[B, 1, T, T] causal mask within documents, a document starting where a position is 0.

    ``attention`` "sdpa": bool, True where a query may attend to a key; "eager": float32,
    0 there and the float32 minimum elsewhere (Note [packed batches]).
    """
    document = (position_ids == 0).cumsum(-1)  # [B, T]: which document each token is in
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal  # [B, T, T]
    allowed = allowed[:, None]
    if attention == "eager":
        blocked = torch.finfo(torch.float32).min
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, blocked)
    return allowed


def lm_weights(batch: dict, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B*T] float32: 1 for a token the lm loss counts (label not -100, attention_mask 1
    where there is one), else 0."""
    labels = batch["labels"].to(device)
    weights = (labels.flatten() != IGNORE_INDEX).to(torch.float32)
    mask = batch.get("attention_mask")
    if mask is not None:
        weights = weights * mask.to(device, torch.float32).flatten()
    return weights


def task_loss(
    task: str,
    model: Callable,
    batch: dict,
    attention: str | None = None,
    denominator: torch.Tensor | None = None,
    router_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Forward one batch; returns (mean loss, logits, extra) for the task's batch format.

    lm: the mean of the per-token cross-entropy over the tokens whose ``attention_mask``
    is 1 (all without one) and whose label is not -100 (:func:`lm_weights`);
    ``denominator``, if given, divides the sum instead of this batch's count (the
    trainer's count over a whole step: Note [the step's token mean] in
    train/trainer.py). ``attention``: the model's attention implementation, for packed
    batches (:func:`model_kwargs`). ``router_coef``: the weight of a mixture of experts'
    load-balancing loss (:func:`router_loss_coef`, Note [router loss]).
    """
    if task == "lm":
        kwargs = model_kwargs(task, batch, attention)
        out = model(batch["input_ids"], **kwargs)
        logits = _logits(out)  # [B, T, V]
        labels = batch["labels"].to(logits.device)
        # cross_entropy gives 0 where the label is -100; the weights leave those tokens
        # out of the mean's denominator too.
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        )
        weights = lm_weights(batch, per_token.device)
        if denominator is None:
            denominator = weights.sum().clamp_min(1.0)
        loss = (per_token * weights).sum() / denominator.to(per_token.device)
        aux = getattr(out, "aux_loss", None) if router_coef else None
        if aux is not None:  # Note [router loss]: this batch's share of the step's tokens
            share = weights.sum() / denominator.to(weights.device)
            loss = loss + router_coef * aux.to(loss.device, torch.float32) * share
        return loss, logits, {"per_token": per_token, "weights": weights, "labels": labels}
    if task == "classification":
        logits = model(batch["inputs"])
        labels = batch["labels"].to(logits.device)
        return F.cross_entropy(logits.float(), labels), logits, {"labels": labels}
    raise ValueError(f"unknown task {task!r}; expected 'lm' or 'classification'.")


def _logits(out):
    """The logits of a model's output: a tensor, or a transformers output's ``logits``."""
    return out if isinstance(out, torch.Tensor) else out.logits

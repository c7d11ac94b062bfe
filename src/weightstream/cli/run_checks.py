"""What is wrong with a run's input, found before step 1: data the model cannot take
(its vocabulary, packing, its positions), and settings that change nothing.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import torch

from weightstream.cli.params import Params
from weightstream.models import hf
from weightstream.models.tasks import attention_of, model_kwargs
from weightstream.runtime.config import StreamingConfig

log = logging.getLogger("weightstream")


def check_model_takes_input(params: Params, model) -> None:
    """The model built, before step 1: packed input needs a model that takes its mask,
    and no sequence may run past a position table."""
    _check_packing(params, model)
    _check_positions(params, model)


def _input_sections(params: Params) -> Iterator[tuple[str, dict]]:
    """(name, values) of the params file's input sections, train_input first."""
    for name in ("train_input", "eval_input"):
        section = getattr(params, name)
        if section is not None:
            yield name, section.to_dict()


def check_vocabulary(params: Params) -> None:
    """Data whose token ids the model has no embedding for fails here, before step 1."""
    from weightstream.data.processors import data_vocab_size

    model_vocab = getattr(params.model.config, "vocab_size", None)
    if params.model.spec.task != "lm" or not isinstance(model_vocab, int):
        return
    for name, values in _input_sections(params):
        data_vocab = data_vocab_size(values)
        if data_vocab is not None and data_vocab > model_vocab:
            tokenizer = values.get("tokenizer")
            ids = (
                f"the tokenizer {tokenizer!r} gives token ids up to {data_vocab - 1}"
                if tokenizer
                else f"the data's token ids go up to {data_vocab - 1}"
            )
            raise ValueError(
                f"{name}: {ids} (a vocabulary of {data_vocab}), but the model's vocab_size "
                f"is {model_vocab}. Fix: set the model's vocab_size to at least "
                f"{data_vocab}, or use the tokenizer the model was made for."
            )


def _check_packing(params: Params, model) -> None:
    """Packed input needs a model that takes its mask (Note [packed batches] in
    models/tasks.py): refused here, before step 1."""
    for name, values in _input_sections(params):
        if not values.get("packing"):
            continue
        # The error of a model that takes no such mask, raised on a one-token batch.
        probe = {"input_ids": None, "position_ids": torch.zeros(1, 1, dtype=torch.long)}
        try:
            model_kwargs(params.model.spec.task, probe, attention_of(model))
        except ValueError as e:
            raise ValueError(f"{name}.packing: {e}") from e
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            # transformers' load-balancing loss reads the attention mask as [B, T] of
            # padding; a packed batch's is [B, 1, T, T] (Note [router loss]).
            raise ValueError(
                f"{name}.packing: the model's output_router_logits makes transformers "
                "compute its load-balancing loss with the attention mask read as [batch, "
                "tokens] of padding, and packed batches pass the [batch, 1, tokens, tokens] "
                "mask that keeps their documents apart: its forward would fail. Fix: set "
                "packing: false, or output_router_logits: false in the model section."
            )


def _check_positions(params: Params, model) -> None:
    """A sequence longer than a transformers model's table of absolute positions
    (GPT-2's ``n_positions``) stops its first step with an index error, and a
    trace on the meta device never reads the table: refused here, before step 1.
    Rotary and relative positions have no table to run past."""
    if not hf.is_hf_model(model):
        return
    config = model.config
    limits = [getattr(config, k, None) for k in ("n_positions", "max_position_embeddings")]
    limit = next((v for v in limits if isinstance(v, int) and not isinstance(v, bool)), None)
    vocab = getattr(config, "vocab_size", None)
    tables = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.num_embeddings == limit != vocab
    ]
    if limit is None or not tables:
        return
    for section_name, values in _input_sections(params):
        seq = next((values[k] for k in ("seq_len", "max_sequence_length") if values.get(k)), None)
        if isinstance(seq, int) and seq > limit:
            raise ValueError(
                f"{section_name}.seq_len {seq} is longer than the model's {limit} "
                f"positions (its position table {tables[0]}: n_positions or "
                "max_position_embeddings in its config). Fix: "
                f"{section_name}.seq_len at most {limit}, or a model with more positions."
            )


# Streaming settings layer pipelined mode has no use for (it keeps every weight on the
# device, and activation_checkpointing, compute_dtype and the unit choice are its own).
_STREAMING_ONLY = (
    "prefetch_depth",
    "device_memory_budget",
    "device_tier_budget",
    "overlap_updates",
    "update_in_backward",
    "activation_offload",
    "host_mirror",
    "store",
    "store_dir",
    "host_memory_budget",
    "store_sharding",
    "num_wgt_servers",
    "reduce_bucket_bytes",
)


def warn_streaming_settings_unused(streaming: StreamingConfig) -> None:
    """Layer pipelined: name the weight streaming settings the file sets, which change
    nothing here (the Python API refuses them for backend 'wse_lp')."""
    default = StreamingConfig()
    unused = [n for n in _STREAMING_ONLY if getattr(streaming, n) != getattr(default, n)]
    if unused:
        log.warning(
            "runconfig: %s apply only to weight streaming and are ignored in layer pipelined "
            "mode (execution_mode: layer_pipelined keeps every weight on the device). Fix: "
            "drop them, or set execution_mode: weight_streaming.",
            ", ".join(f"{n}: {getattr(streaming, n)!r}" for n in unused),
        )


def warn_wrapping_eval(steps: int, loader) -> None:
    """eval_steps past the eval input's batches read some twice (the DataLoader starts
    the input again, as the reference's does), which weighs them twice in the metrics."""
    try:
        batches = len(loader)
    except TypeError:  # an iterable of unknown length
        return
    if steps > batches:
        warnings.warn(
            f"weightstream: eval_steps = {steps}, but the eval input has {batches} batches, "
            "so the evaluation reads some of them again and counts them twice. Fix: "
            f"eval_steps <= {batches}, or leave it unset for the whole eval input.",
            stacklevel=2,
        )

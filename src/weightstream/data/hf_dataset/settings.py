"""The processor's own keys (``HFDataSettings``), read from a section and checked, and
the check of ``train_input`` and ``eval_input`` over the same data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightstream.data.section import SEQ_KEYS, Section

log = logging.getLogger("weightstream")


# The processor's own keys: (default, what it does), for docs/params.md
# (``weightstream.data.processors.processor_key_docs``); the package's docstring says more.
HF_DATASET_KEY_DOCS: dict[str, tuple[Any, str]] = {
    "tokenizer": (
        "required",
        "The Hugging Face tokenizer folder (as save_pretrained writes it; the model folder "
        "usually holds it), with an eos token and, for conversations, a chat template.",
    ),
    "format": (
        "auto",
        "The data's format: auto (from the columns: messages, then prompt and completion, "
        "then text), text, prompt_completion or messages.",
    ),
    "seq_len": (1024, "Tokens per row."),
    "max_sequence_length": (None, "Another name of seq_len (give one of them)."),
    "completion_only_loss": (
        True,
        "Only the completion's tokens (prompt_completion) or the assistant's (messages) are "
        "targets; false: every token is.",
    ),
    "packing": (
        False,
        "Several documents per row, each attending to itself only (needs a transformers "
        "model); false: one document (or piece) per row, padded.",
    ),
    "overflow": (
        "split",
        "A document longer than seq_len: split into pieces of seq_len tokens, or truncate "
        "(its tail is dropped).",
    ),
    "eval_fraction": (
        None,
        "train_input takes the documents' head and eval_input the tail of this fraction; "
        "give the same value and data_dir in both sections. null: the section reads all of "
        "its data_dir.",
    ),
    "cache_dir": (
        None,
        "Where the tokenized documents and rows are cached (in its weightstream/ folder); "
        "null: datasets' cache (HF_DATASETS_CACHE).",
    ),
}


HF_DATASET_KEYS = frozenset(HF_DATASET_KEY_DOCS)
assert SEQ_KEYS <= HF_DATASET_KEYS


FORMATS = ("auto", "text", "prompt_completion", "messages")


IGNORE_INDEX = -100


# Suffix -> the ``datasets`` builder that reads it.
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


PACK_BATCH = 1000  # documents per packing batch (Note [packing])


TOKENIZE_BATCH = 1000  # documents per tokenizer batch (Note [hf dataset cache])


# Part of every cache file's fingerprint: change it when the rows this module makes from
# the same data and settings change, or their files' layout (Note [hf dataset cache]).
ROWS_VERSION = "4"


# The roles chat templates know (OpenAI's, Llama 3's ipython). A template renders any
# role as it renders these (a header of its name), so a misspelled "asistant" gives no
# error anywhere: its turn is simply not trained. Such documents are counted and warned of.
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")


# A document's issues, bits of the docs file's ``issues`` column (Note [documents without
# targets]): a role not in KNOWN_ROLES, a conversation without an assistant turn, a
# message whose content is null (and that has no tool_calls, which make null legitimate).
ISSUE_ROLE, ISSUE_NO_ASSISTANT, ISSUE_NULL_CONTENT = 1, 2, 4


@dataclass(frozen=True)
class HFDataSettings:
    """The processor's own keys, checked."""

    tokenizer: str
    format: str
    seq_len: int
    completion_only_loss: bool
    packing: bool
    overflow: str
    eval_fraction: float | None
    cache_dir: str | None


def read_settings(s: Section) -> HFDataSettings:
    """The processor's keys of section ``s``, with errors naming the key and the fix."""
    if not s.has("tokenizer"):
        raise ValueError(
            f"{s.where('tokenizer')} is required by HFDatasetProcessor: the Hugging Face folder "
            "of the model's tokenizer (as save_pretrained writes it; the model folder usually "
            "holds it)."
        )
    cache_dir = s.path_("cache_dir") if s.has("cache_dir") else None
    return HFDataSettings(
        tokenizer=s.path_("tokenizer"),
        format=s.choice("format", "auto", FORMATS),
        seq_len=s.seq_len(1024),
        completion_only_loss=s.bool_("completion_only_loss", True),
        packing=s.bool_("packing", False),
        overflow=s.choice("overflow", "split", ("split", "truncate")),
        eval_fraction=s.float_("eval_fraction", 0.0, 0.0, 1.0) if s.has("eval_fraction") else None,
        cache_dir=cache_dir,
    )


def _data_key(params: Mapping[str, Any]) -> tuple[str, ...] | None:
    data_dir = params.get("data_dir")
    entries = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else data_dir
    if not isinstance(entries, (list, tuple)) or not entries:
        return None
    return tuple(os.path.abspath(os.path.expanduser(os.fspath(e))) for e in entries)


def _split_problem(fraction: dict[str, float | None], data: str) -> str | None:
    """What is wrong with train_input's and eval_input's ``eval_fraction`` (``fraction``,
    None where unset) over the same data, or None where they agree."""
    train, evals = fraction["train_input"], fraction["eval_input"]
    if train == evals:
        return None
    if evals is None:
        overlap = f"eval_input reads all of it, the head ({1 - train:g}) train_input trains on too"
    elif train is None:
        overlap = f"train_input trains on all of it, eval_input's tail of {evals:g} included"
    else:
        overlap = (
            f"train_input takes the head of {1 - train:g} and eval_input the tail of "
            f"{evals:g}, so {'they overlap' if train > evals else 'some is in neither'}"
        )
    value = train if train is not None else evals
    return (
        f"train_input.eval_fraction = {train} and eval_input.eval_fraction = {evals} over "
        f"the same data_dir ({data}): {overlap}. Fix: set eval_fraction: {value} in both "
        "sections (or give eval_input a data_dir of its own, without eval_fraction)."
    )


def check_eval_split(train: Mapping[str, Any] | None, evals: Mapping[str, Any] | None) -> None:
    """Refuse train_input and eval_input of HFDatasetProcessor over the same ``data_dir``
    with different ``eval_fraction`` (set in one only, or two values): eval would measure
    documents that trained. For the params parser, which sees both sections; the same
    data read whole by both is a warning (evaluating on the training data may be meant).
    """
    if not train or not evals:
        return
    if {train.get("data_processor"), evals.get("data_processor")} != {"HFDatasetProcessor"}:
        return
    data = _data_key(train)
    if data is None or data != _data_key(evals):
        return
    fraction = {"train_input": train.get("eval_fraction"), "eval_input": evals.get("eval_fraction")}
    if not all(f is None or type(f) in (int, float) for f in fraction.values()):
        return  # the processor's own check names a value that is no number
    problem = _split_problem(fraction, ", ".join(data))
    if problem is not None:
        raise ValueError(problem)
    if fraction["train_input"] is None:
        log.warning(
            "train_input and eval_input read the same data_dir (%s), all of it: eval measures "
            "the documents that trained. Fix, if not meant: set eval_fraction (e.g. 0.1) in "
            "both sections.",
            ", ".join(data),
        )

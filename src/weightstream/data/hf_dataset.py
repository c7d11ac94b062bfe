"""Fine-tuning data in TRL's three formats, read and tokenized with Hugging Face ``datasets``.

The bulk of ``data_processor: HFDatasetProcessor`` (registered in ``processors.py``).
Its keys, besides the common ones:

- ``data_dir`` (required): a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file, a glob
  of them (``data/*.jsonl``), a list of files or globs (one kind), or a folder written by
  ``Dataset.save_to_disk``;
- ``tokenizer`` (required): a Hugging Face tokenizer folder (as ``save_pretrained`` writes
  it), loaded with ``AutoTokenizer.from_pretrained`` from local files only;
- ``format``: ``auto`` (default), ``text``, ``prompt_completion`` or ``messages``. ``auto``
  decides from the columns as TRL does: a ``messages`` column is a conversation,
  ``prompt`` and ``completion`` a prompt-completion pair, ``text`` plain text (in that order
  where several fit);
- ``seq_len`` / ``max_sequence_length`` (default 1024): tokens per row;
- ``completion_only_loss`` (default true): only the completion's tokens (prompt-completion)
  or the assistant's (conversations) are targets; the others' labels are -100;
- ``packing`` (default false): several documents per row (Note [packing]);
- ``overflow``: what happens to a document longer than ``seq_len``: ``split`` (default) into
  pieces of ``seq_len`` tokens, each its own row or packed document (its last token, the
  eos, which has no target, left out where it would be a piece by itself), or ``truncate``
  (its tail is dropped). Either way the counts are logged;
- ``eval_fraction``: if given, the training section takes the documents' head and
  ``eval_input`` the tail of this fraction (give the same data and value in both); without
  it a section reads all of its ``data_dir`` (a separate eval set). The same ``data_dir``
  with the fraction in one section only, or two values, would evaluate on trained
  documents: :func:`check_eval_split`, which the params parser runs, refuses it;
- ``cache_dir``: where the tokenized documents and the rows go, as Arrow files under
  ``<cache_dir>/weightstream/`` (default: ``datasets``' cache, ``HF_DATASETS_CACHE``,
  ``~/.cache/huggingface/datasets``). The data itself is read where it is, not copied.

What a document is, by format (its tokens are what the tokenizer itself gives):

- ``text``: ``tokenizer(text)["input_ids"]``, every token a target;
- ``prompt_completion`` with strings: ``tokenizer(prompt)["input_ids"]`` followed by
  ``tokenizer(completion, add_special_tokens=False)["input_ids"]``: the two are tokenized
  apart and concatenated (TRL tokenizes them apart too, to find the boundary), so the
  boundary is exact and no token straddles it; the completion's tokens are the targets;
- ``prompt_completion`` with conversations (lists of messages): the chat template of
  ``prompt + completion``, the targets what follows the template of the prompt with the
  generation prompt (``add_generation_prompt=True``); that must be a prefix, or an error
  says so;
- ``messages``: ``apply_chat_template(messages)``, the targets the assistant's tokens
  (Note [assistant tokens]).

Every document ends with the tokenizer's eos token: appended where its tokens do not end
with it already (a target when the token before it is one: it teaches where the answer
stops). Labels are shifted as every lm batch's (``labels[t]`` is the target of position
``t``: the next token, or -100 where that token is not a target; the last position of a
document has none).

Rows are tokenized once and cached on disk (Note [hf dataset cache]); sample ``i`` is a
function of the data and the settings alone, so any rank, worker or resumed run reads the
same sample ``i``. Without packing a row shorter than ``seq_len`` is padded on the right
(the tokenizer's pad token, else eos; labels -100, ``attention_mask`` 0).

Note [assistant tokens]
~~~~~~~~~~~~~~~~~~~~~~~
Which tokens of a conversation are the assistant's? A chat template that wraps the
assistant's turns in ``{% generation %}`` ... ``{% endgeneration %}`` says so itself:
``apply_chat_template(..., return_assistant_tokens_mask=True)`` returns the mask, and it is
used. Most templates have no such markers. For them, the conversation is rendered again
on growing prefixes: for assistant message ``k``, the tokens of the template of messages
``[:k]`` with the generation prompt (``add_generation_prompt=True``: the assistant's
header) and of messages ``[:k+1]`` must both be prefixes of the whole conversation's
tokens; the tokens between the two are the assistant's. Limits: (1) a template that
renders an earlier message differently once more follow (Qwen3 drops earlier turns'
reasoning; some add a date or a closing line only at the end) or whose tokens merge
across a message boundary breaks the prefix property: that is an error naming the
message, with the fix (add generation markers to the template, or
``completion_only_loss: false``); (2) what the template writes after the assistant's text
up to the next message (its end-of-turn token, a newline) counts as the assistant's,
which is what it must learn to stop; (3) a template without a generation prompt counts
the assistant's header as the assistant's. Rendering prefixes costs one template call per
assistant turn, once, when the data is tokenized.

Note [fast batches]
~~~~~~~~~~~~~~~~~~~
Plain strings (``text``, string prompts and completions) are tokenized a batch at a time,
and the tokenizer's Rust backend, where it has one, is called directly with
``encode_batch_fast``: the same ids as ``tokenizer(texts)``, without the character
offsets that transformers asks for and drops (about a third of the time of a pass). That
holds for a backend without truncation or padding set and a tokenizer that adds nothing
in Python, so it is checked: the first batch of a pass is tokenized both ways, and the
fast call is used only if every id agrees (else ``tokenizer(texts)`` throughout).

Note [packing]
~~~~~~~~~~~~~~
With ``packing: true`` documents are placed in rows of ``seq_len`` tokens in their order,
next fit: a document goes in the current row if it fits, else it starts a new row (the
rest of the old one is padding: one padded document). A document longer than ``seq_len`` is
first cut by ``overflow`` (pieces of ``seq_len``, each packed as its own document; or its
head). Packing works on batches of :data:`PACK_BATCH` documents (memory bounded by one
batch, whatever the data's size); a batch's last row is not filled from the next batch.
Packed rows carry ``position_ids`` that restart at 0 at each document (padding counts as
one more); the model call gets them and a 4-D attention mask
that lets a token see only earlier tokens of its own document
(``weightstream.models.tasks.model_kwargs``), so each document's logits are those of the
document alone. That needs a transformers model (the zoo's models take no mask).

Note [documents without targets]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A document can end up with no target token (labels -100 everywhere): a conversation
without an assistant turn, or whose assistant's role is misspelled (the template renders
``asistant`` like any role, and only ``assistant`` turns are targets), or, with
``overflow: truncate``, a prompt at least ``seq_len`` tokens long (the completion is the
dropped tail). Such a document costs a row and trains nothing, and data where *no*
document keeps a target trains at loss 0 (eval: nan metrics) without any other sign. So
the docs file keeps, per document, the position of its first target (``first_target``, -1
for none) and what looked wrong when it was tokenized (``issues``, bits ``ISSUE_*``);
every build counts them from these two small columns (no token is read): data without a
single target is an error before step 1, naming the cause and the fix; some documents
without one are a warning, with where the first few are (file and line), and a count in
the summary line. A row without the format's column (``{"msgs": ...}`` in messages data)
is an error naming its file and line.

Note [hf dataset cache]
~~~~~~~~~~~~~~~~~~~~~~~
Data are tokenized once into two Arrow stream files under ``<cache_dir>/weightstream/``:
``docs-*`` (every document of the data: ``input_ids``, ``labels``, ``length``,
``first_target`` and ``issues`` (Note [documents without targets])) and
``rows-*`` (a section's rows, cut or packed). Training reads the rows file memory-mapped
(:class:`HFRows`), and the run command, which builds a section's loader more than once
(the compile phase's first batch, then training), tokenizes once.

The pass that makes them holds memory bounded by a batch, whatever the data's size,
page cache of mapped files included (a mapped page counts in RSS once touched; Note
[arrow file pages] in ``arrow_files.py``). The data are read a chunk at a time
(``load_dataset(..., streaming=True)``: datasets' own json, parquet and csv readers, no
Arrow copy of the data; a save_to_disk folder's files memory-mapped, their pages given
back batch by batch), tokenized :data:`TOKENIZE_BATCH` documents at a time (plain strings
in one tokenizer call) and appended to the docs file; the rows are made from the docs
file, memory-mapped, :data:`PACK_BATCH` documents at a time, their pages given back as
each batch is done. Both files are written a batch at a time, synced every few tens of
MB with their pages dropped from the page cache, under a temporary name renamed into
place when complete. One process builds a file at a time (a lock file beside it): the
other ranks of a run, or another run on the same data, wait for it and then read it.

Their names are fingerprints of what they depend on: the data's (the files' paths, sizes
and modification times, as datasets fingerprints local files; a save_to_disk folder's own
fingerprint), the tokenizer's files, the settings as given (``format`` as given: the
detected format, a function of the data and the key, is kept in the docs file's schema
metadata) and :data:`ROWS_VERSION`; a change of any gives new files. A build that finds
both files reads nothing of the data. The rows file is what ``datasets`` writes
too (``Dataset.from_file`` reads it). Beside each file is the digest of its bytes
(``.blake2b``): a resume compares the rows' digest with the one its checkpoint recorded,
so data edited in place are noticed and a touched file is not.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import gzip
import hashlib
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from weightstream.context import current_run
from weightstream.data.arrow_files import ArrowStreamWriter, MappedFile, content_digest
from weightstream.data.section import SEQ_KEYS, Section

log = logging.getLogger("weightstream")

__all__ = [
    "FORMATS",
    "HF_DATASET_KEYS",
    "HF_DATASET_KEY_DOCS",
    "IGNORE_INDEX",
    "DocumentEncoder",
    "HFDataSettings",
    "HFRows",
    "build_rows",
    "check_eval_split",
    "conversation_issues",
    "first_targets",
    "make_rows",
    "detect_format",
    "hf_tokenizer_vocab_size",
    "load_hf_tokenizer",
]

# The processor's own keys: (default, what it does), for docs/params.md
# (``weightstream.data.processors.processor_key_docs``); the module docstring says more.
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
# Files of a model folder that do not define its tokenizer (weights): not hashed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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


# -- the tokenizer -----------------------------------------------------------------------


def load_hf_tokenizer(path: str, where: str = "tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(path)`` from local files; ``where`` names the key."""
    folder = Path(path)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise ValueError(
            f"{where}: {path!r} {what}. Fix: give the folder of a Hugging Face tokenizer, "
            "as save_pretrained writes it (tokenizer.json, tokenizer_config.json)."
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            "HFDatasetProcessor needs transformers and datasets: pip install 'weightstream[hf]'"
        ) from e
    try:
        return AutoTokenizer.from_pretrained(os.fspath(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"{where}: cannot load a tokenizer from {path!r} ({type(e).__name__}: {e}). Fix: "
            "give a folder written by a tokenizer's save_pretrained."
        ) from e


def hf_tokenizer_vocab_size(path: str) -> int:
    """The token ids the tokenizer at ``path`` can produce (added tokens included)."""
    return len(load_hf_tokenizer(path))


def _tokenizer_digest(path: str) -> str:
    """A digest of the files that define the tokenizer (not the model's weights beside it)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.startswith("."):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _chat_template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    return template or ""


def _render(tokenizer, messages: list, add_generation_prompt: bool = False) -> list[int]:
    """The chat template's token ids of ``messages``."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"])


# -- documents --------------------------------------------------------------------------


def detect_format(columns: Sequence[str], wanted: str, where: str) -> str:
    """The format of data with ``columns`` (``wanted``: the ``format`` key's value)."""
    need = {"messages": ("messages",), "prompt_completion": ("prompt", "completion")}
    need["text"] = ("text",)
    fits = [f for f in ("messages", "prompt_completion", "text") if set(need[f]) <= set(columns)]
    if wanted == "auto":
        if fits:
            return fits[0]
        raise ValueError(
            f"{where}: the data's columns ({', '.join(columns) or 'none'}) fit none of the "
            "formats: a 'messages' column (conversations), 'prompt' and 'completion' columns, "
            "or a 'text' column. Fix: rename the columns, or name the format with the format "
            "key after renaming."
        )
    if wanted not in fits:
        raise ValueError(
            f"{where}: format {wanted!r} needs the column(s) {', '.join(need[wanted])}, but "
            f"the data has {', '.join(columns) or 'none'}. Fix: set format: auto, or rename "
            "the columns."
        )
    return wanted


def assistant_mask_by_prefixes(tokenizer, messages: list, full: list[int]) -> list[int]:
    """1 on the assistant's tokens of ``full`` (the template's tokens of ``messages``),
    found by rendering growing prefixes (Note [assistant tokens])."""
    mask = [0] * len(full)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:
            before = _render(tokenizer, messages[:k], add_generation_prompt=True)
        except Exception:  # a template may refuse an empty conversation (reads messages[0])
            if k:
                raise
            before = []
        after = _render(tokenizer, messages[: k + 1])
        if not (
            len(before) <= len(after) <= len(full)
            and full[: len(after)] == after
            and after[: len(before)] == before
        ):
            raise ValueError(
                f"completion_only_loss: the chat template does not render this conversation "
                f"as growing prefixes at message {k} (role assistant), so its tokens cannot "
                "be told apart without generation markers (Note [assistant tokens] in "
                "weightstream/data/hf_dataset.py). Fix: wrap the assistant's turns of the "
                "template in {% generation %} ... {% endgeneration %}, or set "
                "completion_only_loss: false."
            )
        mask[len(before) : len(after)] = [1] * (len(after) - len(before))
    return mask


class DocumentEncoder:
    """Token ids and pre-shifted labels of a batch of examples, as flat arrays.

    Holds the tokenizer and the settings only (picklable, for worker processes).
    """

    def __init__(self, tokenizer, fmt: str, completion_only_loss: bool) -> None:
        self.tokenizer = tokenizer
        self.format = fmt
        self.completion_only_loss = completion_only_loss
        self.eos_id = tokenizer.eos_token_id
        self.markers = bool(_GENERATION_TAG.search(_chat_template(tokenizer)))
        # add_special_tokens -> the backend's encode_batch_fast where it was found to give
        # the tokenizer's own ids, or None (Note [fast batches]).
        self._fast: dict[bool, Any] = {}

    def __call__(self, batch: dict[str, list]) -> DocBatch:
        """The documents of ``batch`` (columns of equal length), eos-terminated."""
        pre = self._batch_tokens(batch)
        if pre is not None:
            return _finish(*pre, self.eos_id)
        n = len(next(iter(batch.values())))
        ids, trained = [], []
        for i in range(n):
            one, mask = self.encode({k: v[i] for k, v in batch.items()})
            ids.append(one)
            trained.append(mask)
        flat_ids, lengths = _flatten(ids, np.int32)
        flat_trained, _ = _flatten(trained, np.uint8)
        return _finish(flat_ids, flat_trained, lengths, self.eos_id)

    def _batch_tokens(self, batch: dict[str, list]) -> tuple[np.ndarray, ...] | None:
        """(ids, trained, lengths) of plain strings, tokenized a batch at a time (on the
        tokenizer's threads, Note [fast batches]; the tokens are those of one call per
        string), not yet eos-terminated; None for conversations (one template call per
        document)."""
        if self.format == "text":
            ids, lengths = _flatten(self.token_ids(batch["text"]), np.int32)
            return ids, np.ones(len(ids), np.uint8), lengths
        if self.format != "prompt_completion" or any(isinstance(p, list) for p in batch["prompt"]):
            return None
        heads = self.token_ids(batch["prompt"])
        completions = self.token_ids(batch["completion"], add_special_tokens=False)
        # Each document is its prompt's tokens, then its completion's: interleaved.
        ids, parts = _flatten([x for pair in zip(heads, completions) for x in pair], np.int32)
        kind = np.tile(np.array([0, 1], np.uint8), len(heads))  # 1: completion
        trained = np.repeat(kind if self.completion_only_loss else np.ones_like(kind), parts)
        return ids, trained, parts.reshape(-1, 2).sum(axis=1)

    def token_ids(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``tokenizer(texts, add_special_tokens=...)["input_ids"]``, by the fastest call
        found to give them (Note [fast batches])."""
        tok = self.tokenizer
        if add_special_tokens not in self._fast:  # the first batch decides
            ids = tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
            backend = getattr(tok, "backend_tokenizer", None)
            fast = getattr(backend, "encode_batch_fast", None)
            if fast is not None and backend.truncation is None and backend.padding is None:
                same = [e.ids for e in fast(texts, add_special_tokens=add_special_tokens)] == ids
                fast = fast if same else None
            self._fast[add_special_tokens] = fast
            return ids
        fast = self._fast[add_special_tokens]
        if fast is None:
            return tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return [e.ids for e in fast(texts, add_special_tokens=add_special_tokens)]

    def encode(self, example: dict) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token is a target) of one document, eos-terminated."""
        tok = self.tokenizer
        if self.format == "text":
            ids = list(tok(example["text"])["input_ids"])
            trained = [1] * len(ids)
        elif self.format == "prompt_completion":
            prompt, completion = example["prompt"], example["completion"]
            if isinstance(prompt, list):  # conversational: through the chat template
                head = _render(tok, prompt, add_generation_prompt=True)
                ids = _render(tok, list(prompt) + list(completion))
                if ids[: len(head)] != head:
                    raise ValueError(
                        "prompt_completion: the chat template's tokens of prompt + completion "
                        "do not start with those of the prompt (with the generation prompt), "
                        "so the completion cannot be found. Fix: set completion_only_loss: "
                        "false, or give the data as messages."
                    )
            else:
                head = list(tok(prompt)["input_ids"])
                ids = head + list(tok(completion, add_special_tokens=False)["input_ids"])
            trained = [0] * len(head) + [1] * (len(ids) - len(head))
        else:
            messages = list(example["messages"])
            if self.markers and self.completion_only_loss:
                out = tok.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
                ids, trained = list(out["input_ids"]), list(out["assistant_masks"])
            else:
                ids = _render(tok, messages)
                trained = (
                    assistant_mask_by_prefixes(tok, messages, ids)
                    if self.completion_only_loss
                    else [1] * len(ids)
                )
        if not self.completion_only_loss:
            trained = [1] * len(ids)
        if not ids or ids[-1] != self.eos_id:
            ids.append(self.eos_id)
            trained.append(trained[-1] if trained else 1)
        return ids, trained


@dataclass(frozen=True)
class DocBatch:
    """Documents as flat arrays: ``ids`` and ``labels`` int32 [sum(lengths)], the
    documents one after another; ``lengths`` int64 [documents]."""

    ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray


def _flatten(lists: Sequence[Sequence[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the lists concatenated, their lengths int64), without a Python loop per item."""
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype, count=int(lengths.sum()))
    return flat, lengths


def _finish(ids: np.ndarray, trained: np.ndarray, lengths: np.ndarray, eos: int) -> DocBatch:
    """Documents eos-terminated (appended where their tokens do not end with it, a target
    when the token before it is one, or when alone) and their shifted labels:
    ``labels[t] = ids[t + 1]`` where that token is a target, else -100; a document's
    last is -100."""
    ends = np.cumsum(lengths)
    nonempty = lengths > 0
    last_id = np.full(len(lengths), -1, np.int64)
    last_id[nonempty] = ids[ends[nonempty] - 1]
    need = last_id != eos  # an empty document needs one too
    if need.any():
        last_trained = np.ones(len(lengths), np.uint8)
        last_trained[nonempty] = trained[ends[nonempty] - 1]
        ids = np.insert(ids, ends[need], eos)  # equal indices insert in order
        trained = np.insert(trained, ends[need], last_trained[need])
        lengths = lengths + need
        ends = np.cumsum(lengths)
    labels = np.full(len(ids), IGNORE_INDEX, np.int32)
    labels[:-1] = np.where(trained[1:] != 0, ids[1:], IGNORE_INDEX)
    labels[ends - 1] = IGNORE_INDEX
    return DocBatch(ids.astype(np.int32, copy=False), labels, lengths)


# -- rows ------------------------------------------------------------------------------


def make_rows(docs: DocBatch, seq_len: int, packing: bool, overflow: str) -> dict[str, Any]:
    """Documents into rows of at most ``seq_len`` tokens: one piece a row, or packed
    (Note [packing]). Returns flat ``input_ids``, ``labels`` (and ``position_ids`` when
    packing) int32 [tokens], and per row ``length`` and ``targets`` int64 [rows]."""
    lengths = docs.lengths
    assert (lengths > 0).all(), "every document holds at least its eos token"
    # Pieces: a document longer than seq_len is cut by overflow (split or truncate).
    if overflow == "truncate":
        n_pieces = np.ones(len(lengths), np.int64)
    else:
        # A document's last token (its eos) has no target: split leaves it out where it
        # would be a piece by itself (a row that trains nothing).
        n_pieces = np.maximum(1, -(-(lengths - 1) // seq_len))
    doc = np.repeat(np.arange(len(lengths)), n_pieces)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    piece_start = (np.cumsum(lengths) - lengths)[doc] + k * seq_len
    piece_len = np.minimum(seq_len, lengths[doc] - k * seq_len)
    # Rows of pieces, in order: each its own, or next fit (a loop per piece, not token).
    if packing:
        row_of = np.empty(len(piece_len), np.int64)
        row, fill = -1, seq_len + 1
        for i, n in enumerate(piece_len.tolist()):
            if fill + n > seq_len:
                row, fill = row + 1, 0
            row_of[i] = row
            fill += n
        row_len = np.bincount(row_of, weights=piece_len).astype(np.int64)
    else:
        row_len = piece_len
    out_start = np.cumsum(piece_len) - piece_len  # where each piece lands in the output
    within = np.arange(int(piece_len.sum())) - np.repeat(out_start, piece_len)
    take = np.repeat(piece_start, piece_len) + within
    labels = docs.labels[take]
    row_offsets = np.cumsum(row_len) - row_len
    out = {
        "input_ids": docs.ids[take],
        "labels": labels,
        "length": row_len,
        "targets": np.add.reduceat((labels != IGNORE_INDEX).astype(np.int64), row_offsets),
    }
    if packing:
        out["position_ids"] = within.astype(np.int32)
    return out


def _list_array(flat: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """int32 lists of ``lengths`` items over ``flat`` (64-bit offsets: no size limit)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()))


def _lists(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, lengths) of a list column: zero-copy where it is one chunk."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return values, np.diff(offsets)


DOCS_SCHEMA = pa.schema(
    [
        ("input_ids", pa.large_list(pa.int32())),
        ("labels", pa.large_list(pa.int32())),
        ("length", pa.int64()),
        ("first_target", pa.int64()),  # Note [documents without targets]
        ("issues", pa.uint8()),
    ]
)


def first_targets(labels: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per document, the position of its first label != -100 (-1 where there is none);
    ``labels`` flat [sum(lengths)]. A row of the document's first ``n`` positions keeps
    a target iff this is in ``[0, n)``."""
    ends = np.cumsum(lengths)
    hits = np.flatnonzero(labels != IGNORE_INDEX)
    first = np.full(len(lengths), -1, np.int64)
    if len(hits):
        doc = np.searchsorted(ends, hits, side="right")
        docs_hit, at = np.unique(doc, return_index=True)  # hits ascend: the first of each
        first[docs_hit] = hits[at] - (ends - lengths)[docs_hit]
    return first


def conversation_issues(columns: dict[str, list], fmt: str) -> np.ndarray:
    """The ``ISSUE_*`` bits of each document of ``columns`` (Note [documents without
    targets]); 0 for plain strings."""
    if fmt == "messages":
        conversations = columns["messages"]
    elif fmt == "prompt_completion" and any(isinstance(p, list) for p in columns["prompt"]):
        conversations = [list(p or []) + list(c or []) for p, c in zip(*columns.values())]
    else:
        return np.zeros(len(next(iter(columns.values()))), np.uint8)
    out = np.zeros(len(conversations), np.uint8)
    for i, messages in enumerate(conversations):
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages or ()]
        if any(r not in KNOWN_ROLES for r in roles):
            out[i] |= ISSUE_ROLE
        if fmt == "messages" and "assistant" not in roles:
            out[i] |= ISSUE_NO_ASSISTANT
        if any(
            isinstance(m, dict) and m.get("content") is None and not m.get("tool_calls")
            for m in messages or ()
        ):
            out[i] |= ISSUE_NULL_CONTENT
    return out


def _rows_schema(packing: bool) -> pa.Schema:
    lists = ("input_ids", "labels") + (("position_ids",) if packing else ())
    fields = [(name, pa.large_list(pa.int32())) for name in lists]
    return pa.schema([*fields, ("length", pa.int64()), ("targets", pa.int64())])


class HFRows(Dataset):
    """Rows of the cache's rows file as lm batch dicts, padded to ``seq_len``.

    int64 ``input_ids``, ``labels`` (-100 on padding) and ``attention_mask`` (0 on padding)
    [seq_len]; packed rows add ``position_ids`` [seq_len] (padding is one more document).
    The file is memory-mapped: a row's pages are read when it is. Pickled as its path
    (input workers map the file again).
    """

    def __init__(self, path: Path, seq_len: int, pad_id: int, packing: bool) -> None:
        self.path, self.seq_len, self.pad_id, self.packing = Path(path), seq_len, pad_id, packing
        self._open()

    @functools.cached_property
    def fingerprint(self) -> str:
        """The digest of the rows' bytes (what a resume compares: data_fingerprint in
        sampler.py). Not the cache key: that changes when a data file is touched or copied
        without its modification time, while the rows made of it stay the same."""
        return content_digest(self.path)

    def _open(self) -> None:
        table = MappedFile(self.path).table
        names = ("input_ids", "labels") + (("position_ids",) if self.packing else ())
        # Per record batch, each list column's (offsets, values): views of the map.
        self._batches = []
        starts = [0]
        for batch in table.to_batches():
            columns = {}
            for name in names:
                array = batch.column(name)
                columns[name] = (array.offsets.to_numpy(), array.values.to_numpy())
            self._batches.append(columns)
            starts.append(starts[-1] + batch.num_rows)
        self._starts = np.array(starts, np.int64)

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in ("path", "seq_len", "pad_id", "packing")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _row(self, i: int, name: str) -> np.ndarray:
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        offsets, values = self._batches[b][name]
        j = i - int(self._starts[b])
        return values[offsets[j] : offsets[j + 1]]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        ids = self._row(i, "input_ids")
        n, pad = len(ids), self.seq_len - len(ids)
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        input_ids[:n], labels[:n] = ids, self._row(i, "labels")
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[:n] = 1
        out = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention_mask),
        }
        if self.packing:
            positions = np.empty(self.seq_len, dtype=np.int64)
            positions[:n] = self._row(i, "position_ids")
            positions[n:] = np.arange(pad)
            out["position_ids"] = torch.from_numpy(positions)
        return out


# -- reading the data --------------------------------------------------------------------


def _python_columns(table: pa.Table, names) -> dict[str, list]:
    """``names`` of ``table`` as Python values, decoded by the table's datasets features
    where it has them: datasets 5 reads messages of different keys (one with a
    ``name``) as its ``Json`` type, JSON text in Arrow, which decodes to the dicts."""
    columns = {c: table.column(c).to_pylist() for c in names}
    if b"huggingface" in (table.schema.metadata or {}):
        features = _import_datasets().Features.from_arrow_schema(table.schema)
        columns = {c: features.decode_column(v, c) for c, v in columns.items()}
    return columns


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "HFDatasetProcessor needs the datasets package: pip install 'weightstream[hf]'"
        ) from e
    return datasets


def _data_source(s: Section) -> tuple[str, list[str]]:
    """(builder, files): ``"json"``/``"parquet"``/``"csv"`` and the files, or ``"disk"`` and
    the save_to_disk folder."""
    where = s.where("data_dir")
    data_dir = s.params.get("data_dir")
    if data_dir is None:
        raise ValueError(
            f"{where} is required by HFDatasetProcessor: a .jsonl, .json, .parquet or .csv "
            "file, a glob or list of them, or a folder written by save_to_disk."
        )
    entries = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else data_dir
    if not isinstance(entries, (list, tuple)) or not entries:
        raise TypeError(f"{where} must be a path, a glob or a list of them, got {data_dir!r}.")
    files: list[str] = []
    for entry in map(os.fspath, entries):
        path = Path(entry)
        if glob.has_magic(entry):
            found = sorted(p for p in glob.glob(entry, recursive=True) if Path(p).is_file())
            if not found:
                raise ValueError(f"{where}: the glob {entry!r} matches no file. Fix the pattern.")
            files += found
        elif path.is_dir():
            if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
                raise ValueError(
                    f"{where}: {entry!r} is a folder, but not one written by save_to_disk (it "
                    f"has no state.json). Fix: name its data files, e.g. {entry}/*.jsonl."
                )
            if len(entries) > 1:
                raise ValueError(
                    f"{where}: a save_to_disk folder ({entry!r}) must be data_dir's only entry."
                )
            return "disk", [entry]
        elif path.is_file():
            files.append(entry)
        else:
            raise ValueError(f"{where}: {entry!r} does not exist. Fix: give an existing file.")
    kinds = set()
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in SUFFIXES:
            raise ValueError(
                f"{where}: {f!r} has the suffix {suffix or '(none)'!r}; HFDatasetProcessor reads "
                f"{', '.join(SUFFIXES)} files or save_to_disk folders. Fix: convert the file, "
                "or rename it if its content is one of these."
            )
        kinds.add(SUFFIXES[suffix])
    if len(kinds) > 1:
        raise ValueError(
            f"{where} mixes file kinds ({', '.join(sorted(kinds))}). Fix: give files of one kind."
        )
    return kinds.pop(), files


@dataclass(frozen=True)
class _Source:
    """The data of ``data_dir``, not read yet: ``kind`` and ``files`` as
    :func:`_data_source` gives them (for ``"disk"``, the folder's Arrow files), and a
    fingerprint that changes when they do."""

    kind: str
    files: list[str]
    fingerprint: str


def _open_source(s: Section) -> _Source:
    kind, files = _data_source(s)
    if kind != "disk":
        # As datasets fingerprints local files: their paths and modification times.
        stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        return _Source(kind, files, _digest(kind, stats))
    datasets = _import_datasets()
    data = datasets.load_from_disk(files[0])  # memory-mapped, not read: its files and state
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(
                f"{s.where('data_dir')}: {files[0]!r} holds the splits "
                f"{', '.join(data)} and no 'train'. Fix: name one split's folder "
                f"({files[0]}/<split>)."
            )
        data = data["train"]
    assert data._indices is None, "save_to_disk writes the rows themselves, not indices"
    return _Source(kind, [f["filename"] for f in data.cache_files], data._fingerprint)


def _batches(source: _Source, where: str, cache_dir: str | None) -> Iterator[pa.Table]:
    """The data's rows in order, as tables of at most :data:`TOKENIZE_BATCH` rows, read a
    batch at a time (Note [hf dataset cache]). ``cache_dir``: where datasets keeps its
    lock files (it writes nothing else when streaming)."""
    if source.kind == "disk":
        for name in source.files:
            mapped = MappedFile(Path(name))
            for start in range(0, mapped.table.num_rows, TOKENIZE_BATCH):
                batch = mapped.table.slice(start, TOKENIZE_BATCH)
                yield batch
                mapped.drop_pages(batch.columns)  # the caller is done with it
        return
    datasets = _import_datasets()
    files = source.files
    what = f"{files[0]!r}{f' (and {len(files) - 1} more)' if len(files) > 1 else ''}"
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        raise ValueError(
            f"{where}: {empty[0]!r} is empty (0 bytes){f', and {len(empty) - 1} more' if len(empty) > 1 else ''}: "
            "it has no rows. Fix: remove it from data_dir, or write its rows."
        )
    try:
        # streaming: read a chunk at a time (datasets' own parsers), no Arrow copy made.
        stream = datasets.load_dataset(
            source.kind, data_files=files, split="train", streaming=True, cache_dir=cache_dir
        )
        yield from stream.with_format("arrow").iter(batch_size=TOKENIZE_BATCH)
    except Exception as e:  # datasets' own errors (DatasetGenerationError) have no common base
        bad = _first_bad_json_line(files) if source.kind == "json" else None
        if bad is not None:
            raise ValueError(
                f"{where}: {bad}. Fix: make each line of a .jsonl file one JSON object."
            ) from e
        raise ValueError(
            f"{where}: cannot read {what} as {source.kind} ({type(e).__name__}: {e}). "
            "Fix: check that every file is valid and that all have the same columns."
        ) from e


def _first_bad_json_line(files: list[str]) -> str | None:
    """Where the first line of JSON Lines ``files`` that is not a JSON object is, and why
    (None: every line parses; a .json file holding one document is not read by lines)."""
    for name in files:
        if not name.endswith((".jsonl", ".jsonl.gz")) and not name.endswith(".ndjson"):
            continue
        opener = gzip.open if name.endswith(".gz") else open
        with opener(name, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{name!r} line {number} is not valid JSON ({e.msg} at column {e.colno})"
                if not isinstance(value, dict):
                    return f"{name!r} line {number} is a JSON {type(value).__name__}, not an object"
    return None


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _progress(desc: str, total: int | None):
    """datasets' progress bar (``datasets.disable_progress_bars()`` silences it)."""
    return _import_datasets().utils.tqdm(desc=desc, total=total, unit=" documents")


# The columns each format reads.
_FORMAT_COLUMNS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
}


def _write_docs(path: Path, source: _Source, s: Section, settings: HFDataSettings, tokenizer):
    """Tokenize the data into the documents file ``path`` (Note [hf dataset cache])."""
    batches = _batches(source, s.where("data_dir"), settings.cache_dir)
    first = next(batches, None)
    while first is not None and first.num_rows == 0:
        first = next(batches, None)
    if first is None:
        raise ValueError(f"{s.where('data_dir')}: the data holds no document. Fix: give data.")
    fmt = detect_format(first.column_names, settings.format, f"{s.section} ({s.processor})")
    if fmt != "text" and not _chat_template(tokenizer) and _uses_template(first, fmt):
        raise ValueError(
            f"{s.where('tokenizer')}: the data are conversations, but the tokenizer at "
            f"{settings.tokenizer!r} has no chat template. Fix: give a tokenizer with one "
            "(tokenizer_config.json's chat_template, or chat_template.jinja)."
        )
    encoder = DocumentEncoder(tokenizer, fmt, settings.completion_only_loss)
    schema = DOCS_SCHEMA.with_metadata({"format": fmt})
    # No total: a stream's length is known once it has been read.
    bar = _progress(f"{s.section}: tokenizing", None)
    row = 0  # the data row of the table's first (for errors naming file and line)
    with ArrowStreamWriter(path, schema) as writer, bar:
        for table in itertools.chain([first], batches):
            if table.num_rows == 0:
                continue
            _check_columns(table, fmt, row, source, s, settings)
            columns = _python_columns(table, _FORMAT_COLUMNS[fmt])
            docs = encoder(columns)
            arrays = [
                _list_array(docs.ids, docs.lengths),
                _list_array(docs.labels, docs.lengths),
                pa.array(docs.lengths),
                pa.array(first_targets(docs.labels, docs.lengths)),
                pa.array(conversation_issues(columns, fmt), pa.uint8()),
            ]
            writer.write(pa.record_batch(arrays, schema=schema))
            bar.update(len(docs.lengths))
            row += table.num_rows


def _check_columns(
    table: pa.Table, fmt: str, row: int, source: _Source, s: Section, settings: HFDataSettings
) -> None:
    """A row without the format's column (absent from its line, or null) is an error
    naming where it is, what it has and the format; ``row``: the table's first row."""
    for name in _FORMAT_COLUMNS[fmt]:
        if name not in table.column_names:
            missing = 0
        else:
            column = table.column(name)
            if column.null_count == 0:
                continue
            missing = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        has = [c for c in table.column_names if table.column(c)[missing].is_valid]
        how = " (detected from the columns: format auto)" if settings.format == "auto" else ""
        raise ValueError(
            f"{s.where('data_dir')}: {_places(source, [row + missing])[0]} has no {name!r} "
            f"(missing or null), which format {fmt!r}{how} reads; the row has "
            f"{', '.join(map(repr, has)) or 'no keys'}. Fix: give every row {name!r} (rename "
            "its key), or remove the row."
        )
    if fmt == "messages" and pa.types.is_list(table.schema.field("messages").type):
        import pyarrow.compute as pc

        empty = np.flatnonzero(pc.equal(pc.list_value_length(table.column("messages")), 0))
        if len(empty):
            raise ValueError(
                f"{s.where('data_dir')}: {_places(source, [row + int(empty[0])])[0]} has an "
                "empty 'messages' list: a conversation needs at least one message. Fix: give "
                "it its messages, or remove the row."
            )


def _places(source: _Source, rows: Sequence[int]) -> list[str]:
    """Where data rows ``rows`` (0-based, the files in order) are, for messages: ``file
    line N`` in .jsonl files (blank lines hold no row, as datasets reads them), ``file row
    N`` (0-based) in parquet files, else ``row N of the data``. Reads the files: only on
    the way to an error or a warning."""
    found: dict[int, str] = {}
    wanted = set(rows)
    base = 0
    try:
        for f in source.files if source.kind in ("json", "parquet") else ():
            if source.kind == "parquet":
                import pyarrow.parquet as pq

                n = pq.ParquetFile(f).metadata.num_rows
                found.update({r: f"{f} row {r - base}" for r in wanted if 0 <= r - base < n})
            elif f.lower().endswith(".jsonl"):
                n = 0
                with open(f, "rb") as lines:
                    for number, line in enumerate(lines, 1):
                        if line.strip():
                            if base + n in wanted:
                                found[base + n] = f"{f} line {number}"
                            n += 1
            else:  # a .json file's rows need not be lines: the later files' are unknown
                break
            base += n
    except OSError:
        pass
    return [found.get(r, f"row {r} of the data (0-based)") for r in rows]


def _write_rows(
    path: Path, docs: MappedFile, head: tuple[int, int], settings: HFDataSettings, desc: str
):
    """Cut or pack documents ``head[0]:head[1]`` of ``docs`` into the rows file ``path``,
    :data:`PACK_BATCH` documents at a time (Note [packing])."""
    schema = _rows_schema(settings.packing)
    with ArrowStreamWriter(path, schema) as writer, _progress(desc, head[1] - head[0]) as bar:
        for start in range(head[0], head[1], PACK_BATCH):
            piece = docs.table.slice(start, min(PACK_BATCH, head[1] - start))
            ids, lengths = _lists(piece.column("input_ids"))
            labels, _ = _lists(piece.column("labels"))
            rows = make_rows(
                DocBatch(ids, labels, lengths),
                settings.seq_len,
                settings.packing,
                settings.overflow,
            )
            columns = [_list_array(rows[name], rows["length"]) for name in schema.names[:-2]]
            columns += [pa.array(rows["length"]), pa.array(rows["targets"])]
            writer.write(pa.record_batch(columns, schema=schema))
            docs.drop_pages(piece.columns)
            bar.update(piece.num_rows)


@contextlib.contextmanager
def _one_builder(path: Path) -> Iterator[None]:
    """Hold the build of cache file ``path`` for this process: another process (a rank of
    the same run, another run on the same data) waits here until it is built, then finds
    it and reads nothing of the data (it tokenized all of it a second time). A lock of
    the kernel's: a builder killed mid-way lets the next one in."""
    with open(path.with_name(f".{path.name}.lock"), "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for another process's build
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def build_rows(s: Section, is_training: bool) -> HFRows:
    """The rows of section ``s``: read, tokenized and cut or packed, from the cache when there."""
    settings = read_settings(s)
    tokenizer = load_hf_tokenizer(settings.tokenizer, s.where("tokenizer"))
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(_no_eos_message(s, settings.tokenizer, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    source = _open_source(s)
    cache = Path(settings.cache_dir or _import_datasets().config.HF_DATASETS_CACHE)
    cache = cache / "weightstream"
    cache.mkdir(parents=True, exist_ok=True)
    # The format key as given, not as detected: the detected one is a function of the
    # data and the key, and a cached build then reads nothing of the data.
    fp_docs = _digest(
        ROWS_VERSION,
        source.fingerprint,
        _tokenizer_digest(settings.tokenizer),
        settings.format,
        settings.completion_only_loss,
    )
    docs_path = cache / f"docs-{fp_docs}.arrow"
    with _one_builder(docs_path):
        if not docs_path.is_file():
            _write_docs(docs_path, source, s, settings, tokenizer)
    docs = MappedFile(docs_path)
    fmt = docs.table.schema.metadata[b"format"].decode()
    n_docs, head = docs.table.num_rows, (0, docs.table.num_rows)
    if settings.eval_fraction is not None:
        cut = int(n_docs * (1.0 - settings.eval_fraction))
        head = (0, cut) if is_training else (cut, n_docs)
        if head[0] == head[1]:
            raise ValueError(
                f"{s.where('eval_fraction')} = {settings.eval_fraction} of {n_docs} documents "
                f"leaves none for {s.section}. Fix: give more data or another eval_fraction."
            )
    fp_rows = _digest(fp_docs, head, settings.seq_len, settings.packing, settings.overflow)
    rows_path = cache / f"rows-{fp_rows}.arrow"
    with _one_builder(rows_path):
        if not rows_path.is_file():
            verb = "packing" if settings.packing else "cutting"
            _write_rows(rows_path, docs, head, settings, f"{s.section}: {verb} rows")
    _summarize(s, settings, fmt, docs, head, rows_path, source)
    rows = HFRows(rows_path, settings.seq_len, pad, settings.packing)
    if len(rows) == 0:
        raise ValueError(f"{s.where('data_dir')}: the data holds no document. Fix: give data.")
    return rows


# -- train_input and eval_input on the same data ------------------------------------------


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


def _no_eos_message(s: Section, path: str, tokenizer) -> str:
    """The error of a tokenizer without eos: the fix for its folder as it is (a bare
    tokenizer.json has no tokenizer_config.json to edit)."""
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    added = [t for t in getattr(tokenizer, "get_added_vocab", dict)() if t not in special]
    known = special + added
    names = f" (its special/added tokens: {', '.join(map(repr, known[:8]))})" if known else ""
    eos = known[0] if known else "<eos>"
    folder = Path(path)
    if (folder / "tokenizer_config.json").is_file():
        fix = f'set "eos_token": "<its end token>"{names} in {folder / "tokenizer_config.json"}'
    else:
        fix = (
            f"{path!r} has no tokenizer_config.json to set it in (only tokenizer.json?); write "
            "one with: from transformers import PreTrainedTokenizerFast; "
            f"PreTrainedTokenizerFast(tokenizer_file={str(folder / 'tokenizer.json')!r}, "
            f"eos_token={eos!r}).save_pretrained({path!r}), with the tokenizer's own end "
            f"token{names} (add chat_template=... for conversations)"
        )
    return (
        f"{s.where('tokenizer')}: the tokenizer at {path!r} has no eos token, which ends "
        f"every document. Fix: {fix}."
    )


def _uses_template(first: pa.Table, fmt: str) -> bool:
    if fmt == "messages":
        return True
    return isinstance(first.column("prompt")[0].as_py(), list)


@dataclass(frozen=True)
class _Counts:
    """What a section's documents and rows hold (Note [documents without targets])."""

    docs: int
    long: int  # longer than seq_len
    excess: int  # their tokens beyond seq_len
    rows: int
    tokens: int
    targets: int  # labels != -100 in the rows
    no_target: int  # documents without any target
    cut_off: int  # documents with targets, none of them kept by truncation
    first_min: int  # the earliest first target of the cut-off documents
    first_max: int  # and the latest
    # overflow: split: the pieces cut before a document's first target (its prompt longer
    # than seq_len), which hold no target
    untargeted_pieces: int
    issues: dict[int, int]  # ISSUE_* bit -> documents with it
    untrained_issues: dict[int, int]  # ISSUE_* bit -> documents with it and no target


def _count(settings: HFDataSettings, docs: MappedFile, head: tuple[int, int], rows_path: Path):
    """The section's :class:`_Counts`, from the length, first_target and issues columns
    of the memory-mapped files (no copy of the tokens; their pages given back)."""
    import pyarrow.compute as pc

    n = head[1] - head[0]
    lengths, first, issues = (
        docs.table.column(c).slice(head[0], n) for c in ("length", "first_target", "issues")
    )
    # Split: longer than a row once its last token, which has no target, is left out.
    split = settings.overflow == "split"
    long = pc.greater(lengths, settings.seq_len + (1 if split else 0))
    over = pc.subtract(pc.filter(lengths, long), settings.seq_len)
    late = pc.filter(first, pc.greater_equal(first, settings.seq_len))
    if settings.overflow == "truncate":
        cut_first, untargeted = late, 0
    else:  # split keeps every token, targets included; the pieces before the first have none
        cut_first = pa.array([], pa.int64())
        untargeted = sum(f // settings.seq_len for f in late.to_pylist())
    none = pc.equal(first, -1)
    has = {
        bit: pc.not_equal(pc.bit_wise_and(issues, bit), 0)
        for bit in (ISSUE_ROLE, ISSUE_NO_ASSISTANT, ISSUE_NULL_CONTENT)
    }
    rows = MappedFile(rows_path)
    row_lengths, row_targets = rows.table.column("length"), rows.table.column("targets")
    counts = _Counts(
        docs=n,
        long=int(pc.sum(long).as_py() or 0),
        excess=int(pc.sum(over).as_py() or 0),
        rows=rows.table.num_rows,
        tokens=int(pc.sum(row_lengths).as_py() or 0),
        targets=int(pc.sum(row_targets).as_py() or 0),
        no_target=_sum(none),
        cut_off=len(cut_first),
        first_min=int(pc.min(cut_first).as_py() or 0),
        first_max=int(pc.max(cut_first).as_py() or 0),
        untargeted_pieces=untargeted,
        issues={bit: _sum(has[bit]) for bit in has},
        untrained_issues={bit: _sum(pc.and_(has[bit], none)) for bit in has},
    )
    docs.drop_pages([lengths, first, issues])
    rows.drop_pages([row_lengths, row_targets])
    return counts


def _sum(values) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(values).as_py() or 0)


def _first_rows(docs: MappedFile, head: tuple[int, int], column: str, test, limit: int = 3):
    """The data rows (0-based) of the first ``limit`` documents of ``head`` whose
    ``column`` value passes ``test`` (a numpy predicate)."""
    found: list[int] = []
    for start in range(head[0], head[1], PACK_BATCH):
        values = docs.table.column(column).slice(start, min(PACK_BATCH, head[1] - start))
        hits = np.flatnonzero(test(values.to_numpy()))
        found += (start + hits[: limit - len(found)]).tolist()
        docs.drop_pages([values])
        if len(found) >= limit:
            break
    return found


_ISSUE_WORDS = {
    ISSUE_NO_ASSISTANT: "without an assistant turn (role 'assistant')",
    ISSUE_ROLE: f"with a message whose role is none of {', '.join(KNOWN_ROLES)} (misspelled?)",
    ISSUE_NULL_CONTENT: "with a message whose content is null (and no tool_calls)",
}


def _where(source: _Source, docs: MappedFile, head: tuple[int, int], column: str, test) -> str:
    rows = _first_rows(docs, head, column, test)
    return "; first at " + ", ".join(_places(source, rows)) if rows else ""


def _summarize(
    s: Section,
    settings: HFDataSettings,
    fmt: str,
    docs: MappedFile,
    head: tuple[int, int],
    rows_path: Path,
    source: _Source,
) -> None:
    """Refuse rows without a single target; log the section's summary line and warn of
    documents without targets or with suspicious messages, once per process (Note
    [documents without targets])."""
    c = _count(settings, docs, head, rows_path)
    if c.targets == 0:
        raise ValueError(_no_targets_message(s, settings, fmt, c, docs, head, source))
    # Once a run (the run context's record): the run command builds a section's loader
    # more than once (the compile phase's example batch, the training loader).
    said, key = current_run().logged, ("hf data summary", s.section, os.fspath(rows_path))
    if key in said:
        return
    said.add(key)
    seq = settings.seq_len
    if c.long == 0:
        cut = f"none longer than seq_len = {seq}"
    elif settings.overflow == "split":
        cut = f"{c.long} longer than seq_len = {seq}, split into pieces"
    else:
        cut = f"{c.long} longer than seq_len = {seq}, truncated ({c.excess} tokens dropped)"
    untrained = ""
    if c.no_target or c.cut_off:
        untrained = f"; {_documents(c.no_target + c.cut_off)} without a target (train nothing)"
    log.info(
        "%s: HFDatasetProcessor: %d %s documents (%s) in %d %s rows; %d tokens, %.1f%% of the "
        "rows' positions (the rest is padding); %d targets (labels != -100)%s",
        s.section,
        c.docs,
        fmt,
        cut,
        c.rows,
        "packed" if settings.packing else "unpacked",
        c.tokens,
        100.0 * c.tokens / max(1, c.rows * seq),
        c.targets,
        untrained,
    )
    if c.no_target:
        log.warning(
            "%s: %s of %d without a target token (labels != -100 nowhere): they train "
            "nothing%s%s. Fix: %s",
            s.section,
            _documents(c.no_target),
            c.docs,
            _reasons(c, fmt),
            _where(source, docs, head, "first_target", lambda v: v == -1),
            _no_target_fix(settings, fmt),
        )
    if c.cut_off:
        log.warning(
            "%s: truncation to seq_len = %d (overflow: truncate) leaves %d of %d documents "
            "without a target: their first target is at position %d to %d, beyond the row%s. "
            "Fix: raise seq_len to at least %d, or set overflow: split.",
            s.section,
            seq,
            c.cut_off,
            c.docs,
            c.first_min,
            c.first_max,
            _where(source, docs, head, "first_target", lambda v: v >= seq),
            c.first_max + 1,
        )
    if c.untargeted_pieces:
        log.warning(
            "%s: splitting at seq_len = %d (overflow: split) cuts %d piece(s) from before "
            "their document's first target (prompts longer than seq_len%s): they hold no "
            "target and train nothing, and a batch of only such rows steps at loss 0 (AdamW "
            "still applies its weight decay and momentum). Fix: raise seq_len past the "
            "prompts, shorten them, or drop those documents.",
            s.section,
            seq,
            c.untargeted_pieces,
            _where(source, docs, head, "first_target", lambda v: v >= seq),
        )
    for bit, effect in (
        (ISSUE_ROLE, "the template renders it like any role (its header) and trains none of it"),
        (ISSUE_NULL_CONTENT, "the template renders null as it does (Jinja: 'None' or nothing)"),
    ):
        if c.issues[bit]:
            log.warning(
                "%s: %s %s%s: %s. Fix: correct these messages, or remove them.",
                s.section,
                _documents(c.issues[bit]),
                _ISSUE_WORDS[bit],
                _where(source, docs, head, "issues", lambda v, b=bit: (v & b) != 0),
                effect,
            )


def _documents(n: int) -> str:
    return f"{n} document{'' if n == 1 else 's'}"


def _reasons(c: _Counts, fmt: str) -> str:
    """`` (messages: N without an assistant turn; ...)``: what the documents without a
    target had wrong, where their issues say."""
    counts = c.untrained_issues
    parts = [f"{counts[bit]} {_ISSUE_WORDS[bit]}" for bit in _ISSUE_WORDS if counts[bit]]
    return f" ({fmt}: {'; '.join(parts)})" if parts else ""


def _no_target_fix(settings: HFDataSettings, fmt: str) -> str:
    if fmt == "messages":
        fix = "give each conversation an assistant turn (role 'assistant', spelled so)"
    elif fmt == "prompt_completion":
        fix = "give each prompt a non-empty completion"
    else:
        fix = "give non-empty texts"
    if settings.completion_only_loss and fmt != "text":
        fix += ", or set completion_only_loss: false to train on every token"
    return fix + ", or remove these documents."


def _no_targets_message(
    s: Section,
    settings: HFDataSettings,
    fmt: str,
    c: _Counts,
    docs: MappedFile,
    head: tuple[int, int],
    source: _Source,
) -> str:
    use = (
        "training would run at loss 0 and learn nothing"
        if s.section == "train_input"
        else "the eval loss and metrics would be 0 or nan"
    )
    if c.no_target < c.docs:  # the documents have targets: truncation dropped them all
        what = (
            f"truncation to seq_len = {settings.seq_len} (overflow: truncate) leaves none of "
            f"the {c.docs} {fmt} documents a target token (labels != -100): in each the first "
            f"target (the completion's or the assistant's first token) is at position "
            f"{c.first_min} or later, beyond the row"
        )
        if c.no_target:
            what += f" ({c.no_target} have no target at all)"
        fix = (
            f"raise {s.where('seq_len')} to at least {c.first_min + 1} (to {c.first_max + 1} "
            "to keep targets in every document), or set overflow: split (the pieces "
            "after the first hold the targets)"
        )
    else:
        what = (
            f"none of the {c.docs} {fmt} documents has a target token (labels != -100)"
            f"{_reasons(c, fmt)}"
            f"{_where(source, docs, head, 'first_target', lambda v: v == -1)}"
        )
        fix = _no_target_fix(settings, fmt).rstrip(".")
    return f"{s.section}: {what}, so {use}. Fix: {fix}."

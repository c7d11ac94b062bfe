"""The tokenizer, and the documents made of the data's examples: token ids and labels
shifted as every lm batch's, eos-terminated, as flat arrays.

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
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightstream.data.hf_dataset.settings import (
    IGNORE_INDEX,
    ISSUE_NO_ASSISTANT,
    ISSUE_NULL_CONTENT,
    ISSUE_ROLE,
    KNOWN_ROLES,
)

# Files of a model folder that do not define its tokenizer (weights): not hashed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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


def tokenizer_digest(path: str) -> str:
    """A digest of the files that define the tokenizer (not the model's weights beside it)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.startswith("."):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def chat_template(tokenizer) -> str:
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
                "weightstream/data/hf_dataset/tokens.py). Fix: wrap the assistant's turns of the "
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
        self.markers = bool(_GENERATION_TAG.search(chat_template(tokenizer)))
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

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
  pieces of ``seq_len`` tokens, each its own row or packed document, or ``truncate`` (its
  tail is dropped). Either way the counts are logged;
- ``eval_fraction``: if given, the training section takes the documents' head and
  ``eval_input`` the tail of this fraction (give the same data and value in both); without
  it a section reads all of its ``data_dir`` (a separate eval set);
- ``cache_dir``: where the Arrow files go (default: ``datasets``' cache,
  ``HF_DATASETS_CACHE``, ``~/.cache/huggingface/datasets``): the files read into Arrow by
  ``load_dataset``, and this module's tokenized and packed rows under
  ``<cache_dir>/weightstream/``.

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

Note [packing]
~~~~~~~~~~~~~~
With ``packing: true`` documents are placed in rows of ``seq_len`` tokens in their order,
next fit: a document goes in the current row if it fits, else it starts a new row (the
rest of the old one is padding: one padded document). A document longer than ``seq_len`` is
first cut by ``overflow`` (pieces of ``seq_len``, each packed as its own document; or its
head). Packing works on batches of :data:`PACK_BATCH` documents (a batched ``.map``:
memory bounded by one batch, whatever the data's size); a batch's last row is not filled
from the next batch. Packed rows carry ``position_ids`` that restart at 0 at each
document (padding counts as one more); the model call gets them and a 4-D attention mask
that lets a token see only earlier tokens of its own document
(``weightstream.models.tasks.model_kwargs``), so each document's logits are those of the
document alone. That needs a transformers model (the zoo's models take no mask).

Note [hf dataset cache]
~~~~~~~~~~~~~~~~~~~~~~~
Tokenized documents and rows are Arrow files written by ``Dataset.map`` (batched, with
``datasets``' progress bar) and read memory-mapped: a dataset of any size never sits in
RAM, and the run command, which builds a section's loader more than once (the compile
phase's first batch, then training), tokenizes once. Their names are fingerprints of what
they depend on: the raw data's fingerprint (``datasets`` derives it from the files), the
tokenizer's files, the settings and :data:`ROWS_VERSION`; a change of any gives new files.
Concurrent ranks that build the same file each write a temporary file and rename it.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from weightstream.data.section import SEQ_KEYS, Section

log = logging.getLogger("weightstream")

__all__ = [
    "FORMATS",
    "HF_DATASET_KEYS",
    "IGNORE_INDEX",
    "DocumentEncoder",
    "HFDataSettings",
    "HFRows",
    "build_rows",
    "detect_format",
    "hf_tokenizer_vocab_size",
    "load_hf_tokenizer",
]

HF_DATASET_KEYS = SEQ_KEYS | {
    "tokenizer",
    "format",
    "completion_only_loss",
    "packing",
    "overflow",
    "eval_fraction",
    "cache_dir",
}
FORMATS = ("auto", "text", "prompt_completion", "messages")
IGNORE_INDEX = -100
# Suffix -> the ``datasets`` builder that reads it.
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PACK_BATCH = 1000  # documents per packing batch (Note [packing])
TOKENIZE_BATCH = 1000  # documents per tokenizing batch of .map
# Part of every cache file's fingerprint: change it when the rows this module makes from
# the same data and settings change (Note [hf dataset cache]).
ROWS_VERSION = "1"
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
    """Token ids and pre-shifted labels of a batch of examples (a batched ``.map`` function).

    Picklable (``datasets`` may run it in worker processes): it holds the tokenizer and
    the settings only.
    """

    def __init__(self, tokenizer, fmt: str, completion_only_loss: bool) -> None:
        self.tokenizer = tokenizer
        self.format = fmt
        self.completion_only_loss = completion_only_loss
        self.eos_id = tokenizer.eos_token_id
        self.markers = bool(_GENERATION_TAG.search(_chat_template(tokenizer)))

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        n = len(next(iter(batch.values())))
        out: dict[str, list] = {"input_ids": [], "labels": [], "length": []}
        # Plain strings are tokenized a batch at a time (on the tokenizer's threads); the
        # tokens are those of one call per string.
        pre = self._batch_tokens(batch)
        for i in range(n):
            example = {k: v[i] for k, v in batch.items()}
            if pre is not None:
                example["_tokens"] = tuple(column[i] for column in pre)
            ids, trained = self.encode(example)
            out["input_ids"].append(ids)
            out["labels"].append(shifted_labels(ids, trained))
            out["length"].append(len(ids))
        return out

    def _batch_tokens(self, batch: dict[str, list]) -> tuple[list, ...] | None:
        tok = self.tokenizer
        if self.format == "text":
            return (tok(batch["text"])["input_ids"],)
        if self.format == "prompt_completion" and not any(
            isinstance(p, list) for p in batch["prompt"]
        ):
            completions = tok(batch["completion"], add_special_tokens=False)["input_ids"]
            return tok(batch["prompt"])["input_ids"], completions
        return None

    def encode(self, example: dict) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token is a target) of one document, eos-terminated.

        ``example["_tokens"]``, where given, holds the tokenizer's ids of its strings."""
        tok = self.tokenizer
        pre = example.get("_tokens")
        if self.format == "text":
            ids = list(pre[0] if pre is not None else tok(example["text"])["input_ids"])
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
            elif pre is not None:
                head = list(pre[0])
                ids = head + list(pre[1])
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


def shifted_labels(ids: Sequence[int], trained: Sequence[int]) -> list[int]:
    """``labels[t] = ids[t + 1]`` where that token is a target, else -100; the last is -100."""
    labels = [nxt if keep else IGNORE_INDEX for nxt, keep in zip(ids[1:], trained[1:], strict=True)]
    return [*labels, IGNORE_INDEX]


# -- rows ------------------------------------------------------------------------------


def _pieces(ids: list, labels: list, seq_len: int, overflow: str) -> list[tuple[list, list]]:
    if len(ids) <= seq_len:
        return [(ids, labels)]
    if overflow == "truncate":
        return [(ids[:seq_len], labels[:seq_len])]
    return [(ids[s : s + seq_len], labels[s : s + seq_len]) for s in range(0, len(ids), seq_len)]


class RowMaker:
    """Documents into rows of at most ``seq_len`` tokens (a batched ``.map`` function):
    one piece a row, or packed (Note [packing])."""

    def __init__(self, seq_len: int, packing: bool, overflow: str) -> None:
        self.seq_len, self.packing, self.overflow = seq_len, packing, overflow

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "targets": []}
        if self.packing:
            out["position_ids"] = []
        row: tuple[list, list, list] = ([], [], [])

        def close(row: tuple[list, list, list]) -> None:
            ids, labels, positions = row
            if not ids:
                return
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["length"].append(len(ids))
            out["targets"].append(sum(x != IGNORE_INDEX for x in labels))
            if self.packing:
                out["position_ids"].append(positions)

        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            for piece_ids, piece_labels in _pieces(ids, labels, self.seq_len, self.overflow):
                if not self.packing or len(row[0]) + len(piece_ids) > self.seq_len:
                    close(row)
                    row = ([], [], [])
                row[0].extend(piece_ids)
                row[1].extend(piece_labels)
                row[2].extend(range(len(piece_ids)))
        close(row)
        return out


class HFRows(Dataset):
    """Rows of the cache's Arrow file as lm batch dicts, padded to ``seq_len``.

    int64 ``input_ids``, ``labels`` (-100 on padding) and ``attention_mask`` (0 on padding)
    [seq_len]; packed rows add ``position_ids`` [seq_len] (padding is one more document).
    """

    def __init__(self, rows, seq_len: int, pad_id: int, packing: bool) -> None:
        self.rows = rows.with_format("numpy")
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[int(i)]
        n, pad = len(row["input_ids"]), self.seq_len - len(row["input_ids"])
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        input_ids[:n], labels[:n] = row["input_ids"], row["labels"]
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[:n] = 1
        out = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention_mask),
        }
        if self.packing:
            positions = np.empty(self.seq_len, dtype=np.int64)
            positions[:n] = row["position_ids"]
            positions[n:] = np.arange(pad)
            out["position_ids"] = torch.from_numpy(positions)
        return out


# -- reading the data --------------------------------------------------------------------


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


def _load_raw(s: Section, cache_dir: str | None):
    datasets = _import_datasets()
    kind, files = _data_source(s)
    if kind == "disk":
        data = datasets.load_from_disk(files[0])
        if isinstance(data, datasets.DatasetDict):
            split = "train" if "train" in data else None
            if split is None:
                raise ValueError(
                    f"{s.where('data_dir')}: {files[0]!r} holds the splits "
                    f"{', '.join(data)} and no 'train'. Fix: name one split's folder "
                    f"({files[0]}/<split>)."
                )
            data = data[split]
        return data
    try:
        return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(
            f"{s.where('data_dir')}: cannot read {files[0]!r}"
            f"{f' (and {len(files) - 1} more)' if len(files) > 1 else ''} as {kind}: "
            f"{type(e).__name__}: {e}"
        ) from e
    except Exception as e:  # datasets' own errors (DatasetGenerationError) have no common base
        raise ValueError(
            f"{s.where('data_dir')}: cannot read the {kind} data ({type(e).__name__}: {e}). "
            "Fix: check that every file is valid and that all have the same columns."
        ) from e


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def build_rows(s: Section, is_training: bool) -> HFRows:
    """The rows of section ``s``: read, tokenized and cut or packed, from the cache when there."""
    settings = read_settings(s)
    tokenizer = load_hf_tokenizer(settings.tokenizer, s.where("tokenizer"))
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"{s.where('tokenizer')}: the tokenizer at {settings.tokenizer!r} has no eos token, "
            "which ends every document. Fix: set eos_token in its tokenizer_config.json."
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    raw = _load_raw(s, settings.cache_dir)
    fmt = detect_format(raw.column_names, settings.format, f"{s.section} ({s.processor})")
    if fmt != "text" and not _chat_template(tokenizer) and _uses_template(raw, fmt):
        raise ValueError(
            f"{s.where('tokenizer')}: the data are conversations, but the tokenizer at "
            f"{settings.tokenizer!r} has no chat template. Fix: give a tokenizer with one "
            "(tokenizer_config.json's chat_template, or chat_template.jinja)."
        )
    cache = Path(settings.cache_dir or _import_datasets().config.HF_DATASETS_CACHE)
    cache = cache / "weightstream"
    cache.mkdir(parents=True, exist_ok=True)
    tok_digest = _tokenizer_digest(settings.tokenizer)
    fp_docs = _digest(
        ROWS_VERSION, raw._fingerprint, tok_digest, fmt, settings.completion_only_loss
    )
    docs = raw.map(
        DocumentEncoder(tokenizer, fmt, settings.completion_only_loss),
        batched=True,
        batch_size=TOKENIZE_BATCH,
        remove_columns=raw.column_names,
        features=_features(("input_ids", "labels"), ("length",)),
        cache_file_name=os.fspath(cache / f"docs-{fp_docs}.arrow"),
        new_fingerprint=fp_docs,
        desc=f"{s.section}: tokenizing",
    )
    n_docs, head = len(docs), (0, len(docs))
    if settings.eval_fraction is not None:
        cut = int(n_docs * (1.0 - settings.eval_fraction))
        head = (0, cut) if is_training else (cut, n_docs)
        if head[0] == head[1]:
            raise ValueError(
                f"{s.where('eval_fraction')} = {settings.eval_fraction} of {n_docs} documents "
                f"leaves none for {s.section}. Fix: give more data or another eval_fraction."
            )
        docs = docs.select(range(*head))
    fp_rows = _digest(fp_docs, head, settings.seq_len, settings.packing, settings.overflow)
    columns = ("input_ids", "labels") + (("position_ids",) if settings.packing else ())
    rows = docs.map(
        RowMaker(settings.seq_len, settings.packing, settings.overflow),
        batched=True,
        batch_size=PACK_BATCH,
        remove_columns=docs.column_names,
        features=_features(columns, ("length", "targets")),
        cache_file_name=os.fspath(cache / f"rows-{fp_rows}.arrow"),
        new_fingerprint=fp_rows,
        desc=f"{s.section}: {'packing' if settings.packing else 'cutting'} rows",
    )
    _log_counts(s, settings, fmt, docs, rows)
    if len(rows) == 0:
        raise ValueError(f"{s.where('data_dir')}: the data holds no document. Fix: give data.")
    return HFRows(rows, settings.seq_len, pad, settings.packing)


def _uses_template(raw, fmt: str) -> bool:
    if fmt == "messages":
        return True
    return len(raw) > 0 and isinstance(raw[0]["prompt"], list)


def _features(lists: Sequence[str], scalars: Sequence[str]):
    datasets = _import_datasets()
    spec = {name: datasets.List(datasets.Value("int32")) for name in lists}
    spec.update({name: datasets.Value("int64") for name in scalars})
    return datasets.Features(spec)


def _column(data, name: str):
    """Column ``name`` as a pyarrow array: zero-copy slices of the memory-mapped file."""
    return data.select_columns([name]).with_format("arrow")[:][name]


def _log_counts(s: Section, settings: HFDataSettings, fmt: str, docs, rows) -> None:
    """One log line: documents, rows, what was cut, how full the rows are, how many targets.

    Reads the length columns from the memory-mapped files (no copy of the tokens)."""
    import pyarrow.compute as pc

    lengths = _column(docs, "length")
    n_docs = len(docs)
    long = pc.greater(lengths, settings.seq_len)
    n_long = int(pc.sum(long).as_py() or 0)
    over = pc.subtract(pc.filter(lengths, long), settings.seq_len)
    excess = int(pc.sum(over).as_py() or 0)
    tokens = int(pc.sum(_column(rows, "length")).as_py() or 0)
    targets = int(pc.sum(_column(rows, "targets")).as_py() or 0)
    if n_long == 0:
        cut = f"none longer than seq_len = {settings.seq_len}"
    elif settings.overflow == "split":
        cut = f"{n_long} longer than seq_len = {settings.seq_len}, split into pieces"
    else:
        cut = (
            f"{n_long} longer than seq_len = {settings.seq_len}, truncated "
            f"({excess} tokens dropped)"
        )
    log.info(
        "%s: HFDatasetProcessor: %d %s documents (%s) in %d %s rows; %d tokens, %.1f%% of the "
        "rows' positions (the rest is padding); %d targets (labels != -100)",
        s.section,
        n_docs,
        fmt,
        cut,
        len(rows),
        "packed" if settings.packing else "unpacked",
        tokens,
        100.0 * tokens / max(1, len(rows) * settings.seq_len),
        targets,
    )

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

The package, by what each module owns:

- ``settings``: the processor's keys, checked, and the train/eval split over the same data;
- ``source``: ``data_dir`` resolved to files, read a batch at a time, with the rows'
  places (file and line) for messages;
- ``tokens``: the tokenizer, and documents' token ids and labels (Notes [assistant
  tokens], [fast batches]);
- ``rows``: documents cut or packed into rows, and the rows file read as a dataset
  (Note [packing]);
- ``build``: the cache files written once and read memory-mapped (Note [hf dataset
  cache]);
- ``summary``: what a section's documents and rows hold, logged, and refused where
  nothing trains (Note [documents without targets]).
"""

from __future__ import annotations

from weightstream.data.hf_dataset.build import build_rows
from weightstream.data.hf_dataset.rows import HFRows, make_rows
from weightstream.data.hf_dataset.settings import (
    FORMATS,
    HF_DATASET_KEY_DOCS,
    HF_DATASET_KEYS,
    IGNORE_INDEX,
    HFDataSettings,
    check_eval_split,
    read_settings,
)
from weightstream.data.hf_dataset.tokens import (
    DocumentEncoder,
    conversation_issues,
    detect_format,
    first_targets,
    hf_tokenizer_vocab_size,
    load_hf_tokenizer,
)

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
    "detect_format",
    "first_targets",
    "hf_tokenizer_vocab_size",
    "load_hf_tokenizer",
    "make_rows",
    "read_settings",
]

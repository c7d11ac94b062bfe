"""Text into token ids with a Hugging Face ``tokenizers`` tokenizer.

The text processors are byte-level by default (one token per byte, a
vocabulary of 256, nothing to load). ``tokenizer: PATH`` in ``train_input`` /
``eval_input`` (and ``weightstream data write-gpt-hdf5 --tokenizer PATH``)
names a ``tokenizer.json`` (the ``tokenizers`` library's file) or a Hugging
Face model folder holding one, as ``save_pretrained`` writes it; the text is
then encoded with it document by document (file by file, batched on the
library's threads), without special tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from weightstream.common.hf_config import file_in

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The ``tokenizer.json`` that ``path`` names (the file, or a folder holding it)."""
    found = file_in(path, TOKENIZER_FILE)
    if found is None:
        raise ValueError(
            f"tokenizer {os.fspath(path)!r} is not a tokenizer.json nor a folder holding one. "
            "Fix: give the tokenizer.json of a tokenizers tokenizer, or a Hugging Face model "
            "folder (as save_pretrained writes it)."
        )
    return found


def load_tokenizer(path: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` at ``path`` (see :func:`tokenizer_file`)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("a tokenizer needs the tokenizers package: pip install tokenizers") from e
    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(os.fspath(file))
    except Exception as e:  # the library raises its own exception type for bad files
        raise ValueError(f"cannot read the tokenizer {file}: {e}") from e


def vocab_size(tokenizer) -> int:
    """How many token ids the tokenizer can produce (added tokens included)."""
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def encode(texts: Sequence[bytes | str], tokenizer) -> np.ndarray:
    """Token ids (int32, 1-D) of ``texts``, each document encoded on its own.

    Documents (files) are encoded separately, as Hugging Face data pipelines
    map a tokenizer over documents, and batched on the library's threads; the
    ids are concatenated in order. Bytes that are not valid UTF-8 become
    U+FFFD, as Python's decoder makes them.
    """
    docs = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
    encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
    ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)

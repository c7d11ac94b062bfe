"""Documents into rows of ``seq_len`` tokens (one piece a row, or packed), and the rows
file read back as the section's dataset.

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
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from weightstream.data.arrow_files import MappedFile, content_digest
from weightstream.data.hf_dataset.settings import IGNORE_INDEX
from weightstream.data.hf_dataset.tokens import DocBatch


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


def list_array(flat: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """int32 lists of ``lengths`` items over ``flat`` (64-bit offsets: no size limit)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()))


def flat_lists(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, lengths) of a list column: zero-copy where it is one chunk."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return values, np.diff(offsets)


def rows_schema(packing: bool) -> pa.Schema:
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

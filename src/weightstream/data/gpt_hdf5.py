"""The reference's GPT HDF5 data format: checks, a sharded reader and a byte-level writer.

Format (one directory):

- ``*.h5`` files, each with a root attribute ``n_examples`` and an integer
  dataset ``data`` of shape [N, 3, seq] (N >= n_examples; rows past
  ``n_examples`` are ignored). ``data[i]`` holds example i's three features,
  by default in the order input_ids, attention_mask, labels;
- optionally ``data_params.json``. The only key read from it is ``features``:
  a list naming the three rows of axis 1 (a permutation of "input_ids",
  "attention_mask", "labels"), for files written in another order. Other keys
  (the reference writes processing settings and dataset statistics there) are
  ignored.

Note [hdf5 sharding]: files, not examples, are the unit of sharding, so each
reader opens only its own files. The sorted file list is dealt out to the
data-parallel ranks (file j to rank j % num_ranks) and each rank's files to
its input workers (its k-th file to worker k % num_workers). The assignment
does not change between epochs, so every worker's share, and the number of
batches a rank yields, is fixed; shuffling permutes the examples inside a
worker's share, from (shuffle_seed, epoch, rank, worker). Ranks whose files
hold different numbers of examples yield different numbers of batches, as in
the reference: give files equal sizes (the writer does, except the last).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.utils.data

from weightstream.common.files import atomic_path

__all__ = [
    "FEATURES",
    "GptHDF5Dataset",
    "H5File",
    "read_features",
    "scan_gpt_hdf5_dir",
    "write_gpt_hdf5",
]

FEATURES = ("input_ids", "attention_mask", "labels")
PARAMS_FILE = "data_params.json"
_WRITE_HINT = "write files in this format with `weightstream data write-gpt-hdf5`"


def _h5py():
    import h5py

    # Importing hdf5plugin registers the LZ4 filter (id 32004) that the
    # reference's writers use by default; without it such files fail to read.
    import hdf5plugin  # noqa: F401

    return h5py


@dataclass(frozen=True)
class H5File:
    """One checked data file: where it is, how many examples it holds, their length."""

    path: str
    n_examples: int
    seq_len: int


def read_features(data_dir: str | os.PathLike) -> tuple[str, str, str]:
    """The feature name of each row of axis 1: ``data_params.json``'s ``features``, or the default."""
    path = Path(data_dir) / PARAMS_FILE
    if not path.exists():
        return FEATURES
    try:
        params = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r} as JSON: {exc}. Fix or remove it.") from exc
    features = params.get("features", list(FEATURES)) if isinstance(params, dict) else None
    if (
        not isinstance(features, list)
        or len(features) != 3
        or sorted(map(str, features)) != sorted(FEATURES)
    ):
        raise ValueError(
            f"{str(path)!r}: 'features' must list the three rows of axis 1 of 'data', a "
            f"permutation of {list(FEATURES)}, got {features!r}. Fix the list or remove the key "
            "to use the default order."
        )
    return tuple(features)  # type: ignore[return-value]


def _check_file(path: Path) -> H5File:
    where = f"GPT HDF5 file {str(path)!r}"
    try:
        return _check_open_file(path, where)
    except (OSError, RuntimeError, KeyError) as exc:
        # h5py's errors on a damaged file (a flipped byte in its metadata).
        raise ValueError(
            f"{where} cannot be read: it is damaged ({type(exc).__name__}: {exc}); {_WRITE_HINT} "
            "again, or copy it again from a good source."
        ) from exc


def _check_open_file(path: Path, where: str) -> H5File:
    h5py = _h5py()
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise ValueError(f"{where} cannot be opened as HDF5 ({exc}); {_WRITE_HINT}.") from exc
    with f:
        if "data" not in f or not isinstance(f["data"], h5py.Dataset):
            raise ValueError(
                f"{where} has no dataset 'data'; each file needs 'data' of shape "
                f"[N, 3, seq] holding {', '.join(FEATURES)} ({_WRITE_HINT})."
            )
        if "n_examples" not in f.attrs:
            raise ValueError(
                f"{where} has no root attribute 'n_examples' (the number of examples in "
                f"'data'); add it, e.g. f.attrs['n_examples'] = len(f['data']), or {_WRITE_HINT}."
            )
        data = f["data"]
        if data.ndim != 3 or data.shape[1] != 3:
            raise ValueError(
                f"{where}: 'data' has shape {tuple(data.shape)}, expected [N, 3, seq] (axis 1 "
                f"holds {', '.join(FEATURES)}); {_WRITE_HINT}."
            )
        if data.dtype.kind not in "iu":
            raise ValueError(
                f"{where}: 'data' has dtype {data.dtype}, expected integer token ids (e.g. "
                "int32); convert it or rewrite the file."
            )
        n = f.attrs["n_examples"]
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 0 <= n <= len(data):
            shown = int(n) if isinstance(n, np.integer) else repr(n)
            raise ValueError(
                f"{where}: attribute n_examples = {shown} must be an integer between 0 and the "
                f"{len(data)} rows of 'data'; set it to the number of examples written."
            )
        return H5File(str(path), int(n), int(data.shape[2]))


def scan_gpt_hdf5_dir(
    data_dir: str | os.PathLike, key: str = "data_dir"
) -> tuple[list[H5File], tuple[str, str, str]]:
    """Check every ``*.h5`` file of ``data_dir`` (sorted by name) and read its feature order.

    ``key`` is how the caller's config names the directory, for the messages.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(
            f"{key} {str(root)!r} is not a directory; point {key} at a directory of GPT HDF5 "
            f"files ({_WRITE_HINT})."
        )
    paths = sorted(p for p in root.glob("*.h5") if p.is_file())
    if not paths:
        raise ValueError(f"{key} {str(root)!r} holds no .h5 files; {_WRITE_HINT}.")
    features = read_features(root)
    files = [_check_file(p) for p in paths]
    first = files[0]
    for f in files[1:]:
        if f.seq_len != first.seq_len:
            raise ValueError(
                f"GPT HDF5 files in {str(root)!r} disagree on the sequence length: "
                f"{first.path!r} has {first.seq_len}, {f.path!r} has {f.seq_len}. Keep one "
                "sequence length per directory."
            )
    return files, features


class _OpenFiles:
    """A few open h5py files, least recently used closed first.

    Owner: one iterator of one worker (h5py handles must not cross a fork, so
    they are opened inside the worker). Bounded because a worker's share may
    be thousands of files, more than the process may hold open.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._files: OrderedDict[str, object] = OrderedDict()

    def data(self, path: str):
        f = self._files.pop(path, None)
        if f is None:
            f = _h5py().File(path, "r", locking=False)
            while len(self._files) >= self.capacity:
                self._files.popitem(last=False)[1].close()
        self._files[path] = f
        return f["data"]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class GptHDF5Dataset(torch.utils.data.IterableDataset):
    """Batches (dicts of int64 [batch_size, seq]) read from this rank's share of GPT HDF5 files.

    Yields whole batches, so wrap it as ``torch.utils.data.DataLoader(ds,
    batch_size=None, num_workers=num_workers)``, with the same ``num_workers``
    as given here; ``len(ds)`` is then the exact number of batches per epoch on
    this rank. Sharding and shuffling: Note [hdf5 sharding]. Iterated outside a
    DataLoader's workers it yields the shares of all ``num_workers`` workers,
    one after the other.

    Note [hdf5 epochs]: the shuffle order of epoch e is drawn from
    (shuffle_seed, e), where e = the epoch given to :meth:`set_epoch` plus the
    passes iterated since. ``weightstream.utils.data.DataLoader`` calls
    set_epoch before each pass; worker processes see it because torch pickles
    the dataset into fresh workers at each pass. Persistent workers keep their
    copy, and advance by counting their own passes instead.
    """

    def __init__(
        self,
        files: Sequence[H5File],
        batch_size: int,
        *,
        features: Sequence[str] = FEATURES,
        shuffle: bool = False,
        shuffle_seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 0,
        rank: int = 0,
        num_ranks: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        assert 0 <= rank < num_ranks and batch_size >= 1 and num_workers >= 0
        self.rank, self.num_ranks = rank, num_ranks
        self.num_workers = num_workers
        self.batch_size = batch_size
        self.shuffle, self.shuffle_seed, self.drop_last = shuffle, shuffle_seed, drop_last
        self.vocab_size = vocab_size
        self.rows = {name: list(features).index(name) for name in FEATURES}
        self.rank_files = list(files)[rank::num_ranks]
        if not self.rank_files:
            raise ValueError(
                f"the data directory has {len(files)} .h5 file(s), fewer than the {num_ranks} "
                f"data-parallel ranks, so rank {rank} would read nothing (files are the unit of "
                "sharding). Write more, smaller files (a smaller examples_per_file) or run "
                "fewer ranks."
            )
        workers = max(1, num_workers)
        if len(self.rank_files) < workers:
            warnings.warn(
                f"rank {rank} has {len(self.rank_files)} .h5 file(s) for {workers} input "
                f"workers; {workers - len(self.rank_files)} worker(s) will be idle (files are "
                "the unit of sharding). Lower num_workers or write more, smaller files.",
                stacklevel=2,
            )
        self.epoch = 0
        self._passes = 0  # passes iterated by this copy since set_epoch; Note [hdf5 epochs]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._passes = 0

    def worker_files(self, worker: int) -> list[H5File]:
        """The files input worker ``worker`` of this rank reads (Note [hdf5 sharding])."""
        return self.rank_files[worker :: max(1, self.num_workers)]

    def _num_batches(self, n_examples: int) -> int:
        if self.drop_last:
            return n_examples // self.batch_size
        return math.ceil(n_examples / self.batch_size)

    def __len__(self) -> int:
        return sum(
            self._num_batches(sum(f.n_examples for f in self.worker_files(w)))
            for w in range(max(1, self.num_workers))
        )

    def _order(self, epoch: int, worker: int) -> tuple[list[H5File], np.ndarray]:
        """The worker's files and its example order as rows of [file index, row in file]."""
        files = self.worker_files(worker)
        index = np.concatenate(
            [np.zeros((0, 2), np.int64)]
            + [
                np.stack([np.full(f.n_examples, i), np.arange(f.n_examples)], 1)
                for i, f in enumerate(files)
            ]
        ).astype(np.int64)
        if self.shuffle:
            rng = np.random.default_rng([self.shuffle_seed, epoch, self.rank, worker])
            index = index[rng.permutation(len(index))]
        return files, index

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch + self._passes
        self._passes += 1
        info = torch.utils.data.get_worker_info()
        if info is None:
            workers = range(max(1, self.num_workers))
        else:
            if info.num_workers != max(1, self.num_workers):
                raise ValueError(
                    f"this GptHDF5Dataset was built for {self.num_workers} input workers but "
                    f"runs in a DataLoader with {info.num_workers}; build both with the same "
                    "num_workers."
                )
            workers = [info.id]
        for worker in workers:
            yield from self._worker_batches(epoch, worker)

    def _worker_batches(self, epoch: int, worker: int) -> Iterator[dict[str, torch.Tensor]]:
        files, index = self._order(epoch, worker)
        stop = self._num_batches(len(index)) * self.batch_size
        handles = _OpenFiles()
        try:
            for start in range(0, min(stop, len(index)), self.batch_size):
                yield self._read_batch(files, index[start : start + self.batch_size], handles)
        finally:
            handles.close()

    def _read_batch(
        self, files: list[H5File], index: np.ndarray, handles: _OpenFiles
    ) -> dict[str, torch.Tensor]:
        examples = np.empty((len(index), 3, files[int(index[0, 0])].seq_len), np.int64)
        for file_i in np.unique(index[:, 0]):
            sel = np.flatnonzero(index[:, 0] == file_i)
            rows = index[sel, 1]
            # h5py reads a list of rows only in increasing order: read sorted, put back.
            order = np.argsort(rows)
            path = files[file_i].path
            try:
                block = handles.data(path)[rows[order].tolist()]
            except (OSError, RuntimeError, KeyError, ValueError) as exc:
                raise ValueError(
                    f"GPT HDF5 file {path!r}: cannot read examples {rows[order].tolist()} "
                    f"({type(exc).__name__}: {exc}); the file is damaged. {_WRITE_HINT} again, "
                    "or copy it again from a good source."
                ) from exc
            examples[sel[order]] = block
            self._check_values(block, files[file_i], rows[order])
        return {name: torch.from_numpy(examples[:, row].copy()) for name, row in self.rows.items()}

    def _check_values(self, block: np.ndarray, file: H5File, rows: np.ndarray) -> None:
        mask = block[:, self.rows["attention_mask"]]
        bad = ~((mask == 0) | (mask == 1)).all(axis=1)
        if bad.any():
            raise ValueError(
                f"GPT HDF5 file {file.path!r}, example {int(rows[bad.argmax()])}: attention_mask "
                "holds values other than 0 and 1. Rewrite the file."
            )
        for name in ("input_ids", "labels"):
            ids = block[:, self.rows[name]]
            high = self.vocab_size if self.vocab_size is not None else np.inf
            bad = ((ids < 0) | (ids >= high)).any(axis=1)
            if bad.any():
                row = int(bad.argmax())
                raise ValueError(
                    f"GPT HDF5 file {file.path!r}, example {int(rows[row])}: {name} holds token "
                    f"id {int(ids[row][(ids[row] < 0) | (ids[row] >= high)][0])}, outside "
                    f"[0, vocab_size={self.vocab_size}). Use the tokenizer the model's "
                    "vocab_size was set for, or raise vocab_size."
                )


# -- writer ---------------------------------------------------------------------------


def _as_bytes(texts_or_corpus: object) -> np.ndarray:
    """A uint8 token array from a corpus array/tensor, bytes, a str, or an iterable of texts."""
    if isinstance(texts_or_corpus, torch.Tensor):
        texts_or_corpus = texts_or_corpus.numpy()
    if isinstance(texts_or_corpus, np.ndarray):
        if texts_or_corpus.ndim != 1 or texts_or_corpus.dtype != np.uint8:
            raise TypeError(
                "a corpus array must be 1-D uint8 (as weightstream.data.corpus.read_corpus "
                f"returns), got {texts_or_corpus.dtype} of shape {texts_or_corpus.shape}."
            )
        return texts_or_corpus
    if isinstance(texts_or_corpus, (bytes, bytearray, str)):
        texts_or_corpus = [texts_or_corpus]
    if not isinstance(texts_or_corpus, Iterable):
        raise TypeError(
            "texts_or_corpus must be a uint8 corpus array, bytes, a str, or an iterable of "
            f"str/bytes texts, got {type(texts_or_corpus).__name__}."
        )
    parts = []
    for i, text in enumerate(texts_or_corpus):
        if isinstance(text, str):
            text = text.encode("utf-8")
        if not isinstance(text, (bytes, bytearray)):
            raise TypeError(f"text {i} is a {type(text).__name__}; give str or bytes texts.")
        parts.append(bytes(text))
    # Texts are joined by a newline, as read_corpus joins files.
    return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


def write_gpt_hdf5(
    output_dir: str | os.PathLike,
    texts_or_corpus: object,
    seq_len: int,
    examples_per_file: int,
    *,
    compression: str | None = None,
    overwrite: bool = False,
    tokenizer=None,
    tokenizer_name: str | None = None,
) -> list[Path]:
    """Tokenize text and write it as GPT HDF5 files; return the paths written.

    Tokens are bytes (a vocabulary of 256) unless ``tokenizer`` (a
    ``tokenizers.Tokenizer``, ``data/tokenize.py``) is given; its vocabulary and
    ``tokenizer_name`` are recorded in ``data_params.json``.

    Example k is the ``seq_len`` bytes starting at byte ``k * seq_len``
    (input_ids), the same window shifted by one byte (labels, so every
    next-byte pair of the text is trained exactly once), and attention_mask
    ones. The tail shorter than ``seq_len + 1`` bytes is dropped. Files are
    ``data-00000.h5``, ... with ``examples_per_file`` examples each (the last
    may hold fewer), int32, plus ``data_params.json`` (features, sizes; the
    reader uses only its ``features``).

    ``texts_or_corpus``: a 1-D uint8 array (``corpus.read_corpus()``), bytes,
    a str (UTF-8 encoded), or an iterable of str/bytes texts (joined by
    newlines). ``compression``: None, "gzip" or "lz4". An ``output_dir`` that
    already holds .h5 files is refused unless ``overwrite``, which deletes
    them. Every argument is checked before anything is written.
    """
    for name, value in (("seq_len", seq_len), ("examples_per_file", examples_per_file)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    if compression not in (None, "gzip", "lz4"):
        raise ValueError(f"compression must be None, 'gzip' or 'lz4', got {compression!r}.")
    vocab, unit = 256, "bytes"
    if tokenizer is not None:
        from weightstream.data.tokenize import encode, vocab_size

        # A list of texts is a list of documents, each encoded on its own.
        many = not isinstance(texts_or_corpus, (np.ndarray, torch.Tensor, bytes, bytearray, str))
        docs = list(texts_or_corpus) if many else [_as_bytes(texts_or_corpus).tobytes()]
        source_bytes = sum(len(d.encode("utf-8") if isinstance(d, str) else d) for d in docs)
        tokens = encode(docs, tokenizer)
        vocab, unit = vocab_size(tokenizer), "tokens"
    else:
        tokens = _as_bytes(texts_or_corpus)
        source_bytes = len(tokens)
    n = (len(tokens) - 1) // seq_len if len(tokens) else 0
    if n < 1:
        raise ValueError(
            f"the text has {len(tokens)} {unit}, too few for one example of seq_len {seq_len} "
            f"(which needs {seq_len + 1}); give more text or a shorter seq_len."
        )
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {str(out)!r} exists and is not a directory.")
    old = sorted(out.glob("*.h5")) if out.is_dir() else []
    if old and not overwrite:
        raise ValueError(
            f"output_dir {str(out)!r} already holds {len(old)} .h5 file(s); the reader would mix "
            "them with the new ones. Choose an empty directory or pass overwrite=True (CLI: "
            "--overwrite) to delete them."
        )

    h5py = _h5py()
    filter_kwargs: dict = {}
    if compression == "gzip":
        filter_kwargs = {"compression": "gzip"}
    elif compression == "lz4":
        import hdf5plugin

        filter_kwargs = dict(hdf5plugin.LZ4())
    out.mkdir(parents=True, exist_ok=True)
    for p in old:
        p.unlink()
    written = []
    offsets = np.arange(seq_len)
    for file_i, first in enumerate(range(0, n, examples_per_file)):
        count = min(examples_per_file, n - first)
        starts = (first + np.arange(count)) * seq_len
        window = starts[:, None] + offsets  # [count, seq_len] byte positions
        data = np.empty((count, 3, seq_len), np.int32)
        rows = {name: i for i, name in enumerate(FEATURES)}
        data[:, rows["input_ids"]] = tokens[window]
        data[:, rows["attention_mask"]] = 1
        data[:, rows["labels"]] = tokens[window + 1]
        path = out / f"data-{file_i:05d}.h5"
        # A crash never leaves a half-written .h5 that the reader would pick up.
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            f.create_dataset("data", data=data, chunks=(1, 3, seq_len), **filter_kwargs)
            f.attrs["n_examples"] = count
        written.append(path)
    params = {
        "features": list(FEATURES),
        "max_seq_length": seq_len,
        "vocab_size": vocab,
        "tokenizer": "bytes" if tokenizer is None else (tokenizer_name or "tokenizers"),
        "n_examples": n,
        "examples_per_file": examples_per_file,
        "n_files": len(written),
        "source_bytes": source_bytes,
    }
    (out / PARAMS_FILE).write_text(json.dumps(params, indent=2) + "\n")
    return written

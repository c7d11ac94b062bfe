"""Data processors: the params file's ``data_processor`` names, each building a DataLoader.

A processor is a function ``(params, is_training) -> torch.utils.data.DataLoader``;
``params`` is the ``train_input`` (``is_training=True``) or ``eval_input`` section
as a dict. Batches are dicts in the formats of ``weightstream.models.registry``:
"lm" batches hold int64 ``input_ids``, ``labels`` and ``attention_mask``
[B, seq]; "classification" batches hold float32 ``inputs`` [B, features] and
int64 ``labels`` [B].

Keys every processor accepts (:data:`COMMON_KEYS`):

- ``batch_size`` (required): the global batch; each of the N data-parallel
  ranks gets ``batch_size / N`` samples per batch, so it must divide by N;
- ``shuffle`` (default: ``is_training``), ``shuffle_seed`` (default 0: a fixed
  seed makes every rank agree on the order and a restarted run replay it);
- ``drop_last`` (default true): drop the last, partial batch of an epoch;
- ``num_workers`` (default 0), ``prefetch_factor``, ``persistent_workers``:
  torch DataLoader worker settings (the last two only mean something with
  ``num_workers > 0``; given without workers they are ignored with a warning);
- ``data_dir``: where the data is (processors that read no files ignore it,
  with a warning);
- ``data_processor``: the processor's own name.

:func:`processor_keys` gives each processor's full key set, for the params
parser to reject unknown keys. Map-style processors order their samples with
:class:`weightstream.data.sampler.DistributedSampler` (one global order,
sharded across ranks, fast restarts); the HDF5 processor shards files
(``weightstream.data.gpt_hdf5``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data
from torch.utils.data import Dataset

from weightstream.common.schema import did_you_mean
from weightstream.data.corpus import VOCAB_SIZE, ByteCorpusDataset, read_texts, text_files
from weightstream.data.gpt_hdf5 import GptHDF5Dataset, scan_gpt_hdf5_dir, write_gpt_hdf5
from weightstream.data.hf_dataset import (
    HF_DATASET_KEY_DOCS,
    HF_DATASET_KEYS,
    build_rows,
    check_eval_split,
    hf_tokenizer_vocab_size,
)
from weightstream.data.sampler import DistributedSampler
from weightstream.data.section import SEQ_KEYS, LoaderSettings, Section, loader_settings
from weightstream.data.tokenize import encode, load_tokenizer, tokenizer_file
from weightstream.data.tokenize import vocab_size as tokenizer_vocab_size

__all__ = [
    "COMMON_KEYS",
    "DATA_PROCESSORS",
    "DataProcessor",
    "check_input_sections",
    "digits_split",
    "get_data_processor",
    "processor_key_docs",
    "processor_keys",
    "write_gpt_hdf5",
]

DataProcessor = Callable[[dict, bool], torch.utils.data.DataLoader]

COMMON_KEYS = frozenset(
    {
        "data_processor",
        "data_dir",
        "batch_size",
        "shuffle",
        "shuffle_seed",
        "drop_last",
        "num_workers",
        "prefetch_factor",
        "persistent_workers",
    }
)

DATA_PROCESSORS: dict[str, DataProcessor] = {}
_KEYS: dict[str, frozenset[str]] = {}


def _register(name: str, keys: frozenset[str]) -> Callable[[DataProcessor], DataProcessor]:
    def add(fn: DataProcessor) -> DataProcessor:
        assert name not in DATA_PROCESSORS, name
        DATA_PROCESSORS[name] = fn
        _KEYS[name] = COMMON_KEYS | keys
        return fn

    return add


def get_data_processor(name: str) -> DataProcessor:
    """The processor registered as ``name``; ValueError naming the valid ones otherwise."""
    if name not in DATA_PROCESSORS:
        hint = did_you_mean(str(name), DATA_PROCESSORS)
        raise ValueError(
            f"unknown data_processor {name!r}.{hint} Valid names: "
            f"{', '.join(sorted(DATA_PROCESSORS))}."
        )
    return DATA_PROCESSORS[name]


def processor_keys(name: str) -> set[str]:
    """The keys the input section may hold for processor ``name`` (common keys included)."""
    get_data_processor(name)  # the error for an unknown name
    return set(_KEYS[name])


# Per processor, its own keys' (default, what it does), for docs/params.md; a processor
# without an entry is listed by key names alone. The defaults are those the processor
# applies ("required": it has none).
_KEY_DOCS: dict[str, dict[str, tuple[object, str]]] = {
    "HFDatasetProcessor": HF_DATASET_KEY_DOCS,
}


def processor_key_docs(name: str) -> dict[str, tuple[object, str]]:
    """``{key: (default, doc)}`` of processor ``name``'s own keys (not COMMON_KEYS), where
    it declares them; {} where it does not."""
    get_data_processor(name)  # the error for an unknown name
    return dict(_KEY_DOCS.get(name, {}))


def check_input_sections(train: dict | None, evals: dict | None) -> None:
    """Checks that need both input sections (each as ``InputParams.to_dict()`` gives it,
    None where absent); for the params parser. HFDatasetProcessor: the same data_dir with
    different eval_fraction is an error (:func:`weightstream.data.hf_dataset.check_eval_split`).
    """
    check_eval_split(train, evals)


def _streamer_position() -> tuple[int, int]:
    """(this rank, number of ranks) among the data-parallel streamers.

    One function so tests can simulate several ranks in one process.
    """
    from weightstream.data.streaming import get_streaming_rank, num_streamers

    return get_streaming_rank(), num_streamers()


def _map_style_loader(
    s: Section, settings: LoaderSettings, dataset: Dataset
) -> torch.utils.data.DataLoader:
    """Batches of ``dataset`` in the DistributedSampler's global order, this rank's share."""
    n, need = len(dataset), settings.batch_size
    if settings.drop_last and n < need:
        raise ValueError(
            f"{s.section}: the {s.processor} data has {n} samples, fewer than one global batch "
            f"({s.where('batch_size')} = {need}), and drop_last is on, so there would be no "
            "batch at all. Lower batch_size, give more data, or set drop_last: false."
        )
    try:
        sampler = DistributedSampler(
            dataset,
            shuffle=settings.shuffle,
            seed=settings.shuffle_seed,
            batch_size=settings.per_rank_batch,
            drop_last=settings.drop_last,
            num_shards=settings.num_ranks,
            shard_index=settings.rank,
            # An evaluation's one pass ends on every rank at once (Note [an uneven last
            # round] in sampler.py).
            even_last_round=s.section == "eval_input",
        )
    except ValueError as exc:
        keys = f"{s.where('drop_last')}, {s.where('batch_size')}"
        raise ValueError(f"{s.section}: {exc} (In the params file: {keys}.)") from None
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **settings.worker_kwargs())


# -- TextCorpusProcessor --------------------------------------------------------------


class _LMWindows(Dataset):
    """ByteCorpusDataset's (input_ids, labels) pairs as lm batch dicts."""

    def __init__(self, windows: ByteCorpusDataset) -> None:
        self.windows = windows

    @property
    def fingerprint(self) -> str:
        return self.windows.fingerprint

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        input_ids, labels = self.windows[i]
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": torch.ones_like(input_ids),
        }


def _text_files(s: Section) -> list[Path] | None:
    """data_dir as a file list: None (standard library), a file, a directory, or a list of those."""
    data_dir = s.params.get("data_dir")
    if data_dir is None:
        return None
    entries = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else data_dir
    if not isinstance(entries, (list, tuple)) or not all(
        isinstance(e, (str, os.PathLike)) for e in entries
    ):
        raise TypeError(
            f"{s.where('data_dir')} must be a path or a list of paths, got {data_dir!r}."
        )
    return text_files(
        entries,
        s.where("data_dir"),
        "give text files or directories of them, or remove data_dir to use the standard "
        "library's source",
    )


# The token ids of the last text encoded in this process, by what they came from:
# the run command builds a section's loader more than once (the compile phase
# times its input, then training reads it; eval reads the same text's tail), and
# a tokenizer takes seconds over the default 8 MiB. One corpus is kept.
_ENCODED: dict[tuple, np.ndarray] = {}


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return os.fspath(path.resolve()), st.st_mtime_ns, st.st_size


def _encoded_corpus(s: Section, tokenizer) -> np.ndarray:
    files = _text_files(s)
    max_bytes = s.int_("max_bytes", 8 * 2**20, minimum=1)
    key = (
        _stamp(tokenizer_file(s.path_("tokenizer"))),
        None if files is None else tuple(_stamp(Path(f)) for f in files),
        max_bytes,
    )
    tokens = _ENCODED.get(key)
    if tokens is None:
        tokens = encode(read_texts(files, max_bytes), tokenizer)
        _ENCODED.clear()
        _ENCODED[key] = tokens
    return tokens


@_register(
    "TextCorpusProcessor",
    SEQ_KEYS | {"vocab_size", "max_bytes", "eval_fraction", "tokenizer"},
)
def text_corpus_processor(params: dict, is_training: bool) -> torch.utils.data.DataLoader:
    """lm batches from text files (default: the Python standard library's source).

    Keys: ``seq_len`` / ``max_sequence_length`` (default 256); ``data_dir``: a
    text file, a directory (every non-hidden file below it) or a list of those;
    ``max_bytes`` of text read (default 8 MiB); ``eval_fraction`` (default 0.05):
    the tail of the text kept for eval_input; ``tokenizer``: a tokenizers
    ``tokenizer.json`` or a Hugging Face folder holding one (default: bytes,
    a vocabulary of 256); ``vocab_size``, if given, must be at least the
    tokenizer's vocabulary.
    """
    s = Section("TextCorpusProcessor", params, is_training, _KEYS["TextCorpusProcessor"])
    settings = loader_settings(s, is_training, *_streamer_position())
    seq_len = s.seq_len(256)
    tokens = None
    vocab = VOCAB_SIZE
    if s.has("tokenizer"):
        tokenizer = load_tokenizer(s.path_("tokenizer"))
        vocab = tokenizer_vocab_size(tokenizer)
        tokens = _encoded_corpus(s, tokenizer)
    if s.has("vocab_size") and s.int_("vocab_size", None, minimum=1) < vocab:
        what = "tokens are bytes, which need" if tokens is None else "the tokenizer has"
        raise ValueError(
            f"{s.where('vocab_size')} = {params['vocab_size']}: {what} a vocabulary of "
            f"{vocab}. Set vocab_size (and the model's) to >= {vocab}."
        )
    windows = ByteCorpusDataset(
        seq_len,
        paths=_text_files(s),
        split="train" if is_training else "eval",
        eval_fraction=s.float_("eval_fraction", 0.05, 0.0, 1.0),
        max_bytes=s.int_("max_bytes", 8 * 2**20, minimum=1),
        tokens=tokens,
    )
    return _map_style_loader(s, settings, _LMWindows(windows))


def data_vocab_size(params: dict) -> int | None:
    """The token ids a section's data can hold (exclusive bound), where it is known.

    TextCorpusProcessor: its tokenizer's vocabulary, or 256 for bytes;
    GptHDF5DataProcessor: its ``vocab_size`` (ids beyond it are refused when read);
    HFDatasetProcessor: its tokenizer's (added tokens included).
    """
    name = params.get("data_processor")
    if name == "HFDatasetProcessor":
        path = params.get("tokenizer")
        return hf_tokenizer_vocab_size(path) if path else None
    if name == "TextCorpusProcessor":
        if params.get("tokenizer"):
            return tokenizer_vocab_size(load_tokenizer(params["tokenizer"]))
        return VOCAB_SIZE
    if name == "GptHDF5DataProcessor":
        value = params.get("vocab_size")
        return int(value) if isinstance(value, int) else None
    return None


# -- HFDatasetProcessor ---------------------------------------------------------------


@_register("HFDatasetProcessor", HF_DATASET_KEYS)
def hf_dataset_processor(params: dict, is_training: bool) -> torch.utils.data.DataLoader:
    """lm batches of fine-tuning data in TRL's formats (text, prompt-completion, messages),
    tokenized with the model's Hugging Face tokenizer and its chat template, labels -100
    outside the completions, optionally packed. Keys and behaviour:
    ``weightstream.data.hf_dataset``.
    """
    s = Section("HFDatasetProcessor", params, is_training, _KEYS["HFDatasetProcessor"])
    settings = loader_settings(s, is_training, *_streamer_position())
    return _map_style_loader(s, settings, build_rows(s, is_training))


# -- GptHDF5DataProcessor -------------------------------------------------------------


@_register("GptHDF5DataProcessor", SEQ_KEYS | {"vocab_size"})
def gpt_hdf5_processor(params: dict, is_training: bool) -> torch.utils.data.DataLoader:
    """lm batches from a directory of GPT HDF5 files (format: ``weightstream.data.gpt_hdf5``).

    Keys: ``data_dir`` (required): the directory of ``*.h5`` files;
    ``seq_len`` / ``max_sequence_length``: if given, must equal the files'
    sequence length; ``vocab_size``: if given, every token id read is checked
    against it. Files are sharded across ranks and input workers (Note [hdf5
    sharding]), so the directory needs at least one file per rank.
    """
    s = Section("GptHDF5DataProcessor", params, is_training, _KEYS["GptHDF5DataProcessor"])
    settings = loader_settings(s, is_training, *_streamer_position())
    if not s.has("data_dir"):
        raise ValueError(
            f"{s.where('data_dir')} is required by GptHDF5DataProcessor: the directory of .h5 "
            "files (write one with `weightstream data write-gpt-hdf5`)."
        )
    data_dir = s.params["data_dir"]
    if not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(f"{s.where('data_dir')} must be a directory path, got {data_dir!r}.")
    files, features = scan_gpt_hdf5_dir(data_dir, key=s.where("data_dir"))
    if any(s.has(k) for k in SEQ_KEYS):
        seq_len = s.seq_len(None)
        if seq_len != files[0].seq_len:
            raise ValueError(
                f"{s.section}: the files in {str(data_dir)!r} hold sequences of "
                f"{files[0].seq_len} tokens, but the section asks for {seq_len}. Set "
                f"max_sequence_length to {files[0].seq_len} or use data of the wanted length."
            )
    vocab_size = s.int_("vocab_size", None, minimum=1) if s.has("vocab_size") else None
    if len(files) < settings.num_ranks:
        raise ValueError(
            f"{s.where('data_dir')} {str(data_dir)!r} has {len(files)} .h5 file(s) for "
            f"{settings.num_ranks} data-parallel ranks; files are the unit of sharding, so each "
            "rank needs at least one. Write more, smaller files (a smaller examples_per_file)."
        )
    dataset = GptHDF5Dataset(
        files,
        settings.per_rank_batch,
        features=features,
        shuffle=settings.shuffle,
        shuffle_seed=settings.shuffle_seed,
        drop_last=settings.drop_last,
        num_workers=settings.num_workers,
        rank=settings.rank,
        num_ranks=settings.num_ranks,
        vocab_size=vocab_size,
    )
    if len(dataset) == 0:
        examples = sum(f.n_examples for f in dataset.rank_files)
        raise ValueError(
            f"{s.section}: rank {settings.rank}'s files in {str(data_dir)!r} hold {examples} "
            f"examples, which make no full batch of {settings.per_rank_batch} per input worker "
            f"({s.where('batch_size')} = {settings.batch_size} over {settings.num_ranks} "
            "rank(s)). Lower batch_size or num_workers, give more data, or set drop_last: false."
        )
    # batch_size=None: the dataset yields whole batches (it reads them per file).
    return torch.utils.data.DataLoader(dataset, batch_size=None, **settings.worker_kwargs())


# -- DigitsProcessor ------------------------------------------------------------------


def digits_split(is_training: bool, eval_fraction: float = 0.2) -> np.ndarray:
    """Indices into scikit-learn's digits (1797 images) of the train or eval split.

    A fixed permutation (seed 0) puts the first ``round(1797 * eval_fraction)``
    images in eval and the rest in train, on every machine and every run.
    """
    n = 1797  # len(load_digits().target), fixed by the bundled file
    order = np.random.default_rng(0).permutation(n)
    n_eval = round(n * eval_fraction)
    return np.sort(order[n_eval:] if is_training else order[:n_eval])


class _Classification(Dataset):
    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        assert len(inputs) == len(labels)
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[i], "labels": self.labels[i]}


@_register("DigitsProcessor", frozenset({"image_size", "eval_fraction"}))
def digits_processor(params: dict, is_training: bool) -> torch.utils.data.DataLoader:
    """Classification batches of scikit-learn's bundled 8x8 digits (no download).

    Pixels are scaled from 0..16 to [0, 1] and flattened. ``image_size`` 8 gives
    64 features; 28 (default) resizes bilinearly (corners aligned, so the four
    corner pixels are the original ones) to 28x28 = 784 features, the input of
    the fc_mnist model. ``eval_fraction`` (default 0.2): see :func:`digits_split`.
    """
    s = Section("DigitsProcessor", params, is_training, _KEYS["DigitsProcessor"])
    settings = loader_settings(s, is_training, *_streamer_position())
    s.ignore("data_dir", "DigitsProcessor reads scikit-learn's bundled copy of the digits")
    image_size = s.int_("image_size", 28, minimum=1)
    if image_size not in (8, 28):
        raise ValueError(
            f"{s.where('image_size')} must be 8 (the digits as bundled) or 28 (resized to "
            f"MNIST's 28x28), got {image_size}."
        )
    eval_fraction = s.float_("eval_fraction", 0.2, 0.0, 1.0)
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "DigitsProcessor reads the digits bundled with scikit-learn; install it with "
            "`pip install scikit-learn`, or use another data_processor."
        ) from exc
    digits = load_digits()
    index = digits_split(is_training, eval_fraction)
    images = torch.from_numpy(digits.images[index]).float().div_(16.0)  # [N, 8, 8]
    if image_size != 8:
        images = F.interpolate(
            images[:, None], size=(image_size, image_size), mode="bilinear", align_corners=True
        )[:, 0]
    inputs = images.reshape(len(index), image_size * image_size).contiguous()
    labels = torch.from_numpy(digits.target[index]).long()
    return _map_style_loader(s, settings, _Classification(inputs, labels))


# -- SyntheticDataProcessor -----------------------------------------------------------


class _SyntheticSamples(Dataset):
    """Sample i drawn from (seed, split, i) alone: the same on every rank, worker and restart."""

    def __init__(self, task: str, num_samples: int, seed: int, split: int, **sizes: int) -> None:
        self.task, self.num_samples, self.seed, self.split = task, num_samples, seed, split
        self.sizes = sizes

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.split, i])
        if self.task == "lm":
            tokens = torch.from_numpy(
                rng.integers(0, self.sizes["vocab_size"], self.sizes["seq_len"] + 1)
            )
            return {
                "input_ids": tokens[:-1],
                "labels": tokens[1:],
                "attention_mask": torch.ones(self.sizes["seq_len"], dtype=torch.int64),
            }
        features = rng.standard_normal(self.sizes["in_features"], dtype=np.float32)
        label = rng.integers(0, self.sizes["num_classes"])
        return {"inputs": torch.from_numpy(features), "labels": torch.tensor(label)}


@_register(
    "SyntheticDataProcessor",
    SEQ_KEYS | {"task", "vocab_size", "in_features", "num_classes", "num_samples", "seed"},
)
def synthetic_processor(params: dict, is_training: bool) -> torch.utils.data.DataLoader:
    """Random lm or classification batches, for smoke tests and throughput runs (nothing to learn).

    Keys: ``task`` ("lm", default, or "classification"); for lm ``seq_len`` /
    ``max_sequence_length`` (default 256) and ``vocab_size`` (default 4096):
    uniform token ids; for classification ``in_features`` (default 784) and
    ``num_classes`` (default 10): standard normal inputs, uniform labels;
    ``num_samples`` per epoch (default 1024); ``seed`` (default 0). train_input
    and eval_input draw different samples from the same seed.
    """
    s = Section("SyntheticDataProcessor", params, is_training, _KEYS["SyntheticDataProcessor"])
    settings = loader_settings(s, is_training, *_streamer_position())
    s.ignore("data_dir", "SyntheticDataProcessor generates its data")
    task = s.choice("task", "lm", ("lm", "classification"))
    if task == "lm":
        for key in ("in_features", "num_classes"):
            s.ignore(key, "it applies to task 'classification'")
        sizes = {"seq_len": s.seq_len(256), "vocab_size": s.int_("vocab_size", 4096, minimum=1)}
    else:
        for key in sorted(SEQ_KEYS | {"vocab_size"}):
            s.ignore(key, "it applies to task 'lm'")
        sizes = {
            "in_features": s.int_("in_features", 784, minimum=1),
            "num_classes": s.int_("num_classes", 10, minimum=2),
        }
    dataset = _SyntheticSamples(
        task,
        num_samples=s.int_("num_samples", 1024, minimum=1),
        seed=s.int_("seed", 0, minimum=0),
        split=0 if is_training else 1,
        **sizes,
    )
    return _map_style_loader(s, settings, dataset)

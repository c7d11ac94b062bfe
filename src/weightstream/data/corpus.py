"""A byte-level text corpus read from files on disk.

By default the corpus is the source of the running Python's standard library:
real text that is present on every machine with Python, so the main job and the
tests need no download. Tokens are bytes (vocabulary 256); sample ``i`` is the
window of ``seq_len + 1`` bytes starting at a fixed pseudo-random offset,
returned as (input_ids, labels) shifted by one.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256


def stdlib_source_files() -> list[Path]:
    """The .py files of the running Python's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def text_files(entries: Sequence[str | os.PathLike], where: str, fix: str) -> list[Path]:
    """The files ``entries`` name: a file, or every regular, non-hidden file below a directory.

    In a stable order (a directory's files sorted). ``where`` names the setting
    and ``fix`` says what to give instead, for the errors.
    """
    files: list[Path] = []
    for entry in map(Path, entries):
        if entry.is_dir():
            files += sorted(
                p
                for p in entry.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(entry).parts)
            )
        elif entry.is_file():
            files.append(entry)
        else:
            raise ValueError(f"{where}: {str(entry)!r} does not exist; {fix}.")
    if not files:
        raise ValueError(f"{where} ({', '.join(map(str, entries))}) names no files; {fix}.")
    return files


def read_texts(
    paths: Sequence[str | os.PathLike] | None = None, max_bytes: int = 8 * 2**20
) -> list[bytes]:
    """The files' contents (default: the standard library), ``max_bytes`` of them in all."""
    files = [Path(p) for p in paths] if paths else stdlib_source_files()
    if not files:
        raise ValueError("the text corpus is empty: no files were given or found.")
    chunks, total = [], 0
    for f in files:
        if f.is_dir():
            raise ValueError(f"corpus path {str(f)!r} is a directory; list the files in it.")
        try:
            data = f.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read corpus file {str(f)!r}: {exc}") from exc
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return chunks


def read_corpus(
    paths: Sequence[str | os.PathLike] | None = None, max_bytes: int = 8 * 2**20
) -> np.ndarray:
    """Concatenate the files (default: the standard library) into one uint8 array."""
    return np.frombuffer(b"\n".join(read_texts(paths, max_bytes)), dtype=np.uint8).copy()


class ByteCorpusDataset(Dataset):
    """Windows of a token corpus: sample -> (input_ids [seq_len], labels [seq_len]).

    The tokens are the corpus's bytes, or ``tokens`` when given (ids from a
    tokenizer, ``data/tokenize.py``).
    """

    def __init__(
        self,
        seq_len: int,
        paths: Sequence[str | os.PathLike] | None = None,
        split: str = "train",
        eval_fraction: float = 0.05,
        max_bytes: int = 8 * 2**20,
        seed: int = 0,
        tokens: np.ndarray | None = None,
    ):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
        data = read_corpus(paths, max_bytes) if tokens is None else tokens
        cut = int(len(data) * (1.0 - eval_fraction))
        self.data = torch.from_numpy(data[:cut] if split == "train" else data[cut:])
        self.seq_len = seq_len
        unit = "bytes" if tokens is None else "tokens"
        if len(self.data) <= seq_len + 1:
            raise ValueError(
                f"the {split} corpus has {len(self.data)} {unit}, fewer than seq_len + 2 = "
                f"{seq_len + 2}; give more text or a shorter seq_len."
            )
        n_windows = len(self.data) - seq_len - 1
        self.num_samples = max(1, len(self.data) // (seq_len + 1))
        rng = np.random.default_rng(seed)
        self.offsets = torch.from_numpy(rng.integers(0, n_windows, size=self.num_samples))
        # What a resume compares (data_fingerprint in sampler.py): this split's tokens
        # and what cuts them into samples. Hashing 8 MiB takes about 10 ms.
        digest = hashlib.blake2b(self.data.numpy().tobytes(), digest_size=12)
        digest.update(repr((str(self.data.dtype), seq_len, seed)).encode())
        self.fingerprint = digest.hexdigest()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        start = int(self.offsets[i])
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]

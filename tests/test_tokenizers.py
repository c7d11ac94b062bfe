"""Tokenized text: a tokenizer trained here with the `tokenizers` library feeds the text
processors, the GPT HDF5 writer and the run command, and its ids are the library's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import params_files as pf
import pytest
from local_tokenizer import train_bpe

from weightstream.data.corpus import read_texts
from weightstream.data.processors import get_data_processor

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE of VOCAB ids, trained on the standard library's text."""
    return train_bpe(tmp_path_factory.mktemp("tok"), VOCAB)


def _docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(read_texts(max_bytes=200_000)[:6]):
        (folder / f"doc{i}.py").write_bytes(text)
    return folder


def _library_ids(tokenizer_file: Path, folder: Path) -> np.ndarray:
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    ids = []
    for f in sorted(folder.iterdir()):
        text = f.read_bytes().decode("utf-8", errors="replace")
        ids += tok.encode(text, add_special_tokens=False).ids
    return np.asarray(ids)


def test_text_processor_windows_are_the_tokenizers_ids(tmp_path, tokenizer_file):
    folder = _docs(tmp_path)
    ids = _library_ids(tokenizer_file, folder)
    section = pf.text_input(2, 32, shuffle=False, data_dir=str(folder))
    section["tokenizer"] = str(tokenizer_file.parent)  # a folder holding tokenizer.json
    section["vocab_size"] = VOCAB
    loader = get_data_processor("TextCorpusProcessor")(section, True)
    batch = next(iter(loader))
    assert batch["input_ids"].max() < VOCAB and batch["input_ids"].max() >= 256
    for row, label in zip(batch["input_ids"], batch["labels"]):
        start = _find(ids, row.numpy())
        assert start is not None, "a window that is not a run of the library's ids"
        assert np.array_equal(label.numpy(), ids[start + 1 : start + 33])


def test_a_text_is_encoded_once_per_process_until_it_changes(tmp_path, tokenizer_file, monkeypatch):
    """The run command builds a section's loader more than once (the compile phase times
    its input) and eval reads the same text: one encoding serves them all, and an
    edited text file is encoded again."""
    make = get_data_processor("TextCorpusProcessor")
    # Counted in the module the processor runs in (another test re-imports the module).
    library_encode = make.__globals__["encode"]
    calls = []

    def encode(texts, tokenizer):
        calls.append(len(texts))
        return library_encode(texts, tokenizer)

    monkeypatch.setitem(make.__globals__, "encode", encode)
    folder = _docs(tmp_path)
    section = pf.text_input(2, 32, shuffle=False, data_dir=str(folder))
    section["tokenizer"] = str(tokenizer_file)
    section["vocab_size"] = VOCAB
    batches = [next(iter(make(section, True)))["input_ids"] for _ in range(2)]
    assert len(calls) == 1 and batches[0].equal(batches[1])
    next(iter(make(section, False)))  # eval: the tail of the same text
    assert len(calls) == 1
    (folder / "doc0.py").write_text("print('an edited file')\n" * 2000)
    edited = next(iter(make(section, True)))["input_ids"]
    assert len(calls) == 2
    ids = _library_ids(tokenizer_file, folder)
    assert all(_find(ids, row.numpy()) is not None for row in edited)


def _find(haystack: np.ndarray, needle: np.ndarray) -> int | None:
    for i in np.flatnonzero(haystack == needle[0]):
        if np.array_equal(haystack[i : i + len(needle)], needle):
            return int(i)
    return None


def test_write_gpt_hdf5_with_a_tokenizer_writes_the_tokenizers_ids(tmp_path, tokenizer_file):
    folder = _docs(tmp_path)
    ids = _library_ids(tokenizer_file, folder)
    out = tmp_path / "h5"
    cmd = [sys.executable, "-m", "weightstream", "data", "write-gpt-hdf5", "-o", str(out),
           "--input", *map(str, sorted(folder.iterdir())), "--seq_len", "16",
           "--tokenizer", str(tokenizer_file)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    params = json.loads((out / "data_params.json").read_text())
    assert params["vocab_size"] == VOCAB
    with h5py.File(out / "data-00000.h5", "r") as f:
        data = f["data"][:]
    assert np.array_equal(data[0, 0], ids[:16]) and np.array_equal(data[0, 2], ids[1:17])
    assert np.array_equal(data[1, 0], ids[16:32])


def test_run_refuses_data_beyond_the_models_vocabulary_before_step_1(tmp_path, tokenizer_file):
    section = pf.text_input(2, 16, tokenizer=str(tokenizer_file))
    del section["vocab_size"]
    values = pf.params(
        train_input=section,
        model=pf.gpt2(1, 16, 16),  # a vocabulary of 256 < the tokenizer's 300
        optimizer=pf.adamw(1e-3),
        runconfig={"max_steps": 1},
    )
    params = pf.write(tmp_path / "p.yaml", values)
    cmd = [sys.executable, "-m", "weightstream", "run", "CPU", "-p", str(params),
           "-o", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert f"the tokenizer {str(tokenizer_file)!r} gives token ids up to 299" in done.stdout
    assert "vocab_size is 256" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "run").exists()  # nothing written

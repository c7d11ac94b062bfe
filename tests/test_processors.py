"""Data processors: batch formats, the GPT HDF5 format (writer, reader, sharding, errors), digits.

References are independent of the code under test: the HDF5 round trip is
checked against the corpus bytes and against h5py reading the files directly;
sharding against the set of example ids written; digits against scikit-learn's
arrays.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from weightstream.data import processors
from weightstream.data.corpus import read_corpus
from weightstream.data.hdf5_writer_cli import main as writer_main
from weightstream.data.processors import (
    COMMON_KEYS,
    DATA_PROCESSORS,
    digits_split,
    get_data_processor,
    processor_keys,
    write_gpt_hdf5,
)
from weightstream.utils.data import DataLoader

TEXT = (
    b"def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 40
    + bytes(range(32, 127)) * 3
    + "caf\u00e9 \u2603\n".encode()
)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text" / "a.txt"
    path.parent.mkdir()
    path.write_bytes(TEXT)
    return path


def load(name: str, is_training: bool = True, **params):
    return get_data_processor(name)(params, is_training)


def simulate_rank(monkeypatch, rank: int, num_ranks: int) -> None:
    monkeypatch.setattr(processors, "_streamer_position", lambda: (rank, num_ranks))


def write_id_files(directory: Path, sizes: list[int], seq: int = 4) -> list[int]:
    """Files whose example ids (input_ids[:, 0]) number the examples globally; returns the ids."""
    directory.mkdir(parents=True, exist_ok=True)
    next_id = 0
    for i, n in enumerate(sizes):
        data = np.zeros((n, 3, seq), np.int32)
        data[:, 0, 0] = np.arange(next_id, next_id + n)
        data[:, 1] = 1
        with h5py.File(directory / f"part-{i:03d}.h5", "w") as f:
            f.create_dataset("data", data=data)
            f.attrs["n_examples"] = n
        next_id += n
    return list(range(next_id))


# -- registry ------------------------------------------------------------------------


def test_registry_names_and_keys():
    assert set(DATA_PROCESSORS) == {
        "TextCorpusProcessor",
        "GptHDF5DataProcessor",
        "DigitsProcessor",
        "SyntheticDataProcessor",
        "HFDatasetProcessor",
    }
    for name in DATA_PROCESSORS:
        assert get_data_processor(name) is DATA_PROCESSORS[name]
        assert COMMON_KEYS <= processor_keys(name)
    assert {"max_sequence_length", "vocab_size"} <= processor_keys("GptHDF5DataProcessor")
    assert "image_size" in processor_keys("DigitsProcessor")
    assert {"task", "num_samples", "in_features"} <= processor_keys("SyntheticDataProcessor")
    assert {"tokenizer", "format", "packing", "seq_len"} <= processor_keys("HFDatasetProcessor")


def test_unknown_processor_lists_valid_names_and_close_matches():
    with pytest.raises(ValueError) as info:
        get_data_processor("GptHDF5Processor")
    message = str(info.value)
    assert "Did you mean 'GptHDF5DataProcessor'" in message
    assert all(name in message for name in DATA_PROCESSORS)
    with pytest.raises(ValueError, match=r"Valid names"):
        processor_keys("nope")


def test_unknown_key_is_refused_with_close_match():
    with pytest.raises(ValueError) as info:
        load("SyntheticDataProcessor", False, batch_size=2, num_sample=4)
    assert "eval_input.num_sample" in str(info.value)
    assert "'num_samples'" in str(info.value)


# -- batch formats --------------------------------------------------------------------

LM_CASES = {
    "TextCorpusProcessor": dict(seq_len=16, max_bytes=50_000),
    "SyntheticDataProcessor": dict(seq_len=16, vocab_size=50, num_samples=24),
}


@pytest.mark.parametrize("name", sorted(LM_CASES))
@pytest.mark.parametrize("is_training", [True, False])
def test_lm_batches(name, is_training):
    dl = load(name, is_training, batch_size=4, **LM_CASES[name])
    batch = next(iter(dl))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    for key in batch:
        assert batch[key].shape == (4, 16) and batch[key].dtype == torch.int64, key
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert torch.all(batch["attention_mask"] == 1)
    assert 0 <= batch["input_ids"].min() and batch["input_ids"].max() < 256


def test_gpt_hdf5_batches(tmp_path):
    write_gpt_hdf5(tmp_path, TEXT, seq_len=16, examples_per_file=20)
    batch = next(iter(load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=4)))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    for key in batch:
        assert batch[key].shape == (4, 16) and batch[key].dtype == torch.int64, key
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


@pytest.mark.parametrize(
    "name, params, features",
    [
        ("DigitsProcessor", dict(image_size=8), 64),
        ("DigitsProcessor", dict(), 784),
        ("SyntheticDataProcessor", dict(task="classification", num_samples=20), 784),
        (
            "SyntheticDataProcessor",
            dict(task="classification", in_features=7, num_classes=3, num_samples=20),
            7,
        ),
    ],
)
def test_classification_batches(name, params, features):
    batch = next(iter(load(name, batch_size=5, **params)))
    assert set(batch) == {"inputs", "labels"}
    assert batch["inputs"].shape == (5, features) and batch["inputs"].dtype == torch.float32
    assert batch["labels"].shape == (5,) and batch["labels"].dtype == torch.int64
    assert 0 <= batch["labels"].min() and batch["labels"].max() < params.get("num_classes", 10)


# -- TextCorpusProcessor --------------------------------------------------------------


def test_text_corpus_windows_come_from_the_given_files(text_file):
    for data_dir in (str(text_file), str(text_file.parent), [str(text_file)]):
        dl = load("TextCorpusProcessor", data_dir=data_dir, batch_size=2, max_sequence_length=8)
        for batch in dl:
            for row, label in zip(batch["input_ids"], batch["labels"]):
                window = bytes(row.tolist()) + bytes(label[-1:].tolist())
                assert window in TEXT


def test_text_corpus_errors(tmp_path, text_file):
    with pytest.raises(ValueError, match=r"train_input.data_dir: .*missing.txt' does not exist"):
        load("TextCorpusProcessor", data_dir=str(tmp_path / "missing.txt"), batch_size=2)
    with pytest.raises(ValueError, match=r"train_input.vocab_size = 100: tokens are bytes"):
        load("TextCorpusProcessor", data_dir=str(text_file), batch_size=2, vocab_size=100)
    with pytest.raises(ValueError, match=r"same setting with different values"):
        load("TextCorpusProcessor", batch_size=2, seq_len=8, max_sequence_length=16)


# -- GPT HDF5: writer and reader -------------------------------------------------------


def test_writer_reader_round_trip_equals_the_corpus(tmp_path):
    corpus = read_corpus(max_bytes=30_000)  # the standard library's source
    seq, per_file = 64, 100
    paths = write_gpt_hdf5(tmp_path, corpus, seq_len=seq, examples_per_file=per_file)
    n = (len(corpus) - 1) // seq
    assert [p.name for p in paths] == [f"data-{i:05d}.h5" for i in range(-(-n // per_file))]

    # The files, read with h5py alone: the documented format.
    rows = []
    for p in paths:
        with h5py.File(p, "r") as f:
            data = f["data"][...]
            assert data.ndim == 3 and data.shape[1:] == (3, seq) and data.dtype == np.int32
            assert f.attrs["n_examples"] == len(data)
            rows.append(data)
    data = np.concatenate(rows)
    assert len(data) == n
    assert bytes(data[:, 0].reshape(-1).astype(np.uint8)) == corpus[: n * seq].tobytes()
    assert bytes(data[:, 2].reshape(-1).astype(np.uint8)) == corpus[1 : n * seq + 1].tobytes()
    assert np.all(data[:, 1] == 1)
    params = json.loads((tmp_path / "data_params.json").read_text())
    assert params["features"] == ["input_ids", "attention_mask", "labels"]

    # The reader, unshuffled, gives the same bytes in order.
    dl = load(
        "GptHDF5DataProcessor",
        False,
        data_dir=str(tmp_path),
        batch_size=7,
        drop_last=False,
        vocab_size=256,
    )
    batches = list(dl)
    assert len(batches) == len(dl) == -(-n // 7)
    ids = torch.cat([b["input_ids"] for b in batches]).reshape(-1)
    labels = torch.cat([b["labels"] for b in batches]).reshape(-1)
    assert bytes(ids.to(torch.uint8).tolist()) == corpus[: n * seq].tobytes()
    assert bytes(labels.to(torch.uint8).tolist()) == corpus[1 : n * seq + 1].tobytes()


@pytest.mark.parametrize("compression", ["gzip", "lz4"])
def test_writer_texts_and_compression(tmp_path, compression):
    texts = ["first text", "second, caf\u00e9"]
    write_gpt_hdf5(tmp_path, texts, seq_len=5, examples_per_file=2, compression=compression)
    dl = load("GptHDF5DataProcessor", False, data_dir=str(tmp_path), batch_size=1, drop_last=False)
    ids = torch.cat([b["input_ids"].reshape(-1) for b in dl])
    joined = "\n".join(texts).encode()
    assert bytes(ids.to(torch.uint8).tolist()) == joined[: len(ids)]
    assert len(ids) == (len(joined) - 1) // 5 * 5


def test_writer_refuses_bad_input_and_changes_nothing(tmp_path):
    write_gpt_hdf5(tmp_path, TEXT, seq_len=16, examples_per_file=50)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"already holds .* overwrite"):
        write_gpt_hdf5(tmp_path, TEXT, seq_len=8, examples_per_file=50)
    with pytest.raises(ValueError, match=r"too few for one example"):
        write_gpt_hdf5(tmp_path / "new", b"abc", seq_len=8, examples_per_file=50)
    with pytest.raises(ValueError, match=r"examples_per_file must be an int >= 1"):
        write_gpt_hdf5(tmp_path, TEXT, seq_len=8, examples_per_file=0, overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert not (tmp_path / "new").exists()
    # overwrite replaces the old files instead of mixing with them.
    write_gpt_hdf5(tmp_path, TEXT, seq_len=8, examples_per_file=1000, overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == ["data-00000.h5"]


def test_writer_cli(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    args = ["-o", str(out), "--input", str(text_file.parent), "--seq_len", "32"]
    assert writer_main([*args, "--examples_per_file", "10"]) == 0
    n = (len(TEXT) - 1) // 32
    assert f"wrote {n} examples" in capsys.readouterr().out
    assert len(list(out.glob("*.h5"))) == -(-n // 10)
    assert writer_main(args) == 2  # the directory already holds files
    assert "--overwrite" in capsys.readouterr().err
    assert writer_main([*args, "--overwrite"]) == 0
    assert len(list(out.glob("*.h5"))) == 1


def test_data_params_json_renames_the_rows(tmp_path):
    data = np.zeros((2, 3, 4), np.int32)
    data[:, 0] = 7  # labels
    data[:, 1] = [[1, 2, 3, 4], [5, 6, 7, 8]]  # input_ids
    data[:, 2] = 1  # attention_mask
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.create_dataset("data", data=data)
        f.attrs["n_examples"] = 2
    (tmp_path / "data_params.json").write_text(
        json.dumps({"features": ["labels", "input_ids", "attention_mask"], "other": 1})
    )
    batch = next(iter(load("GptHDF5DataProcessor", False, data_dir=str(tmp_path), batch_size=2)))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert torch.all(batch["labels"] == 7) and torch.all(batch["attention_mask"] == 1)


# -- GPT HDF5: sharding ---------------------------------------------------------------


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["input_ids"][:, 0]]


def test_sharding_over_two_ranks_and_two_workers_covers_every_example_once(tmp_path, monkeypatch):
    all_ids = write_id_files(tmp_path, sizes=[5, 3, 4, 6, 2, 5, 3])
    params = dict(data_dir=str(tmp_path), batch_size=4, num_workers=2, drop_last=False)
    seen, files_of_rank = [], []
    for rank in (0, 1):
        simulate_rank(monkeypatch, rank, 2)
        dl = load("GptHDF5DataProcessor", **params)  # shuffle: the training default
        batches = list(dl)
        assert len(batches) == len(dl)
        assert all(len(b["input_ids"]) <= 2 for b in batches)  # per-rank share of batch_size
        ids = _ids(batches)
        seen += ids
        files_of_rank.append(
            {int(np.searchsorted(np.cumsum([5, 3, 4, 6, 2, 5, 3]), i, "right")) for i in ids}
        )
    assert sorted(seen) == all_ids
    # Whole files go to ranks: file j to rank j % 2.
    assert files_of_rank == [{0, 2, 4, 6}, {1, 3, 5}]


def test_shuffle_is_seeded_and_changes_with_the_epoch(tmp_path):
    write_id_files(tmp_path, sizes=[6, 6])
    params = dict(data_dir=str(tmp_path), batch_size=3, shuffle=True, shuffle_seed=5)
    first = load("GptHDF5DataProcessor", **params)
    epoch0 = _ids(first)
    assert epoch0 == _ids(load("GptHDF5DataProcessor", **params))
    assert epoch0 != _ids(load("GptHDF5DataProcessor", **{**params, "shuffle_seed": 6}))
    epoch1 = _ids(first)  # a second pass of the same loader: the next epoch
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1
    first.dataset.set_epoch(0)
    assert _ids(first) == epoch0
    assert _ids(load("GptHDF5DataProcessor", False, **{**params, "shuffle": False})) == list(
        range(12)
    )


def test_persistent_workers_see_the_same_epochs(tmp_path):
    # Note [hdf5 epochs]: persistent workers never see set_epoch, they count passes.
    write_id_files(tmp_path, sizes=[6, 6, 6, 6])
    params = dict(data_dir=str(tmp_path), batch_size=3, num_workers=2)
    persistent = load("GptHDF5DataProcessor", **params, persistent_workers=True)
    fresh = load("GptHDF5DataProcessor", **params)
    for epoch in range(2):
        fresh.dataset.set_epoch(epoch)
        assert _ids(persistent) == _ids(fresh)


def _loader_run(name: str, params: dict, max_steps: int, take, state=None, stop=None):
    """The batches (``take`` of each) a DataLoader of processor ``name`` yields, from
    ``state`` if given, ``stop`` of them at most; and its state after them."""
    dl = DataLoader(get_data_processor(name), params, True, max_steps=max_steps)
    if state is not None:
        dl.load_state_dict(state)
    out = []
    for batch in dl:
        out.append(take(batch))
        if len(out) == stop:
            break
    return out, dl.state_dict()


def test_hdf5_loader_resumes_exactly(tmp_path):
    write_id_files(tmp_path, sizes=[5, 4])
    params = dict(data_dir=str(tmp_path), batch_size=2)  # 4 batches per epoch

    def run(state=None, stop=None):
        return _loader_run("GptHDF5DataProcessor", params, 7, lambda b: _ids([b]), state, stop)

    full, _ = run()
    for stop in (3, 5):  # within the first epoch, and within the second
        head, state = run(stop=stop)
        tail, _ = run(state=state)
        assert head + tail == full


def test_text_corpus_resume_refuses_text_edited_in_place(tmp_path):
    text = tmp_path / "corpus.txt"
    words = [f"word{i % 97} " for i in range(3000)]
    text.write_text("".join(words))
    params = dict(data_dir=str(text), batch_size=2, seq_len=32, shuffle=True)

    def run(state=None, stop=None):
        take = lambda b: b["input_ids"].clone()  # noqa: E731
        return _loader_run("TextCorpusProcessor", params, 6, take, state, stop)

    full, _ = run()
    head, state = run(stop=2)
    tail, _ = run(state=state)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))
    words[100] = "WORD" + words[100][4:]  # the same length: the same number of samples
    text.write_text("".join(words))
    with pytest.raises(ValueError, match=r"data fingerprint: saved .*read the same data"):
        run(state=state)


def test_a_datasets_dataset_is_compared_by_its_own_fingerprint(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from weightstream.data.sampler import DistributedSampler

    data = datasets.Dataset.from_dict({"x": list(range(16))})
    edited = data.map(lambda row: {"x": row["x"] + (row["x"] == 3)})
    same = datasets.Dataset.from_dict({"x": list(range(16))})
    fingerprints = [DistributedSampler(d, shard=False).data_fingerprint for d in (data, edited)]
    assert fingerprints[0] == data._fingerprint != fingerprints[1]
    assert DistributedSampler(same, shard=False).data_fingerprint == fingerprints[0]


# -- GPT HDF5: errors -----------------------------------------------------------------


def _write(path: Path, data=None, n_examples=None, dataset="data") -> Path:
    with h5py.File(path, "w") as f:
        if data is not None:
            f.create_dataset(dataset, data=data)
        if n_examples is not None:
            f.attrs["n_examples"] = n_examples
    return path


GOOD = np.ones((2, 3, 4), np.int32)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: _write(p, GOOD, 2, dataset="tokens"), ["no dataset 'data'"]),
        (lambda p: _write(p, GOOD), ["no root attribute 'n_examples'"]),
        (lambda p: _write(p, np.ones((2, 4), np.int32), 2), ["shape (2, 4)", "[N, 3, seq]"]),
        (lambda p: _write(p, np.ones((2, 2, 4), np.int32), 2), ["shape (2, 2, 4)"]),
        (lambda p: _write(p, GOOD.astype(np.float32), 2), ["dtype float32", "integer"]),
        (lambda p: _write(p, GOOD, 3), ["n_examples = 3", "2 rows"]),
        (lambda p: p.write_text("not hdf5"), ["cannot be opened as HDF5"]),
    ],
    ids=["no_data", "no_n_examples", "rank2", "two_rows", "float", "n_too_big", "not_hdf5"],
)
def test_bad_file_errors_name_the_file(tmp_path, make, words):
    _write(tmp_path / "a_good.h5", GOOD, 2)
    bad = tmp_path / "b_bad.h5"
    make(bad)
    with pytest.raises(ValueError) as info:
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=2)
    message = str(info.value)
    assert str(bad) in message
    for word in words:
        assert word in message


def test_directory_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"train_input.data_dir '.*' holds no .h5 files"):
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=2)
    with pytest.raises(ValueError, match=r"train_input.data_dir '.*nope' is not a directory"):
        load("GptHDF5DataProcessor", data_dir=str(tmp_path / "nope"), batch_size=2)
    with pytest.raises(ValueError, match=r"train_input.data_dir is required"):
        load("GptHDF5DataProcessor", batch_size=2)

    _write(tmp_path / "a.h5", GOOD, 2)
    _write(tmp_path / "b.h5", np.ones((2, 3, 5), np.int32), 2)
    with pytest.raises(ValueError) as info:
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=2)
    assert "a.h5" in str(info.value) and "b.h5" in str(info.value)
    (tmp_path / "b.h5").unlink()

    with pytest.raises(ValueError, match=r"hold sequences of 4 tokens, but the section asks for 8"):
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=2, max_sequence_length=8)
    with pytest.raises(ValueError, match=r"hold 2 examples, which make no full batch of 4"):
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=4)
    simulate_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match=r"1 .h5 file.* for 2 data-parallel ranks"):
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=2)

    (tmp_path / "data_params.json").write_text('{"features": ["input_ids", "labels"]}')
    simulate_rank(monkeypatch, 0, 1)
    with pytest.raises(ValueError, match=r"data_params.json'.*permutation"):
        load("GptHDF5DataProcessor", data_dir=str(tmp_path), batch_size=2)


def test_token_ids_outside_the_vocabulary_name_file_and_example(tmp_path):
    data = np.ones((3, 3, 4), np.int32)
    data[2, 0, 1] = 300
    path = _write(tmp_path / "x.h5", data, 3)
    dl = load("GptHDF5DataProcessor", False, data_dir=str(tmp_path), batch_size=3, vocab_size=256)
    with pytest.raises(ValueError) as info:
        next(iter(dl))
    assert str(path) in str(info.value) and "example 2" in str(info.value)
    assert "token id 300" in str(info.value)


# -- DigitsProcessor ------------------------------------------------------------------


def test_digits_match_scikit_learn():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    train, evals = digits_split(True), digits_split(False)
    assert sorted(np.concatenate([train, evals]).tolist()) == list(range(len(y)))
    assert len(evals) == round(len(y) * 0.2)
    for is_training, index in ((True, train), (False, evals)):
        dl = load(
            "DigitsProcessor",
            is_training,
            batch_size=64,
            image_size=8,
            shuffle=False,
            drop_last=False,
        )
        batches = list(dl)
        labels = torch.cat([b["labels"] for b in batches])
        inputs = torch.cat([b["inputs"] for b in batches])
        assert labels.tolist() == y[index].tolist()
        torch.testing.assert_close(inputs, torch.from_numpy(x[index] / 16.0).float())


def test_digits_upsampled_keeps_corner_pixels():
    from sklearn.datasets import load_digits

    images = load_digits().images[digits_split(True)] / 16.0
    batch = next(iter(load("DigitsProcessor", batch_size=4, shuffle=False)))
    up = batch["inputs"].reshape(4, 28, 28)
    for (r, c), (R, C) in zip(
        [(0, 0), (0, 7), (7, 0), (7, 7)], [(0, 0), (0, 27), (27, 0), (27, 27)]
    ):
        torch.testing.assert_close(up[:, R, C], torch.from_numpy(images[:4, r, c]).float())
    with pytest.raises(ValueError, match=r"train_input.image_size must be 8 .* or 28"):
        load("DigitsProcessor", batch_size=4, image_size=16)


# -- SyntheticDataProcessor and the common keys ---------------------------------------


def test_synthetic_is_seeded_and_splits_differ():
    params = dict(batch_size=4, num_samples=8, seq_len=6, vocab_size=20, shuffle=False)
    a = list(load("SyntheticDataProcessor", **params))
    b = list(load("SyntheticDataProcessor", **params))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    other_seed = next(iter(load("SyntheticDataProcessor", **params, seed=1)))
    evals = next(iter(load("SyntheticDataProcessor", False, **params)))
    assert not torch.equal(a[0]["input_ids"], other_seed["input_ids"])
    assert not torch.equal(a[0]["input_ids"], evals["input_ids"])
    assert len(a) == 2 and int(a[0]["input_ids"].max()) < 20


def test_global_batch_is_split_across_ranks(monkeypatch):
    simulate_rank(monkeypatch, 1, 2)
    batch = next(iter(load("SyntheticDataProcessor", batch_size=6, num_samples=12)))
    assert batch["input_ids"].shape[0] == 3
    with pytest.raises(ValueError, match=r"train_input.batch_size = 5 .* 2 data-parallel ranks"):
        load("SyntheticDataProcessor", batch_size=5)


def test_map_style_ranks_partition_the_samples(monkeypatch):
    seen = []
    for rank in (0, 1):
        simulate_rank(monkeypatch, rank, 2)
        dl = load("DigitsProcessor", False, batch_size=8, image_size=8, drop_last=False)
        seen += torch.cat([b["inputs"] for b in dl]).sum(1).tolist()
    simulate_rank(monkeypatch, 0, 1)
    whole = load("DigitsProcessor", False, batch_size=8, image_size=8, drop_last=False)
    assert sorted(seen) == sorted(torch.cat([b["inputs"] for b in whole]).sum(1).tolist())


def test_common_key_checks():
    # null means "default", as the params parser writes unset keys.
    dl = load(
        "SyntheticDataProcessor",
        batch_size=2,
        num_samples=4,
        shuffle=None,
        shuffle_seed=None,
        prefetch_factor=None,
        data_dir=None,
    )
    assert len(dl) == 2
    with pytest.raises(ValueError, match=r"train_input.batch_size is required"):
        load("SyntheticDataProcessor")
    with pytest.raises(TypeError, match=r"train_input.shuffle must be true or false"):
        load("SyntheticDataProcessor", batch_size=2, shuffle="yes")
    with pytest.raises(ValueError, match=r"train_input.num_workers must be >= 0"):
        load("SyntheticDataProcessor", batch_size=2, num_workers=-1)
    with pytest.raises(ValueError, match=r"4 samples, fewer than one global batch"):
        load("SyntheticDataProcessor", batch_size=8, num_samples=4)
    with pytest.warns(UserWarning, match=r"train_input.prefetch_factor is ignored"):
        load("SyntheticDataProcessor", batch_size=2, prefetch_factor=4)
    with pytest.warns(UserWarning, match=r"train_input.data_dir is ignored"):
        load("SyntheticDataProcessor", batch_size=2, data_dir="/data")
    with pytest.warns(UserWarning, match=r"train_input.vocab_size is ignored"):
        load("SyntheticDataProcessor", batch_size=2, task="classification", vocab_size=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load("SyntheticDataProcessor", batch_size=2, num_workers=1, prefetch_factor=4)

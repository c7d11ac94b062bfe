"""Checkpoints: round trips, the on-disk layout, reference fixtures, atomic saves,
damaged files, conversions, trainer helpers and memory (weightstream.checkpoint)."""

from __future__ import annotations

import collections
import copy
import errno
import importlib.util
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import weightstream
from weightstream.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LazyStateDict,
    PickleNotAllowedError,
    checkpoint_path,
    convert,
    diff,
    find_latest_checkpoint,
    info,
    is_complete_checkpoint,
    list_checkpoints,
    load,
    prune_checkpoints,
    save,
)
from weightstream.checkpoint import kernel as kernel_module
from weightstream.checkpoint import pieces as pieces_module
from weightstream.checkpoint import writer as writer_module
from weightstream.checkpoint.cli import main as cli_main
from weightstream.checkpoint.reader import read_attributes

DATA = Path(__file__).parent / "data"
MODES = [None, "cache", "cpu", torch.device("cpu")]


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


class Opaque:
    """A class the format has no type for: it is pickled."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.x == self.x


Point = collections.namedtuple("Point", "x y")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(expected, actual, path="state", exact_types=True):
    """Bitwise equality of a loaded state with the saved one, containers and types included."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert type(actual) is type(expected), (path, type(actual))
        assert actual.dtype == expected.dtype, (path, actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (path, actual.shape, expected.shape)
        assert actual.requires_grad == expected.requires_grad, path
        assert torch.equal(raw_bytes(actual), raw_bytes(expected)), path
        if expected.dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
            if not expected.is_floating_point() or not torch.isnan(expected).any():
                assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), (path, type(actual))
        if exact_types:
            assert type(actual) is type(expected), (path, type(actual))
        assert list(actual.keys()) == list(expected.keys()), path
        if hasattr(expected, "_metadata") and type(actual) is not dict:  # dict(x) drops it
            assert actual._metadata == expected._metadata, path
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]", exact_types)
    elif isinstance(expected, (list, tuple)) and type(expected) in (list, tuple):
        assert type(actual) is type(expected), (path, type(actual))
        assert len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]", exact_types)
    elif isinstance(expected, np.ndarray):
        assert type(actual) is np.ndarray, path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, float) and expected != expected:
        assert type(actual) is float and actual != actual, path
    else:
        assert type(actual) is type(expected), (path, type(actual), type(expected))
        assert actual == expected, (path, actual, expected)


def every_leaf_state() -> dict:
    """A state with every kind of leaf and container the format handles."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    embedding = torch.randn(5, 4, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        complex32 = torch.randn(3, dtype=torch.complex64, generator=g).to(torch.complex32)
    tensors = {
        "float32": torch.randn(3, 4, generator=g),
        "float64": torch.randn(2, 3, dtype=torch.float64, generator=g),
        "float16": torch.randn(5, generator=g).half(),
        "bfloat16": torch.randn(2, 5, generator=g).bfloat16(),
        "complex64": torch.randn(3, dtype=torch.complex64, generator=g),
        "complex128": torch.randn(2, 2, dtype=torch.complex128, generator=g),
        "complex32": complex32,
        "bool": torch.rand(7, generator=g) > 0.5,
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "int16": torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16),
        "int32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "int64": torch.tensor([-(2**63), 2**63 - 1]),
        "uint8": torch.tensor([0, 255], dtype=torch.uint8),
        "uint16": torch.from_numpy(np.array([0, 2**16 - 1], dtype=np.uint16)),
        "uint32": torch.from_numpy(np.array([0, 2**32 - 1], dtype=np.uint32)),
        "uint64": torch.from_numpy(np.array([0, 2**64 - 1], dtype=np.uint64)),
        "float8_e4m3fn": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "float8_e5m2": torch.randn(2, 2, generator=g).to(torch.float8_e5m2),
        "scalar_0d": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "offset_view": base[2:4],
        "expanded": torch.arange(3.0).expand(4, 3),
        "special_floats": torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")]),
        "parameter": nn.Parameter(torch.randn(2, 2, generator=g)),
        "frozen_parameter": nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
    }
    model = OrderedDict(
        [
            ("embedding.weight", embedding),
            ("lm_head.weight", embedding),  # tied
            ("norm.weight", torch.ones(4)),
        ]
    )
    model._metadata = OrderedDict([("", {"version": 1}), ("embedding", {"version": 2})])
    return {
        "tensors": tensors,
        "model": model,
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
            "param_groups": [
                {"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None, "name": "g"}
            ],
        },
        "scalars": {
            "int": -7,
            "max_int64": 2**63 - 1,
            "big_int": 2**80,
            "negative_big_int": -(2**70),
            "float": 0.1,
            "nan": float("nan"),
            "minus_inf": -float("inf"),
            "true": True,
            "false": False,
            "complex": 1.5 - 2j,
        },
        "strings": {
            "plain": "hello",
            "empty": "",
            "unicode": "héllo ✓ 漢字",
            "with_nul": "a\x00b",
            "long": "xyz" * 10000,
        },
        "none": None,
        "containers": {
            "empty_dict": {},
            "empty_list": [],
            "empty_tuple": (),
            "nested": [1, (2.0, [None, "s"]), {"k": torch.ones(1)}],
            "tensor_tuple": (torch.zeros(2), torch.ones(2)),
        },
        "keys": {0: "int key", 7: "int", 1.5: "float key", None: "none key", "a/b": 1, "a.b": 2},
        "other": {
            "bytes": b"\x00\xff",
            "bytearray": bytearray(b"ab"),
            "numpy": np.arange(6, dtype=np.int32).reshape(2, 3),
            "numpy_f16": np.ones(2, np.float16),
            "numpy_scalar": np.float64(2.5),
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "size": torch.Size([2, 3]),
        },
        "pickled": {"set": {1, 2, 3}, "object": Opaque([1, 2]), "namedtuple": Point(1, 2)},
    }


def sum64(data: bytes) -> int:
    """The documented checksum, computed independently of the library."""
    padded = data + b"\0" * (-len(data) % 8)
    return int(np.frombuffer(padded, dtype="<u8").sum(dtype=np.uint64))


def fixture_module():
    spec = importlib.util.spec_from_file_location(
        "make_reference_fixtures", DATA / "make_reference_fixtures.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)},
        "step": 3,
        "name": "run",
        "none": None,
        "lr": [0.1, 0.2],
    }


@pytest.fixture(scope="module")
def every_leaf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("every_leaf") / "state.mdl"
    # The save says which leaves load() will want allow_pickle for (a set, a class of
    # its own, a namedtuple), as load's error does.
    with pytest.warns(UserWarning, match=r"'pickled.set' \(set\), 'pickled.object' \(Opaque\), "
                      r"'pickled.namedtuple' \(Point\) stored pickled: load\(\) reads them back "
                      r"only with allow_pickle=True"):  # fmt: skip
        save(every_leaf_state(), path)
    return path


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [False, True], ids=["copy", "mmap"])
@pytest.mark.parametrize("map_location", MODES, ids=["lazy", "cache", "cpu", "device"])
def test_round_trip_every_leaf_type(every_leaf_file, map_location, mmap):
    expected = every_leaf_state()
    loaded = load(every_leaf_file, map_location, allow_pickle=True, mmap=mmap)
    lazy = map_location in (None, "cache")
    assert isinstance(loaded, LazyStateDict if lazy else dict)
    assert_same(expected, loaded, exact_types=not lazy)
    model = loaded["model"]
    if map_location is None:  # lazy: a fresh read per access, equal values
        assert model["embedding.weight"] is not model["lm_head.weight"]
    else:  # tied weights come back as one tensor
        assert model["embedding.weight"] is model["lm_head.weight"]


def test_eager_load_to_another_device_places_each_tensor_once(tmp_path):
    # Every tensor is moved by itself: a later read may reuse a freed tensor's
    # id, which once made it come back as an earlier tensor's copy.
    state = {f"w{i}": torch.full((i + 1,), float(i)) for i in range(64)}
    state["tied"] = state["w5"]
    save(state, tmp_path / "s.mdl")
    loaded = load(tmp_path / "s.mdl", "meta")
    assert {k: v.shape for k, v in loaded.items()} == {k: v.shape for k, v in state.items()}
    assert all(v.device.type == "meta" for v in loaded.values())
    assert loaded["tied"] is loaded["w5"]


def test_lazy_mode_reads_on_access_and_cache_mode_keeps(every_leaf_file):
    lazy = load(every_leaf_file)
    a, b = lazy["tensors"]["float32"], lazy["tensors"]["float32"]
    assert a is not b and torch.equal(a, b)
    cached = load(every_leaf_file, "cache")
    assert cached["tensors"]["float32"] is cached["tensors"]["float32"]
    assert cached["containers"]["nested"] is cached["containers"]["nested"]


def test_pickled_leaves_need_allow_pickle(every_leaf_file):
    with pytest.raises(PickleNotAllowedError) as e:
        load(every_leaf_file, "cpu")
    message = str(e.value)
    assert str(every_leaf_file) in message and "'pickled.set'" in message
    assert "builtins.set" in message and "allow_pickle=True" in message
    lazy = load(every_leaf_file)  # the rest of the state loads lazily without pickle
    assert_same(every_leaf_state()["tensors"], lazy["tensors"], exact_types=False)
    with pytest.raises(PickleNotAllowedError):
        lazy["pickled"]["object"]


def test_tensors_are_written_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "SLAB_BYTES", 256)  # many pieces per tensor
    base = torch.randn(40, 30)
    state = {
        "t": base.t(),
        "s": base[::3, ::2],
        "bf": base.bfloat16().t(),
        "e": base[0].expand(5, 30),
    }
    save(state, tmp_path / "s.mdl")
    assert_same(state, load(tmp_path / "s.mdl", "cpu"))


@pytest.mark.parametrize("compression", ["gzip", "lz4"])
def test_compression(tmp_path, compression):
    state = {"w": torch.randn(64, 64), "b": torch.randn(3).bfloat16(), "s": torch.tensor(1.0)}
    save(state, tmp_path / "c.mdl", compression=compression)
    with h5py.File(tmp_path / "c.mdl") as f:
        plist = f["w"].id.get_create_plist()
        assert plist.get_filter(0)[0] == {"gzip": 1, "lz4": 32004}[compression]
    for mode in MODES:
        assert_same(state, load(tmp_path / "c.mdl", mode), exact_types=mode not in (None, "cache"))


@pytest.mark.parametrize("compression", ["gzip", "lz4"])
def test_compressed_weights_are_never_much_larger_than_plain_ones(tmp_path, compression):
    """Random fp32 weights barely compress; chunks of whole rows of about 1 MiB keep the
    per-chunk alignment padding small (h5py's own few-KiB chunks made lz4 files 45%
    larger than plain ones), and a chunk is written once across the save's pieces."""
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256, 128, generator=gen) for i in range(40)}
    state["big"] = torch.randn(3000, 1000, generator=gen)  # pieces of 4 MiB, chunks of 1
    save(state, tmp_path / "plain.mdl")
    save(state, tmp_path / "packed.mdl", compression=compression)
    plain, packed = ((tmp_path / n).stat().st_size for n in ("plain.mdl", "packed.mdl"))
    assert packed <= 1.01 * plain, (packed, plain)
    with h5py.File(tmp_path / "packed.mdl") as f:
        assert f["w0"].chunks == (256, 128) and f["big"].chunks == (262, 1000)
        assert np.array_equal(f["big"][()], state["big"].numpy())  # h5py's own read


def test_a_meta_tensor_is_refused_and_nothing_is_written(tmp_path):
    with torch.device("meta"):
        state = nn.Linear(4, 4).state_dict()
    with pytest.raises(ValueError, match="'weight': it is a meta tensor"):
        save(state, tmp_path / "m.mdl")
    assert list(tmp_path.iterdir()) == []


def test_special_root_keys_and_large_spec(tmp_path):
    state = {"": 1, ".": 2, "..": 3, "x": {f"{'k' * 60}{i}": i for i in range(1500)}}
    save(state, tmp_path / "k.mdl")
    with h5py.File(tmp_path / "k.mdl") as f:
        assert {"__root__", "%2E", "%2E%2E"} <= set(f.keys())
        assert len(f.attrs["__spec__"]) > 64 * 1024  # beyond a compact attribute
    assert_same(state, load(tmp_path / "k.mdl", "cpu"))


def test_root_that_is_not_a_dict(tmp_path):
    for value in ([torch.ones(2), {"a": 1}], torch.arange(4), "text"):
        save(value, tmp_path / "r.mdl")
        for mode in MODES:
            assert_same(value, load(tmp_path / "r.mdl", mode))


def test_save_errors_change_nothing(tmp_path):
    target = tmp_path / "c.mdl"
    save({"v": torch.ones(2)}, target)
    before = target.read_bytes()
    cycle: dict = {"a": 1}
    cycle["self"] = cycle
    with pytest.raises(ValueError, match=r"both flatten to the dataset name 'a\.b'"):
        save({"a.b": 1, "a": {"b": 2}}, target)
    with pytest.raises(ValueError, match="reference cycle at key 'self'"):
        save(cycle, target)
    with pytest.raises(ValueError, match="compression='zstd' is not supported"):
        save({"v": 1}, target, compression="zstd")
    with pytest.raises(TypeError, match=r"cannot save key 'bad'.*pickling it failed"):
        save({"t": torch.ones(1000), "bad": lambda: 0}, target)
    with open(tmp_path / "f", "wb") as fh, pytest.raises(TypeError, match="not to an open file"):
        save({"v": 1}, fh)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.mdl", "f"]


def test_interrupt_during_save_removes_temporary_file(tmp_path):
    class Interrupt:
        def __reduce__(self):
            raise KeyboardInterrupt

    target = tmp_path / "c.mdl"
    save({"v": torch.ones(2)}, target)
    with pytest.raises(KeyboardInterrupt):
        save({"t": torch.ones(100), "x": Interrupt()}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["c.mdl"]
    assert_same({"v": torch.ones(2)}, load(target, "cpu"))


# ---------------------------------------------------------------------------
# The layout on disk, read with plain h5py
# ---------------------------------------------------------------------------


def test_layout_seen_with_plain_h5py(tmp_path):
    embedding = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {
        "model": {
            "w": torch.arange(6, dtype=torch.float32).reshape(3, 2) / 4,
            "emb": embedding,
            "head": embedding,
            "bf": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
        },
        "step": 5,
        "name": "gpt",
        "none": None,
        "a/b": torch.tensor([1, 2], dtype=torch.int16),
        "lst": [1.5, "x"],
    }
    path = tmp_path / "layout.mdl"
    save(state, path)
    raw = path.read_bytes()
    with h5py.File(path, "r") as f:
        assert set(f.keys()) == {
            "model.w", "model.emb", "model.head", "model.bf", "step", "name", "none",
            "a%2Fb", "lst.0", "lst.1",
        }  # fmt: skip
        assert set(f.attrs) == {
            "__spec__", "__spec_sum64__", "__version__", "__weightstream_version__",
            "__SUCCESS__",
        }  # fmt: skip
        assert f.attrs["__version__"] == 0.5
        assert bool(f.attrs["__SUCCESS__"]) is True
        assert f.attrs["__weightstream_version__"].decode() == weightstream.__version__
        spec = json.loads(f.attrs["__spec__"])
        assert spec == {
            "format": "weightstream.tree",
            "version": 1,
            "tree": {
                "dict": [
                    ["model", {"dict": [["w", None], ["emb", None], ["head", None], ["bf", None]]}],
                    ["step", None],
                    ["name", None],
                    ["none", None],
                    ["a/b", None],
                    ["lst", {"list": [None, None]}],
                ]
            },
        }
        assert int(f.attrs["__spec_sum64__"]) == sum64(f.attrs["__spec__"].encode())

        w = f["model.w"]
        assert (w.shape, w.dtype) == ((3, 2), np.float32)
        assert w.attrs["__H5_TYPE__"] == b"TorchTensorH5Type"
        assert w.attrs["dtype"] == b"torch.float32"
        assert list(w.attrs["shape"]) == [3, 2]
        assert not w.attrs["is_bfloat16"]
        plist = w.id.get_create_plist()
        assert plist.get_layout() == h5py.h5d.CONTIGUOUS and plist.get_nfilters() == 0
        offset = w.id.get_offset()
        data = state["model"]["w"].numpy().tobytes()
        assert raw[offset : offset + len(data)] == data  # the tensor's bytes, as they are
        assert int(w.attrs["checksum_sum64"]) == sum64(data)

        bf = f["model.bf"]
        assert bf.dtype == np.uint16 and bool(bf.attrs["is_bfloat16"])
        assert bf.attrs["dtype"] == b"torch.bfloat16"
        assert bf[()].tobytes() == state["model"]["bf"].view(torch.int16).numpy().tobytes()

        # Tied weights: one dataset, two hard links.
        assert f["model.emb"].id == f["model.head"].id
        assert isinstance(f.get("model.head", getlink=True), h5py.HardLink)
        assert h5py.h5o.get_info(f["model.emb"].id).rc == 2

        step = f["step"]
        assert step.shape == () and step.dtype == np.int64 and step[()] == 5
        assert step.attrs["__H5_TYPE__"] == b"ScalarH5Type"
        assert f["name"].shape is None and f["name"].attrs["string_value"] == b"gpt"
        assert f["name"].attrs["__H5_TYPE__"] == b"StringH5Type"
        assert f["none"].shape is None and f["none"].attrs["__H5_TYPE__"] == b"NoneH5Type"
        assert "string_value" not in f["none"].attrs
        assert f["a%2Fb"].dtype == np.int16
        assert f["lst.1"].attrs["string_value"] == b"x"


# ---------------------------------------------------------------------------
# Files of the reference system
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("map_location", MODES, ids=["lazy", "cache", "cpu", "device"])
@pytest.mark.parametrize("name,filter_id", [("lz4", 32004), ("gzip", 1), ("none", None)])
def test_reference_fixtures_load(name, filter_id, map_location):
    path = DATA / f"reference_{name}.h5"
    with h5py.File(path, "r") as f:  # the fixture is what it claims to be
        plist = f["model.embedding.weight"].id.get_create_plist()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert filters == ([] if filter_id is None else [filter_id])
        assert "__weightstream_version__" not in f.attrs
    expected = fixture_module().expected_state()
    loaded = load(path, map_location)
    assert_same(expected, loaded, exact_types=map_location not in (None, "cache"))
    if map_location not in (None,):
        model = loaded["model"]
        assert model["embedding.weight"] is model["lm_head.weight"]
    assert info(path)["writer"] == "reference"


def test_reference_spec_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.h5"
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = pickle.dumps(Evil()).hex()
        f.attrs["__version__"] = 0.5
        d = f.create_dataset("a.b", data=np.arange(3.0))
        d.attrs["__H5_TYPE__"] = "TorchTensorH5Type"
        f.attrs["__SUCCESS__"] = True
    with pytest.warns(UserWarning, match="could not be decoded safely"):
        loaded = load(path, "cpu")
    assert not marker.exists()
    assert list(loaded) == ["a.b"]  # a flat dict keyed by the flattened names
    assert torch.equal(loaded["a.b"], torch.arange(3.0, dtype=torch.float64))


def test_other_reference_layouts(tmp_path):
    """Attributes of the reference's newer storage layer and of its oldest releases."""
    path = tmp_path / "variants.h5"
    with h5py.File(path, "w") as f:
        f.attrs["__version__"] = 0.5
        d = f.create_dataset("tensor_serializer", data=np.arange(3, dtype=np.float32))
        d.attrs["__TYPE__"] = "TorchTensorSerializer"
        d.attrs["__NUMPY__"] = True
        f.create_dataset("untagged_numpy", data=np.arange(2)).attrs["__NUMPY__"] = True
        d = f.create_dataset("bytes_object", data=h5py.Empty("f"))
        d.attrs["__TYPE__"] = "ObjectSerializer"
        d.attrs["__BYTES__"] = np.void(pickle.dumps({1, 2}))
        d = f.create_dataset("dill_object", data=h5py.Empty("f"))
        d.attrs["__H5_TYPE__"] = "ObjectH5Type"
        d.attrs["object_value"] = pickle.dumps([1, "a"]).hex()
        f.create_dataset("legacy_none", data=np.zeros(1)).attrs["is_none"] = True
        d = f.create_dataset("legacy_string", data=np.zeros(1))
        d.attrs["is_string"] = True
        d.attrs["string_val"] = "hi"
        f.create_dataset("legacy_scalar", data=np.float64(2.5)).attrs["is_scalar"] = True
        f.create_dataset("future", data=np.zeros(1)).attrs["__H5_TYPE__"] = "FancyNewH5Type"
        f.attrs["__SUCCESS__"] = True
    lazy = load(path)  # no __spec__: a flat dict of the dataset names
    assert torch.equal(lazy["tensor_serializer"], torch.arange(3.0))
    assert torch.equal(lazy["untagged_numpy"], torch.arange(2))
    assert lazy["legacy_none"] is None and lazy["legacy_string"] == "hi"
    assert lazy["legacy_scalar"] == 2.5
    for key in ("bytes_object", "dill_object"):
        with pytest.raises(PickleNotAllowedError, match=f"key '{key}' holds a pickled"):
            lazy[key]
    trusted = load(path, allow_pickle=True)
    assert trusted["bytes_object"] == {1, 2} and trusted["dill_object"] == [1, "a"]
    with pytest.raises(CheckpointError, match="'FancyNewH5Type', which this weightstream"):
        lazy["future"]


# ---------------------------------------------------------------------------
# Atomic saves: a kill in the middle leaves the previous checkpoint
# ---------------------------------------------------------------------------

SLOW_SAVE = textwrap.dedent(
    """
    import sys, time
    import torch
    from weightstream.checkpoint import save

    class Slow:  # each of these takes 50 ms to save
        def __reduce__(self):
            time.sleep(0.05)
            return (int, (0,))

    state = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(16)}  # 16 MiB
    state.update({f"slow{i}": Slow() for i in range(400)})  # 20 s unless killed
    save(state, sys.argv[1])
    """
)


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    model_dir = tmp_path / "model_dir"
    target = checkpoint_path(model_dir, 1)
    previous = {"step": 1, "w": torch.arange(10.0)}
    save(previous, target)
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(target)])
    try:
        deadline = time.monotonic() + 60
        temporary: list[Path] = []
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the save finished before it could be killed"
            temporary = [p for p in model_dir.iterdir() if p.name.endswith(".tmp")]
            if temporary and temporary[0].stat().st_size > 16 * 2**20:
                break  # the tensors are written: the save is well under way
            time.sleep(0.02)
        else:
            pytest.fail("the save never started writing")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert_same(previous, load(target, "cpu"))  # the previous checkpoint is intact
    assert find_latest_checkpoint(model_dir) == target
    assert list_checkpoints(model_dir) == [(1, target)]
    leftovers = [p for p in model_dir.iterdir() if p != target]
    assert leftovers == temporary and temporary[0].name.startswith(".checkpoint_1.mdl.")
    for p in leftovers:  # nothing else looks like a complete checkpoint
        assert not is_complete_checkpoint(p)
        with pytest.raises(CheckpointError, match=str(p.name)):
            load(p, "cpu")


# ---------------------------------------------------------------------------
# Damaged files: clear errors that name the file
# ---------------------------------------------------------------------------


@pytest.fixture
def saved_small(tmp_path) -> tuple[Path, dict]:
    state = small_state()
    path = tmp_path / "small.mdl"
    save(state, path)
    return path, state


@pytest.mark.parametrize("keep", [0.5, 0.95, -1, 3000, 100])
def test_truncated_file(saved_small, keep):
    path, _ = saved_small
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    damaged = path.with_name("truncated.mdl")
    damaged.write_bytes(data[:cut])
    with pytest.raises(CorruptCheckpointError) as e:
        load(damaged, "cpu")
    message = str(e.value)
    assert str(damaged) in message
    assert "damaged" in message or "truncated" in message
    assert "earlier checkpoint" in message


def test_random_byte_flips_never_give_wrong_data(saved_small):
    """Every flipped bit either raises a CheckpointError naming the file or
    changes nothing that is read (it hit padding): never silently wrong data."""
    path, state = saved_small
    data = path.read_bytes()
    rng = random.Random(0)
    damaged = path.with_name("flipped.mdl")
    errors = benign = 0
    for _ in range(150):
        position, bit = rng.randrange(len(data)), 1 << rng.randrange(8)
        flipped = bytearray(data)
        flipped[position] ^= bit
        damaged.write_bytes(flipped)
        try:
            loaded = load(damaged, "cpu")
        except CheckpointError as e:
            assert str(damaged) in str(e), (position, str(e))
            errors += 1
            continue
        assert_same(state, loaded, f"flip at byte {position}")
        benign += 1
    assert errors > 100, (errors, benign)


def test_flipped_tensor_data_fails_its_checksum(saved_small):
    path, _ = saved_small
    with h5py.File(path, "r") as f:
        offset = f["model.w2"].id.get_offset()
    flipped = bytearray(path.read_bytes())
    flipped[offset + 100] ^= 0x10
    path.write_bytes(flipped)
    lazy = load(path)
    assert torch.equal(lazy["model"]["w1"], small_state()["model"]["w1"])
    for mode in (None, "cpu"):
        with pytest.raises(CorruptCheckpointError, match=r"key 'model\.w2'.*checksum"):
            loaded = load(path, mode)
            loaded["model"]["w2"]
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load(path, "cpu", mmap=True)
    assert torch.equal(load(path, "cpu", verify=False)["model"]["w1"], small_state()["model"]["w1"])


def test_missing_success_marker(saved_small):
    path, state = saved_small
    with h5py.File(path, "a") as f:
        del f.attrs["__SUCCESS__"]
    for mode in MODES:
        with pytest.raises(IncompleteCheckpointError) as e:
            load(path, mode)
        message = str(e.value)
        assert str(path) in message and "incomplete" in message
        assert "__SUCCESS__" in message and "interrupted" in message
        assert "previous checkpoint" in message
    assert not is_complete_checkpoint(path)
    assert_same(state, load(path, "cpu", allow_incomplete=True))


def test_missing_dataset(saved_small):
    path, _ = saved_small
    with h5py.File(path, "a") as f:
        del f["model.w1"]
    with pytest.raises(CorruptCheckpointError) as e:
        load(path)
    assert str(path) in str(e.value)
    assert "'model.w1'" in str(e.value) and "have no dataset" in str(e.value)


def test_other_bad_inputs(tmp_path, saved_small):
    path, _ = saved_small
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"notes\.txt is not a checkpoint"):
        load(text)
    with pytest.raises(FileNotFoundError, match=r"missing\.mdl does not exist"):
        load(tmp_path / "missing.mdl")
    with h5py.File(path, "a") as f:
        f.attrs["__version__"] = 0.9
    with pytest.raises(CheckpointError, match=r"format version 0\.9, newer.*Upgrade weightstream"):
        load(path)
    with pytest.raises(TypeError, match="map_location must be None"):
        load(path, map_location=lambda s, loc: s)
    pt = tmp_path / "state.pt"
    torch.save({"a": torch.ones(2)}, pt)
    with pytest.raises(PickleNotAllowedError) as e:
        load(pt)
    assert "state.pt is a torch.save (pickle) file" in str(e.value)
    assert "allow_pickle=True" in str(e.value) and "--allow-pickle" in str(e.value)
    assert_same({"a": torch.ones(2)}, load(pt, "cpu", allow_pickle=True))


# ---------------------------------------------------------------------------
# Tensors in pieces on threads (Note [parallel pieces], Note [direct data writes])
# ---------------------------------------------------------------------------


@pytest.fixture
def tiny_pieces(monkeypatch):
    """Pieces of 8 bytes on 4 threads: every tensor of the small states is many pieces."""
    monkeypatch.setattr(pieces_module, "PIECE_BYTES", 8)
    monkeypatch.setattr(pieces_module, "io_threads", lambda: 4)


def test_pieces_on_threads_round_trip(tmp_path, tiny_pieces):
    state = every_leaf_state()
    state["odd"] = {  # byte lengths that are not whole 8-byte words
        "bool": torch.rand(1001) > 0.5,
        "uint8": torch.arange(999, dtype=torch.int64).to(torch.uint8),
        "float16": torch.randn(333, 3).half(),
        "bfloat16": torch.randn(123).bfloat16(),
    }
    path = tmp_path / "pieces.mdl"
    save(state, path)
    with h5py.File(path, "r") as f:  # each checksum is the documented Sum64 of the bytes
        for key, value in state["odd"].items():
            dset = f[f"odd.{key}"]
            offset = dset.id.get_offset()
            data = raw_bytes(value).numpy().tobytes()
            assert path.read_bytes()[offset : offset + len(data)] == data
            assert int(dset.attrs["checksum_sum64"]) == sum64(data)
    for mmap in (False, True):
        for mode in MODES:
            loaded = load(path, mode, allow_pickle=True, mmap=mmap)
            assert_same(state, loaded, exact_types=mode not in (None, "cache"))


def test_pieces_on_threads_find_damage_in_any_piece(tmp_path, tiny_pieces):
    state = {"w": torch.randn(40, 30), "b": torch.randn(7)}
    path = tmp_path / "p.mdl"
    save(state, path)
    with h5py.File(path, "r") as f:
        offset = f["w"].id.get_offset()
    data = path.read_bytes()
    for position in (offset, offset + 2400, offset + 40 * 30 * 4 - 1):  # first, middle, last
        flipped = bytearray(data)
        flipped[position] ^= 0x01
        path.write_bytes(flipped)
        for mmap in (False, True):
            with pytest.raises(CorruptCheckpointError, match=r"key 'w'.*checksum"):
                load(path, "cpu", mmap=mmap)
    path.write_bytes(data[: offset + 2400])  # cut in the middle of "w"
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        load(path, "cpu", allow_incomplete=True)


def test_failed_piece_write_stops_the_save(tmp_path, tiny_pieces, monkeypatch):
    target = tmp_path / "c.mdl"
    previous = {"v": torch.ones(2)}
    save(previous, target)
    real_pwrite = os.pwrite
    calls = []

    def failing_pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 30:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    with pytest.raises(CheckpointWriteError, match=r"No space left on device.*Free disk space"):
        save({"w": torch.randn(64, 64), "x": torch.randn(100)}, target)
    monkeypatch.undo()
    assert_same(previous, load(target, "cpu"))
    assert [p.name for p in tmp_path.iterdir()] == ["c.mdl"]
    assert not [t for t in threading.enumerate() if t.name == "weightstream-io"]


def test_durable_save_starts_writeback_as_it_goes(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(kernel_module, "WRITEBACK_BYTES", 64 * 1024)
    monkeypatch.setattr(kernel_module, "start_writeback", started.append)
    state = {f"w{i}": torch.randn(128, 256) for i in range(4)}  # 4 x 128 KiB
    save(state, tmp_path / "quick.mdl", fsync=False)
    assert started == []  # nothing will wait for the disk: leave it to the kernel
    save(state, tmp_path / "durable.mdl")
    assert len(started) >= 4  # about one per 64 KiB written
    assert_same(state, load(tmp_path / "durable.mdl", "cpu"))


def test_kernel_hints_never_fail(monkeypatch):
    monkeypatch.setattr(kernel_module, "_broken", set())
    read_end, write_end = os.pipe()
    try:
        kernel_module.start_writeback(write_end)  # a pipe has no pages to write back
        kernel_module.start_writeback(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    buffer = np.zeros(3 * 4096 + 100, dtype=np.uint8)
    kernel_module.populate(buffer.ctypes.data, buffer.nbytes)
    kernel_module.populate(buffer.ctypes.data + 1, 10)  # no whole page inside: nothing
    assert not buffer.any()  # hints never change memory
    assert "sync_file_range" not in kernel_module._broken  # a pipe says nothing of files


def test_for_each_piece_orders_results_and_joins_before_raising():
    seen = []
    # The first two pieces wait for each other: they run on two threads at once
    # (however busy the machine, short of 30 s without a helper thread starting).
    together = threading.Barrier(2, timeout=30)

    def work(i):
        seen.append(threading.current_thread().name)
        if i < 2:
            together.wait()
        time.sleep(0.001)
        if i == 57:
            raise ValueError("piece 57")
        return i * i

    assert pieces_module.for_each_piece(50, work, threads=4) == [i * i for i in range(50)]
    assert len(set(seen)) > 1  # the caller and helpers both worked
    with pytest.raises(ValueError, match="piece 57"):
        pieces_module.for_each_piece(200, work, threads=4)
    assert not [t for t in threading.enumerate() if t.name == "weightstream-io"]
    assert pieces_module.for_each_piece(0, work) == []
    assert pieces_module.for_each_piece(3, lambda i: i, threads=1) == [0, 1, 2]


def test_read_attributes_is_dict_of_attrs(tmp_path, every_leaf_file):
    """The reader's fast attribute path gives what h5py gives, for every kind of attribute."""
    path = tmp_path / "attrs.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", data=np.arange(3))
        d.attrs["empty"] = h5py.Empty("f")
        d.attrs["vlen"] = "héllo"
        d.attrs["fixed"] = np.bytes_(b"abc")
        d.attrs["big_endian"] = np.arange(4, dtype=">i4")
        d.attrs["half"] = np.float16(1.5)
        d.attrs["complex"] = np.complex64(1 + 2j)
        d.attrs["flag"] = True
        d.attrs["strings"] = np.array([b"a", b"bc"])
        d.attrs["compound"] = np.array((1, 2.0), dtype=[("a", "i4"), ("b", "f8")])
    files = [path, every_leaf_file, *sorted(DATA.glob("*.h5"))]
    for file in files:
        with h5py.File(file, "r") as f:
            for name in f:
                expected, actual = dict(f[name].attrs), read_attributes(f[name])
                assert list(actual) == list(expected), (file, name)
                for key, value in expected.items():
                    got = actual[key]
                    assert type(got) is type(value), (file, name, key)
                    if isinstance(value, h5py.Empty):
                        assert got.dtype == value.dtype
                    else:
                        assert getattr(got, "dtype", None) == getattr(value, "dtype", None)
                        assert np.array_equal(np.asarray(got), np.asarray(value)), (name, key)


# ---------------------------------------------------------------------------
# The lazy mapping with torch
# ---------------------------------------------------------------------------


def test_lazy_state_dict_with_torch_modules_and_optimizers(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "schedulers": [sched.state_dict()],
    }
    save(state, tmp_path / "t.mdl")
    sd = load(tmp_path / "t.mdl")

    model2 = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model2.load_state_dict(sd["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(sd["optimizer"])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    sched2.load_state_dict(sd["schedulers"][0])
    assert_same(state["model"], model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    assert sched2.state_dict() == sched.state_dict()

    assert sd["model"]._metadata == state["model"]._metadata
    with pytest.raises(TypeError, match="read-only"):
        sd["model"]["0.weight"] = torch.zeros(1)
    with pytest.raises(TypeError, match="read-only"):
        sd.update({})
    assert_same(state, copy.deepcopy(sd), exact_types=False)
    assert_same(state["model"], dict(sd["model"]), exact_types=False)
    assert_same(state, sd.to_dict())

    # torch.save of a lazy dict gives a file torch.load(weights_only=True) reads.
    torch.save(sd, tmp_path / "t.pt")
    back = torch.load(tmp_path / "t.pt", weights_only=True)
    assert_same(state, back, exact_types=False)
    assert back["model"]._metadata == state["model"]._metadata
    sd.close()
    with pytest.raises(ValueError, match="was closed"):
        sd["model"]["0.weight"]


def test_save_of_a_lazy_state_streams_and_keeps_ties(every_leaf_file, tmp_path):
    copy_path = tmp_path / "copy.mdl"
    with load(every_leaf_file, allow_pickle=True) as lazy:
        save(lazy, copy_path)
    result = diff(every_leaf_file, copy_path, allow_pickle=True)
    assert result.identical, result
    with h5py.File(copy_path) as f:
        assert f["model.embedding.weight"].id == f["model.lm_head.weight"].id
    nested = tmp_path / "nested.mdl"
    save({"run": load(every_leaf_file, "cache")["model"], "step": 1}, nested)
    assert_same(
        {"run": every_leaf_state()["model"], "step": 1}, load(nested, "cpu"), exact_types=False
    )


# ---------------------------------------------------------------------------
# Conversions: safetensors (single, sharded) and torch
# ---------------------------------------------------------------------------


def conversion_state() -> dict:
    g = torch.Generator().manual_seed(2)
    embedding = torch.randn(6, 4, generator=g)
    return {
        "model": {
            "embed.weight": embedding,
            "lm_head.weight": embedding,
            "ln.weight": torch.randn(4, generator=g).bfloat16(),
            "mask": torch.tensor([True, False]),
            "ids": torch.arange(5),
            "t": torch.randn(3, 5, generator=g).t(),
        },
        "global_step": 12,
        "lr": 0.5,
        "name": "gpt",
        "extra": None,
        "betas": (0.9, 0.99),
    }


def test_safetensors_single_file_round_trip(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = conversion_state()
    h5 = tmp_path / "state.mdl"
    save(state, h5)
    st = tmp_path / "state.safetensors"
    assert convert(h5, st) == [st]
    tensors = load_file(st)  # the safetensors library reads what we wrote
    assert sorted(tensors) == sorted(f"model.{k}" for k in state["model"])
    for k, v in state["model"].items():
        assert_same(v, tensors[f"model.{k}"])
    with safe_open(st, "pt") as f:
        assert f.metadata()["format"] == "pt"
    for mode in MODES:  # structure, non-tensor leaves and ties restored
        loaded = load(st, mode)
        assert_same(state, loaded, exact_types=mode not in (None, "cache"))
    eager = load(st, "cpu")
    assert eager["model"]["embed.weight"] is eager["model"]["lm_head.weight"]
    back = tmp_path / "back.mdl"
    convert(st, back)
    assert diff(h5, back).identical
    weights = tmp_path / "weights.safetensors"
    convert(h5, weights, key="model")
    assert sorted(load_file(weights)) == sorted(state["model"])


def test_safetensors_from_the_library_load(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "b.weight": torch.randn(3, 2),
        "a.bias": torch.randn(2).bfloat16(),
        "c": torch.tensor([1, 2], dtype=torch.int8),
    }
    path = tmp_path / "lib.safetensors"
    save_file(tensors, path)
    for mode in MODES:
        assert_same(tensors, dict(load(path, mode)), exact_types=False)
    assert_same(tensors, dict(load(path, "cpu", mmap=True)))
    h5 = tmp_path / "lib.mdl"
    convert(path, h5)
    assert_same(tensors, load(h5, "cpu"))


def write_hf_sharded(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Two shards and an index, as Hugging Face's save_pretrained writes them."""
    from safetensors.torch import save_file

    names = list(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in shard}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = directory / "model.safetensors.index.json"
    total = sum(t.nbytes for t in tensors.values())
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


def test_hugging_face_sharded_checkpoint_reads(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {f"model.layers.{i}.weight": torch.randn(8, 8, generator=g) for i in range(4)}
    tensors["model.norm.weight"] = torch.ones(8).bfloat16()
    index = write_hf_sharded(tmp_path, tensors)
    for where in (index, tmp_path):
        for mode in MODES:
            assert_same(tensors, dict(load(where, mode)), exact_types=False)
    result = info(index)
    assert result["format"] == "safetensors-sharded" and result["files"] == 2
    assert result["num_leaves"] == 5
    h5 = tmp_path / "from_shards.mdl"
    convert(index, h5)
    assert_same(tensors, load(h5, "cpu"))
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(
        CorruptCheckpointError, match=r"model-00002-of-00002\.safetensors.*truncated"
    ):
        load(index)


def test_sharded_safetensors_output(tmp_path):
    from safetensors import safe_open

    state = conversion_state()
    h5 = tmp_path / "state.mdl"
    save(state, h5)
    out = tmp_path / "hf"
    written = convert(h5, out, key="model", max_shard_size=100)
    index = out / "model.safetensors.index.json"
    assert written[-1] == index and len(written) > 2
    doc = json.loads(index.read_text())
    assert set(doc["weight_map"]) == set(state["model"])
    assert doc["metadata"]["total_size"] == sum(t.nbytes for t in state["model"].values())
    for name, file in doc["weight_map"].items():
        with safe_open(out / file, "pt") as f:
            assert_same(state["model"][name], f.get_tensor(name))
    assert_same(state["model"], load(out, "cpu"))


def test_a_new_export_into_a_folder_replaces_the_earlier_layout(tmp_path):
    """Shards over a single file and a single file over shards: only the new write
    stays, so safetensors' own reader of model.safetensors, transformers' choice,
    and this library's index reader see the same state."""
    from safetensors.torch import load_file

    state = conversion_state()
    old = {k: v + 1 if v.is_floating_point() else v for k, v in state["model"].items()}
    h5_old, h5_new = tmp_path / "old.mdl", tmp_path / "new.mdl"
    save({"model": old}, h5_old)
    save(state, h5_new)
    out = tmp_path / "hf"
    for first, then, shards in ((h5_old, h5_new, 100), (h5_new, h5_old, None)):
        convert(first, out, key="model", max_shard_size=None if shards else 100)
        written = convert(then, out, key="model", max_shard_size=shards)
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)
    assert not (out / "model.safetensors.index.json").exists()
    assert_same(old, load_file(out / "model.safetensors"))
    assert_same(old, load(out, "cpu"))


def test_torch_file_round_trip(tmp_path):
    state = conversion_state()
    h5 = tmp_path / "state.mdl"
    save(state, h5)
    pt = tmp_path / "state.pt"
    convert(h5, pt)
    loaded = torch.load(pt, weights_only=True)
    assert_same(state, loaded)
    assert loaded["model"]["embed.weight"] is loaded["model"]["lm_head.weight"]
    with pytest.raises(PickleNotAllowedError):
        convert(pt, tmp_path / "again.mdl")
    convert(pt, tmp_path / "again.mdl", allow_pickle=True)
    assert diff(h5, tmp_path / "again.mdl").identical
    with h5py.File(tmp_path / "again.mdl") as f:
        assert f["model.embed.weight"].id == f["model.lm_head.weight"].id


def test_info_and_diff(tmp_path):
    state = conversion_state()
    a, b = tmp_path / "a.mdl", tmp_path / "b.mdl"
    save(state, a)
    result = info(a)
    assert result["format"] == "h5" and result["format_version"] == 0.5
    assert result["writer"] == "weightstream" and result["complete"] is True
    entries = {e.key: e for e in result["entries"]}
    assert entries["model.ln.weight"].dtype == "torch.bfloat16"
    assert entries["model.ln.weight"].shape == (4,)
    assert entries["model.t"].shape == (5, 3) and entries["model.t"].nbytes == 60
    assert entries["model.lm_head.weight"].linked_to == "model.embed.weight"
    assert entries["name"].kind == "string" and entries["extra"].kind == "none"
    assert result["data_bytes"] == sum(
        e.nbytes for k, e in entries.items() if k != "model.lm_head.weight"
    )
    assert diff(a, a).identical

    other = conversion_state()
    other["model"]["ids"] = torch.arange(5) * 2
    other["model"]["mask"] = torch.tensor([True, False, True])
    other["model"]["ln.weight"] = other["model"]["ln.weight"].float()
    other["lr"] = 0.25
    del other["name"]
    other["new"] = 1
    save(other, b)
    result = diff(a, b)
    assert not result.identical
    assert result.only_in_a == ["name"] and result.only_in_b == ["new"]
    assert [k for k, *_ in result.shape] == ["model.mask"]
    assert result.dtype == [("model.ln.weight", "torch.bfloat16", "torch.float32")]
    assert {k for k, _ in result.values} == {"model.ids", "lr"}
    assert dict(result.values)["model.ids"] == "4 of 5 elements differ"


def test_command_line(tmp_path, capsys):
    state = conversion_state()
    a = tmp_path / "a.mdl"
    save(state, a)
    assert cli_main(["info", str(a)]) == 0
    out = capsys.readouterr().out
    assert "format_version: 0.5" in out and "model.embed.weight" in out
    assert "-> model.embed.weight" in out
    assert cli_main(["info", "--json", str(a)]) == 0
    assert json.loads(capsys.readouterr().out)["num_leaves"] == 12
    st = tmp_path / "w.safetensors"
    assert cli_main(["convert", str(a), str(st), "--key", "model"]) == 0
    assert capsys.readouterr().out.strip() == str(st)
    assert cli_main(["convert", str(st), str(tmp_path / "w.mdl"), "--compression", "lz4"]) == 0
    capsys.readouterr()
    assert cli_main(["diff", str(st), str(tmp_path / "w.mdl")]) == 0
    assert "identical: 6 leaves" in capsys.readouterr().out
    assert cli_main(["diff", str(a), str(st)]) == 1
    assert "only in" in capsys.readouterr().out
    pt = tmp_path / "x.pt"
    torch.save({"a": 1}, pt)
    assert cli_main(["info", str(pt)]) == 2
    assert "--allow-pickle" in capsys.readouterr().err
    assert cli_main(["info", "--allow-pickle", str(pt)]) == 0
    assert "format: torch" in capsys.readouterr().out
    assert cli_main(["convert", str(a), str(tmp_path / "s"), "--max-shard-size", "1KiB"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "s" / "model.safetensors")
    save({"w": torch.ones(2), "blob": b"xy"}, tmp_path / "blob.mdl")
    assert cli_main(["convert", str(tmp_path / "blob.mdl"), str(tmp_path / "b.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: safetensors holds only tensors") and "'blob' is a bytes" in err


def test_command_line_copy_keeps_the_sources_format(tmp_path, capsys):
    """``checkpoint copy`` (the reference converter's third verb): the source's format
    whatever the destination's name, read back by h5py and safetensors themselves."""
    from safetensors import safe_open

    state = conversion_state()
    a = tmp_path / "a.mdl"
    save(state, a)
    bak = tmp_path / "a.bak"  # a suffix of no format: copy needs none
    assert cli_main(["copy", str(a), str(bak), "--compression", "gzip"]) == 0
    assert capsys.readouterr().out.strip() == str(bak)
    with h5py.File(bak, "r") as f:
        assert f.attrs["__SUCCESS__"] and f["model.embed.weight"].compression == "gzip"
    assert cli_main(["diff", str(a), str(bak)]) == 0
    st = tmp_path / "w.safetensors"
    assert cli_main(["convert", str(a), str(st), "--key", "model"]) == 0
    capsys.readouterr()
    assert cli_main(["copy", str(st), str(tmp_path / "copy.safetensors")]) == 0
    with safe_open(st, "pt") as want, safe_open(tmp_path / "copy.safetensors", "pt") as got:
        assert set(want.keys()) == set(got.keys())
        for k in want.keys():
            assert torch.equal(want.get_tensor(k), got.get_tensor(k)), k


# ---------------------------------------------------------------------------
# Trainer checkpoints
# ---------------------------------------------------------------------------


def test_trainer_checkpoint_helpers(tmp_path):
    model_dir = tmp_path / "model_dir"
    assert find_latest_checkpoint(model_dir) is None
    assert checkpoint_path(model_dir, 10) == model_dir / "checkpoint_10.mdl"
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        checkpoint_path(model_dir, -1)
    for step in (0, 9, 10, 100):
        save({"step": step}, checkpoint_path(model_dir, step))
    # Not checkpoints, or not complete: never picked, never counted, never deleted.
    with h5py.File(checkpoint_path(model_dir, 200), "w") as f:  # a save that never finished
        f.create_dataset("step", data=200)
    (model_dir / "checkpoint_300.mdl").write_bytes(b"garbage")
    (model_dir / ".checkpoint_400.mdl.123-abcd.tmp").write_bytes(b"partial")
    (model_dir / "checkpoint_x.mdl").write_bytes(b"other")
    assert [s for s, _ in list_checkpoints(model_dir)] == [0, 9, 10, 100, 200, 300]
    with pytest.warns(UserWarning) as warned:
        latest = find_latest_checkpoint(model_dir)
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2 and "checkpoint_300.mdl (step 300)" in messages[0]
    assert "checkpoint_200.mdl (step 200): it is incomplete or unreadable" in messages[1]
    assert all("the newest complete one is checkpoint_100.mdl" in m for m in messages)
    assert latest == checkpoint_path(model_dir, 100)
    assert load(latest, "cpu")["step"] == 100

    removed = prune_checkpoints(model_dir, 2)
    assert removed == [checkpoint_path(model_dir, 0), checkpoint_path(model_dir, 9)]
    assert [s for s, _ in list_checkpoints(model_dir)] == [10, 100, 200, 300]
    assert prune_checkpoints(model_dir, None) == []
    assert prune_checkpoints(model_dir, 2) == []
    with pytest.raises(ValueError, match="max_checkpoints=0 would delete every checkpoint"):
        prune_checkpoints(model_dir, 0)


# ---------------------------------------------------------------------------
# Memory: a 1 GiB state
# ---------------------------------------------------------------------------

MEMORY_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from weightstream.checkpoint import load, save

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    MiB = 2**20
    path = sys.argv[1]
    state = {f"w{i}": torch.ones(64 * MiB) for i in range(3)}  # 3 x 256 MiB
    base = torch.ones(8192, 8 * 1024)  # 256 MiB
    state["transposed"] = base.t()  # strided: written in pieces
    largest, total = 256 * MiB, 1024 * MiB
    out = {}

    gc.collect(); before = status("VmRSS:"); reset_peak()
    out["reset_ok"] = status("VmHWM:") - before < 16 * MiB
    save(state, path)
    out["save"] = status("VmHWM:") - before
    del state, base; gc.collect()

    before = status("VmRSS:"); reset_peak()
    loaded = load(path, "cpu")
    out["load"] = status("VmHWM:") - before - total  # beyond the loaded state itself
    del loaded; gc.collect()

    before = status("VmRSS:"); reset_peak()
    lazy = load(path)
    for key in list(lazy):
        tensor = lazy[key]
        del tensor
    out["lazy"] = status("VmHWM:") - before
    out["largest"] = largest
    print(json.dumps(out))
    """
)

# Extra memory allowed beyond the largest tensor: the interpreter's and HDF5's
# own working memory (measured: well under this).
MEMORY_CONSTANT = 64 * 2**20


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_memory_of_save_and_load_stays_under_largest_tensor(tmp_path):
    script = tmp_path / "memory.py"
    script.write_text(MEMORY_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "big.mdl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if not out["reset_ok"]:
        pytest.skip("this kernel cannot reset the peak RSS")
    bound = out["largest"] + MEMORY_CONSTANT  # largest tensor + a stated constant
    for phase in ("save", "load", "lazy"):
        assert out[phase] <= bound, (phase, out[phase] / 2**20, "MiB", out)
    # Saving copies at most one piece of a strided tensor, not the tensor.
    assert out["save"] <= writer_module.SLAB_BYTES + MEMORY_CONSTANT, out


def test_a_lazily_loaded_checkpoint_and_h5py_coexist_in_one_process(tmp_path):
    """HDF5 refuses a second open of one file with other locking flags: a lazy load
    must open the file as plain h5py does, both ways round."""
    path = tmp_path / "c.mdl"
    weightstream.save({"w": torch.arange(4.0)}, path)
    lazy = weightstream.load(path)  # holds the file open
    with h5py.File(path) as f:
        assert len(f.keys()) > 0
    assert torch.equal(lazy["w"], torch.arange(4.0))
    held = h5py.File(path)  # the other way round: h5py first
    try:
        assert torch.equal(weightstream.load(path)["w"], torch.arange(4.0))
    finally:
        held.close()


def test_the_heap_is_trimmed_after_large_reads_not_after_every_leaf(tmp_path, monkeypatch):
    """A trim walks the whole heap (milliseconds in a large process): a save of many
    small leaves held in memory asks for none, and a conversion asks once its
    values read add up to TRIM_BYTES (Note [save memory])."""
    trims = []
    monkeypatch.setattr(writer_module, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(writer_module, "TRIM_BYTES", 2**20)
    small = {f"t{i}": torch.full((4,), float(i)) for i in range(300)}
    save(small, tmp_path / "small.mdl")
    assert trims == []
    large = {f"w{i}": torch.full((2**18,), float(i)) for i in range(8)}  # 1 MiB each
    save(large, tmp_path / "large.mdl")
    assert trims == []  # the caller's tensors: nothing the save allocated
    save(load(tmp_path / "large.mdl"), tmp_path / "copy.mdl")  # read leaf by leaf
    assert len(trims) == 7  # before each leaf after the first
    for name, value in load(tmp_path / "copy.mdl", map_location="cpu").items():
        assert torch.equal(value, large[name])


@pytest.mark.parametrize("value", [None, "abc"])
def test_a_warm_start_from_a_non_tensor_names_the_key(tmp_path, value):
    from weightstream.checkpoint.weights import load_weights

    path = tmp_path / "weights.mdl"
    weightstream.save({"weight": value, "bias": torch.zeros(2)}, path)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'weight' is a \w+ in the file, not a tensor"):
        load_weights(model, path)
    assert torch.equal(model.weight, before)  # nothing loaded


@pytest.mark.slow  # 10 s on 2 cores: a pipe of two processes, with the slow tests
def test_info_piped_into_a_reader_that_stops_early_is_not_an_error(tmp_path):
    save({f"k{i}": torch.zeros(2) for i in range(3000)}, tmp_path / "many.mdl")  # 200 KB of info
    command = [
        sys.executable,
        "-m",
        "weightstream.checkpoint.cli",
        "info",
        str(tmp_path / "many.mdl"),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == str(tmp_path / "many.mdl").encode()
    proc.stdout.close()  # as `| head -1` does
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (0, b"")


def test_info_verify_reads_every_tensor_back_and_names_the_damaged_one(tmp_path, capsys):
    """``complete`` is a mark set once the save wrote every tensor; bytes changed later (a
    bad disk, a copy gone wrong) keep it, and only a read finds them: ``--verify`` reads
    each tensor back (against its checksum) and exits 1 naming the damaged one."""
    path = tmp_path / "a.mdl"
    save({"model": {f"w{i}": torch.randn(256, 256) for i in range(8)}}, path)
    assert cli_main(["info", "--verify", str(path)]) == 0
    assert "verified: every leaf reads back" in capsys.readouterr().out
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # the data of one of the 8 tensors, each 256 KiB
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    damaged = tmp_path / "damaged.mdl"
    damaged.write_bytes(bytes(data))
    assert cli_main(["info", str(damaged)]) == 0
    assert "complete: True" in capsys.readouterr().out  # the mark alone cannot tell
    assert cli_main(["info", "--verify", str(damaged)]) == 1
    out = capsys.readouterr().out
    assert "verified: 1 unreadable" in out
    (line,) = [x for x in out.splitlines() if "unreadable model." in x]
    assert "checksum" in line
    assert cli_main(["info", "--verify", "--json", str(damaged)]) == 1
    bad = json.loads(capsys.readouterr().out)["unreadable"]
    assert len(bad) == 1 and bad[0][0].startswith("model.w")

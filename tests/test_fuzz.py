"""Bad input, fuzzed (design invariant 3): property-based tests with hypothesis.

1. State dicts: any tree of dicts, OrderedDicts, lists and tuples over the leaf types the
   checkpoint format has tags for flattens and unflattens to itself, its tree spec survives
   JSON, and a save/load round trip gives it back exactly (or save refuses two keys that
   flatten to one name, naming both).
2. Params files, through the run command: wrong types, unknown keys, missing sections and
   keys, out-of-range values, YAML that is not a mapping or not YAML. Every run returns 0 or
   2, never raises, within a time limit; on 2 the error names the params file or the key,
   and model_dir (holding a finished run) is exactly as it was.
3. Checkpoints with flipped bytes, truncated, or with datasets or attributes deleted: a load
   raises a CheckpointError naming the file or gives the exact data back; a run resuming
   from such a checkpoint exits with 2, names the file and changes nothing in model_dir.
   (tests/test_checkpoint.py covers these damages on a small file, one at a time; here they
   hit a whole trainer checkpoint, and the run command.)
4. GPT HDF5 data files with the wrong shape, dtype, example count, token values, or damaged
   bytes: reading every batch works or raises a ValueError naming the file; a run on them
   exits with 2 naming the file and leaves no model_dir behind.

Every example runs under a deadline (SIGALRM): a hang fails the test instead of stalling
the suite. A segmentation fault would end the test process, which fails the suite too.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import shutil
import signal
import struct
import warnings
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import params_files as pf
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from weightstream import checkpoint as ckpt
from weightstream.checkpoint.format import flatten, tree_from_json, tree_to_json, unflatten
from weightstream.cli.main import main

pytest.importorskip("tensorboard")

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,  # the same examples on every run: a failure reproduces
    database=None,
)


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Fail (instead of hanging) when the block takes longer than ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------
# 1. State dicts: flatten / unflatten, JSON spec, save / load
# ---------------------------------------------------------------------------

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    n = math.prod(shape)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(n, generator=gen, dtype=torch.float64)
        specials = draw(
            st.lists(st.sampled_from([math.nan, math.inf, -math.inf, -0.0]), max_size=2)
        )
        for i, v in enumerate(specials[:n]):
            t[i] = v
        t = t.to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31), (n,), generator=gen)
        t = t.to(dtype)
    t = t.reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # strided, not contiguous
    if draw(st.booleans()):
        grad = t.is_floating_point() and draw(st.booleans())
        t = torch.nn.Parameter(t, requires_grad=grad)
    return t


_leaves = (
    tensors()
    | st.none()
    | st.booleans()
    | st.integers()  # also past 64 bits
    | st.floats()
    | st.complex_numbers()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from([torch.float16, torch.int8, torch.device("cpu"), torch.Size([2, 0, 3])])
    | st.builds(
        lambda n, d: np.arange(n).astype(d), st.integers(0, 5), st.sampled_from(["f4", "i8", "u1"])
    )
    | st.sampled_from([np.float32(1.5), np.int64(-3), np.bool_(True)])
)
_keys = (
    st.text(max_size=5)
    | st.integers(-3, 3)
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False)
)
states = st.recursive(
    _leaves,
    lambda inner: (
        st.dictionaries(_keys, inner, max_size=4)
        | st.dictionaries(_keys, inner, max_size=4).map(OrderedDict)
        | st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
    ),
    max_leaves=12,
)


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(a, b, where: str = "state") -> None:
    """Equal in type and value; tensors and floats bit for bit (NaN equals its own bits)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert _float_bits(a) == _float_bits(b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, complex):
        assert _float_bits(a.real) + _float_bits(a.imag) == _float_bits(b.real) + _float_bits(
            b.imag
        ), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@settings(FUZZ, max_examples=150)
@given(state=states)
def test_flatten_unflatten_round_trip(state):
    flat = flatten(state)
    values = dict(flat.leaves)
    assert len(values) == len(flat.leaves)  # one leaf per flattened key ...
    assert_same(state, unflatten(flat.tree, values.__getitem__))
    again = tree_from_json(tree_to_json(flat.tree))  # ... and the spec survives JSON
    assert_same(state, unflatten(again, values.__getitem__))


@settings(FUZZ, max_examples=60)
@given(state=states)
def test_save_load_round_trip(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("rt") / "state.mdl"
    try:
        ckpt.save(state, path, fsync=False)
    except ValueError as e:
        # Two keys that flatten to one dataset name ("a.b" and {"a": {"b"}}, 1 and "1").
        assert "both flatten to the dataset name" in str(e)
        assert not path.exists()
        return
    for mode in ("cpu", "cache", None):
        loaded = ckpt.load(path, mode)
        if isinstance(loaded, ckpt.LazyStateDict):
            loaded = loaded.to_dict()
        assert_same(state, loaded, f"load({mode!r})")


# ---------------------------------------------------------------------------
# A finished run to damage
# ---------------------------------------------------------------------------


def _params(data: dict | None = None, **runconfig) -> dict:
    return pf.params(
        train_input=data or pf.text_input(4, 16, max_bytes=2000),
        model=pf.gpt2(1, 16, 16, dropout=0.0),
        optimizer=pf.adamw(1e-3, weight_decay=0.01, max_gradient_norm=1.0),
        runconfig={
            "max_steps": 2,
            "checkpoint_steps": 2,
            "log_steps": 1,
            "seed": 3,
            "unit_size_target": 2000,
            **runconfig,
        },
    )


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> str:
        text = "\n".join(self.messages)
        self.messages.clear()
        return text


@pytest.fixture
def errors():
    """The run command's logged errors (with this handler installed it adds none of its own)."""
    logger = logging.getLogger("weightstream")
    handler = _Errors()
    logger.handlers[:] = [handler]
    yield handler
    logger.handlers.clear()


def _run(params_file: Path, model_dir: Path, *extra: str) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings ignored, incomplete checkpoints skipped
        return main(["run", "CPU", "-p", str(params_file), "-o", str(model_dir), *extra])


def _snapshot(directory: Path) -> dict[str, tuple[int, str]] | None:
    if not directory.exists():
        return None
    return {
        str(p.relative_to(directory)): (
            p.stat().st_mtime_ns,
            hashlib.sha1(p.read_bytes()).hexdigest(),
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    } | {str(p.relative_to(directory)) + "/": (0, "") for p in directory.rglob("*") if p.is_dir()}


@pytest.fixture
def finished(tmp_path, errors) -> tuple[Path, Path]:
    """A params file and the model_dir of a finished 2-step run (checkpoint_2.mdl)."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(_params()))
    model_dir = tmp_path / "finished"
    assert _run(path, model_dir) == 0, errors.take()
    return path, model_dir


# ---------------------------------------------------------------------------
# 2. Params files through the run command
# ---------------------------------------------------------------------------

# Keys whose valid values would make the run long or large (more steps, a bigger model,
# more data) only get values that are invalid for them, so that no example trains for
# long: the finished run resumes at its last step and trains nothing.
_STEP_KEYS = {"max_steps", "num_steps", "num_epochs", "steps_per_epoch", "log_steps"}
_SIZE_KEYS = {"n_layer", "d_model", "n_head", "seq_len", "vocab_size", "batch_size", "max_bytes"}
_invalid_counts = st.sampled_from([0, -1, -(2**40), 1.5, "3", [2], {"a": 1}, None, True])
_any_value = (
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["dynamic", "SGD", "gpt2", "1e-3", "weight_streaming", "float16"])
    | st.lists(st.integers(-2, 2) | st.text(max_size=3), max_size=3)
    | st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2)
)


@st.composite
def params_edits(draw):
    raw = _params()
    kind = draw(
        st.sampled_from(["value", "value", "value", "unknown key", "missing key", "section"])
    )
    section = draw(st.sampled_from(list(raw)))
    keys = sorted(raw[section])
    if kind == "section":  # a section missing, or not a mapping
        value = draw(st.sampled_from(["<delete>", None, [], "text", 3]))
        if value == "<delete>":
            del raw[section]
        else:
            raw[section] = value
        return raw, section, kind
    if kind == "unknown key":
        key = draw(st.sampled_from(["max_stepz", "lr", "batchsize", "bogus", "hidden_size"]))
        raw[section][key] = draw(_any_value)
        return raw, key, kind
    key = draw(st.sampled_from(keys))
    if kind == "missing key":
        del raw[section][key]
        return raw, key, kind
    if key in _STEP_KEYS or key in _SIZE_KEYS:
        raw[section][key] = draw(_invalid_counts)
    else:
        raw[section][key] = draw(_any_value)
    return raw, key, kind


_NOT_PARAMS = st.sampled_from(
    [b"- just\n- a list\n", b"model: [unclosed\n", b"\t\tmodel:\n", b"\xff\xfe\x00garbage", b""]
)


@settings(FUZZ, max_examples=40)
@given(edit=params_edits() | _NOT_PARAMS)
def test_bad_params_files_change_nothing(finished, errors, tmp_path_factory, edit):
    _, model_dir = finished
    bad = tmp_path_factory.mktemp("params") / "bad.yaml"
    if isinstance(edit, bytes):
        bad.write_bytes(edit)
        key = kind = None
    else:
        raw, key, kind = edit
        bad.write_text(yaml.safe_dump(raw))
    before = _snapshot(model_dir)
    with deadline(60, f"a run with {edit!r}"):
        code = _run(bad, model_dir)
    message = errors.take()
    assert code in (0, 2), message
    event(f"exit {code}" + (f", {kind}" if kind else ", not a params file"))
    if code == 0:
        return  # the edit happened to be valid (e.g. a setting the run does not use)
    assert message, "exit code 2 without an error message"
    assert _snapshot(model_dir) == before, f"model_dir changed: {message}"
    if kind in ("value", "unknown key", "missing key"):
        assert str(key) in message, f"the error does not name {key!r}: {message}"
    if kind is None or kind == "section" or "params file" in message:
        assert str(bad) in message, f"the error does not name the params file: {message}"


# ---------------------------------------------------------------------------
# 3. Damaged checkpoints
# ---------------------------------------------------------------------------

damages = st.one_of(
    st.tuples(
        st.just("flip"),
        st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), min_size=1, max_size=4),
    ),
    st.tuples(st.just("truncate"), st.floats(0, 0.999)),
    st.tuples(st.just("delete dataset"), st.integers(0, 10**6)),
    st.tuples(st.just("delete attribute"), st.integers(0, 10**6)),
)


def _damage(path: Path, damage) -> str:
    """Damage ``path`` in place; returns what was done."""
    kind, arg = damage
    if kind == "flip":
        data = bytearray(path.read_bytes())
        for where, bit in arg:
            data[int(where * (len(data) - 1))] ^= 1 << bit
        path.write_bytes(data)
        return f"flipped bits {arg}"
    if kind == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: int(arg * len(data))])
        return f"truncated to {arg:.3f}"
    with h5py.File(path, "a") as f:
        if kind == "delete dataset":
            names = sorted(f)
            name = names[arg % len(names)]
            del f[name]
            return f"deleted dataset {name}"
        names = sorted(f.attrs)
        name = names[arg % len(names)]
        del f.attrs[name]
        return f"deleted root attribute {name}"


@settings(FUZZ, max_examples=80)
@given(damage=damages)
def test_damaged_checkpoint_loads_exactly_or_names_the_file(finished, tmp_path_factory, damage):
    _, model_dir = finished
    good = ckpt.checkpoint_path(model_dir, 2)
    path = tmp_path_factory.mktemp("damaged") / "checkpoint_2.mdl"
    shutil.copy(good, path)
    what = _damage(path, damage)
    with deadline(30, f"loading a checkpoint ({what})"):
        try:
            loaded = ckpt.load(path, map_location="cpu")
        except ckpt.CheckpointError as e:
            assert str(path) in str(e), f"{what}: {e}"
            event(f"{damage[0]}: {type(e).__name__}")
            return
    event(f"{damage[0]}: not detected, exact")
    # Not detected: then it must be exactly the saved data (the damage hit padding).
    assert_same(ckpt.load(good, map_location="cpu"), loaded, what)


@settings(FUZZ, max_examples=12)
@given(damage=damages)
def test_run_resuming_from_a_damaged_checkpoint_changes_nothing(
    finished, errors, tmp_path_factory, damage
):
    params_file, finished_dir = finished
    model_dir = tmp_path_factory.mktemp("run") / "model_dir"
    shutil.copytree(finished_dir, model_dir)
    newest = ckpt.checkpoint_path(model_dir, 2)
    what = _damage(newest, damage)
    assume(ckpt.is_complete_checkpoint(newest))  # else it is skipped: a fresh start
    before = _snapshot(model_dir)
    with deadline(60, f"a run resuming from a checkpoint ({what})"):
        code = _run(params_file, model_dir, "--max_steps", "3")
    message = errors.take()
    event(f"{damage[0]}: exit {code}")
    if code == 0:  # the damage hit padding: the checkpoint is exactly the saved one
        return
    assert code == 2, message
    assert str(newest) in message, f"{what}: {message}"
    assert "--checkpoint_path" in message or "move checkpoint_2.mdl" in message, message
    assert _snapshot(model_dir) == before, f"{what}: model_dir changed"


# ---------------------------------------------------------------------------
# 4. GPT HDF5 data files
# ---------------------------------------------------------------------------


@st.composite
def data_files(draw):
    """A GPT HDF5 file: sometimes right, mostly wrong in one or more ways."""
    seq = draw(st.sampled_from([16, 16, 8]))
    shape = draw(
        st.sampled_from(
            [None, (6, 3, seq), (6, 3, seq), (6, 2, seq), (6, seq), (6, 3, seq, 1), (0, 3, seq)]
        )
    )
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)))
    dtype = draw(st.sampled_from(["i4", "i4", "i8", "u2", "f4", "?", "S1"]))
    n_examples = draw(st.sampled_from(["rows", "rows", "missing", -1, 10**6, 2.5, "six", [1, 2]]))
    tokens = draw(st.sampled_from(["ok", "ok", "too big", "negative", "bad mask"]))
    flips = draw(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), max_size=2))
    return {
        "shape": shape,
        "dtype": dtype,
        "n_examples": n_examples,
        "tokens": tokens,
        "flips": flips,
    }


def _write_data_file(path: Path, spec: dict) -> None:
    shape, dtype = spec["shape"], np.dtype(spec["dtype"])
    rng = np.random.default_rng(0)
    data = (
        rng.integers(0, 256, size=shape).astype(dtype)
        if dtype.kind != "S"
        else np.zeros(shape, dtype)
    )
    if len(shape) == 3 and shape[1] == 3 and dtype.kind in "iu" and shape[0]:
        data[:, 1] = 1  # attention_mask
        if spec["tokens"] == "too big":
            data[-1, 0, 0] = 300 if dtype.itemsize > 1 else 255
        elif spec["tokens"] == "negative" and dtype.kind == "i":
            data[0, 2, 0] = -5
        elif spec["tokens"] == "bad mask":
            data[1, 1, 3] = 7
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data)
        n = spec["n_examples"]
        if n == "rows":
            f.attrs["n_examples"] = shape[0] if shape else 0
        elif n != "missing":
            f.attrs["n_examples"] = n
    if spec["flips"]:
        raw = bytearray(path.read_bytes())
        for where, bit in spec["flips"]:
            raw[int(where * (len(raw) - 1))] ^= 1 << bit
        path.write_bytes(raw)


def _data_dir(root: Path, spec: dict) -> Path:
    from weightstream.data.gpt_hdf5 import write_gpt_hdf5

    data_dir = root / "data"
    write_gpt_hdf5(data_dir, bytes(range(256)) * 2, seq_len=16, examples_per_file=8)  # good ones
    _write_data_file(data_dir / "data-00005-fuzzed.h5", spec)
    return data_dir


def _hdf5_section(data_dir: Path) -> dict:
    return {
        "data_processor": "GptHDF5DataProcessor",
        "data_dir": str(data_dir),
        "batch_size": 2,
        "vocab_size": 256,
        "shuffle": False,
    }


@settings(FUZZ, max_examples=60)
@given(spec=data_files())
def test_bad_data_files_are_named(tmp_path_factory, spec):
    from weightstream.data.processors import get_data_processor

    data_dir = _data_dir(tmp_path_factory.mktemp("d"), spec)
    bad = data_dir / "data-00005-fuzzed.h5"
    with deadline(30, f"reading {spec}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loader = get_data_processor("GptHDF5DataProcessor")(_hdf5_section(data_dir), True)
            for batch in loader:
                assert batch["input_ids"].dtype == torch.int64
        except ValueError as e:
            assert str(bad) in str(e), f"{spec}: {e}"
            event("ValueError naming the file")
            return
    event("read every batch")


@settings(FUZZ, max_examples=8)
@given(spec=data_files())
def test_run_on_bad_data_files_names_them(errors, tmp_path_factory, spec):
    root = tmp_path_factory.mktemp("run")
    data_dir = _data_dir(root, spec)
    params = _params(_hdf5_section(data_dir), max_steps=1)
    params_file = root / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    model_dir = root / "model_dir"
    with deadline(60, f"a run on {spec}"):
        code = _run(params_file, model_dir)
    message = errors.take()
    event(f"exit {code}")
    if code == 0:
        return  # a file that happened to be fine (or damaged where it is not read)
    assert code == 2, message
    assert str(data_dir / "data-00005-fuzzed.h5") in message, f"{spec}: {message}"
    assert not model_dir.exists(), f"{spec}: a model_dir was left behind"


def test_fuzz_helpers_compare_exactly():
    assert_same({"a": [1.0, (2, None)]}, copy.deepcopy({"a": [1.0, (2, None)]}))
    with pytest.raises(AssertionError):
        assert_same({"a": 0.0}, {"a": -0.0})
    with pytest.raises(AssertionError):
        assert_same(OrderedDict(a=1), {"a": 1})

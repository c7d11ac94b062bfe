"""Write the reference-layout H5 fixtures used by tests/test_checkpoint.py.

Run from the repository root:  .venv/bin/python tests/data/make_reference_fixtures.py

These files imitate what the reference system writes (api-reference.md
section 6, and its published saver: every leaf a root dataset named by the
URL-quoted flattened key, tagged with ``__H5_TYPE__``; bfloat16 as uint16 with
``is_bfloat16``; strings as an empty dataset with ``string_value``; None as an
empty dataset; scalars as 0-d datasets; tied weights as an HDF5 hard link;
root ``__spec__`` = hex of the pickled ``torch.utils._pytree`` TreeSpec,
``__version__`` = 0.5, ``__cstorch_version__``, ``__SUCCESS__`` = True last).
They are written with h5py directly, never with weightstream's writer, so the
reader is tested against an independent producer.

* reference_lz4.h5 and reference_gzip.h5: tensors compressed (LZ4 is HDF5
  filter 32004 from hdf5plugin, the reference default), with the tensor
  metadata attributes ``shape`` and ``dtype`` ("torch.float32").
* reference_none.h5: uncompressed, without tensor metadata attributes (the
  dtype then comes from the data and ``is_bfloat16``), bfloat16 stored as
  int16 (the reference accepts both), and a spec pickled the way dill
  pickles builtin types (``dill._dill._load_type("dict")``).
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections import OrderedDict
from pathlib import Path
from urllib.parse import quote

import h5py
import hdf5plugin
import numpy as np
import torch
from torch.utils import _pytree

HERE = Path(__file__).resolve().parent


def expected_state() -> dict:
    """The state every fixture holds (values exact in every dtype used)."""
    embedding = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
    model = OrderedDict(
        [
            ("embedding.weight", embedding),
            ("lm_head.weight", embedding),  # tied: stored once, hard-linked
            ("ln.weight", torch.tensor([1.0, 0.5, -2.0, 0.25], dtype=torch.bfloat16)),
            ("ln.bias", torch.tensor([0.5, -1.5, 3.0], dtype=torch.float16)),
            ("mask", torch.tensor([True, False, True])),
            ("position_ids", torch.arange(5, dtype=torch.int64)),
        ]
    )
    optimizer = {
        "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.full((3, 4), 0.125)}},
        "param_groups": [
            {
                "lr": 0.001,
                "betas": (0.9, 0.999),
                "eps": 1e-08,
                "params": [0],
                "foreach": None,
                "name": "decay",
            }
        ],
    }
    return {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": [{"last_epoch": 10, "_step_count": 11}],
        "global_step": 10,
        "metadata": {"model_name": "gpt2/small", "notes": None},
    }


def _flat(spec, prefix=""):
    """(flattened key, leaf index) pairs, as the reference's recurse_spec joins them."""
    if spec.is_leaf():
        yield prefix
        return
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    names = spec.context if spec.type in (dict, OrderedDict) else range(len(children))
    for name, child in zip(names, children):
        yield from _flat(child, f"{prefix}.{name}" if prefix else str(name))


def _dill_style_pickle(spec) -> bytes:
    """Pickle ``spec`` with builtin types as dill writes them (``_load_type(name)``)."""
    module = sys.modules.get("dill._dill")
    if module is None:  # dill is not installed here: a stand-in with its name
        module = types.ModuleType("dill._dill")

        def _load_type(name):
            return {"dict": dict, "list": list, "tuple": tuple}[name]

        _load_type.__module__ = "dill._dill"
        _load_type.__qualname__ = "_load_type"
        module._load_type = _load_type
        sys.modules["dill"] = types.ModuleType("dill")
        sys.modules["dill._dill"] = module
    names = {dict: "dict", list: "list", tuple: "tuple"}

    class DillStylePickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, type) and obj in names:
                return module._load_type, (names[obj],)
            return NotImplemented

    buffer = io.BytesIO()
    DillStylePickler(buffer, protocol=4).dump(spec)
    return buffer.getvalue()


def write_fixture(path: Path, compression: str | None, *, metadata_attrs: bool) -> None:
    state = expected_state()
    leaves, spec = _pytree.tree_flatten(state)
    keys = list(_flat(spec))
    assert len(keys) == len(leaves)
    if compression == "lz4":
        options = dict(hdf5plugin.LZ4())
    elif compression == "gzip":
        options = {"compression": "gzip", "compression_opts": 4}
    else:
        options = {}
    pickled = _dill_style_pickle(spec) if not metadata_attrs else pickle.dumps(spec, protocol=4)
    first_of: dict[int, str] = {}
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = pickled.hex()
        f.attrs["__version__"] = 0.5
        f.attrs["__cstorch_version__"] = "2.4.0"
        for key, value in zip(keys, leaves):
            name = quote(key, safe="")
            if isinstance(value, torch.Tensor):
                if id(value) in first_of:
                    f[name] = f[first_of[id(value)]]  # the reference's create_links
                    continue
                first_of[id(value)] = name
                if value.dtype == torch.bfloat16:
                    store = torch.int16 if not metadata_attrs else torch.uint16
                    array = value.view(store).numpy()
                else:
                    array = value.numpy()
                dset = f.create_dataset(name, data=array, **(options if array.ndim else {}))
                dset.attrs["__H5_TYPE__"] = "TorchTensorH5Type"
                dset.attrs["is_bfloat16"] = value.dtype == torch.bfloat16
                if metadata_attrs:
                    dset.attrs["shape"] = np.asarray(value.shape, dtype=np.int64)
                    dset.attrs["dtype"] = str(value.dtype)
            elif isinstance(value, str):
                dset = f.create_dataset(name, data=h5py.Empty("f"))
                dset.attrs["__H5_TYPE__"] = "StringH5Type"
                dset.attrs["string_value"] = value
            elif value is None:
                dset = f.create_dataset(name, data=h5py.Empty("f"))
                dset.attrs["__H5_TYPE__"] = "NoneH5Type"
            else:
                dset = f.create_dataset(name, data=np.array(value))
                dset.attrs["__H5_TYPE__"] = "ScalarH5Type"
        f.attrs["__SUCCESS__"] = True


def main() -> None:
    write_fixture(HERE / "reference_lz4.h5", "lz4", metadata_attrs=True)
    write_fixture(HERE / "reference_gzip.h5", "gzip", metadata_attrs=True)
    write_fixture(HERE / "reference_none.h5", None, metadata_attrs=False)
    for name in ("reference_lz4.h5", "reference_gzip.h5", "reference_none.h5"):
        print(name, (HERE / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main()

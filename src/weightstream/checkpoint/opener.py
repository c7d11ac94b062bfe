"""open_source: pick the Source class of a checkpoint file."""

from __future__ import annotations

import os
from pathlib import Path

from weightstream.checkpoint.errors import PickleNotAllowedError
from weightstream.checkpoint.reader import H5Source
from weightstream.checkpoint.safetensors_io import SafetensorsSource
from weightstream.checkpoint.source import Source, sniff_format
from weightstream.checkpoint.torchfile import TorchSource


def open_source(
    path: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    allow_incomplete: bool = False,
    mmap: bool = False,
    verify: bool = True,
) -> Source:
    """Open any supported checkpoint file for reading (arguments: see :func:`load`)."""
    path = Path(os.fspath(path))
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check the path.")
    fmt = sniff_format(path)
    if fmt == "h5":
        return H5Source(
            path,
            allow_pickle=allow_pickle,
            allow_incomplete=allow_incomplete,
            mmap=mmap,
            verify=verify,
        )
    if fmt in ("safetensors", "safetensors-sharded"):
        return SafetensorsSource(path, mmap=mmap)
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"{path} is a torch.save (pickle) file. Unpickling can run arbitrary code, so "
            "it is refused by default. If you trust the file, pass allow_pickle=True "
            "(`weightstream checkpoint` commands: --allow-pickle); better, and for "
            "`weightstream run`, convert it once to H5 or safetensors "
            "(`weightstream checkpoint convert --allow-pickle FILE OUT.mdl`)."
        )

    return TorchSource(path)

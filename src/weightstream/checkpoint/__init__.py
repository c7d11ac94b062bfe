"""Checkpoints: ``save`` / ``load`` in the H5 format, converters, trainer helpers.

``save(state_dict, path)`` writes a flattened state dict to one HDF5 file,
tensor by tensor, atomically; ``load(path)`` returns it as a lazy read-only
mapping (``map_location="cache"`` keeps what it read, ``"cpu"`` reads
everything now). The layout is in ``format.py`` (Note [checkpoint layout]);
files of the reference system load too, as do safetensors files and, with
``allow_pickle=True``, torch.save files.

Modules, by ownership: ``tree`` (tree spec, flattening), ``format`` (H5
names, dtypes, checksum), ``writer`` (atomic streaming save) with
``write_guard`` (the file HDF5 writes through), ``reader`` (H5 source) with
``h5file`` (HDF5 helpers), ``lazy`` (load and the lazy mapping),
``safetensors_io`` and ``torchfile`` (other formats), ``convert``, ``report``
(info, diff), ``trainer`` (``checkpoint_{step}.mdl`` files), ``cli`` (the command).
"""

from weightstream.checkpoint.convert import convert
from weightstream.checkpoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    PickleNotAllowedError,
)
from weightstream.checkpoint.format import FORMAT_VERSION
from weightstream.checkpoint.lazy import LazyStateDict, load
from weightstream.checkpoint.report import DiffResult, diff, info
from weightstream.checkpoint.safetensors_io import write_safetensors
from weightstream.checkpoint.torchfile import write_torch
from weightstream.checkpoint.trainer import (
    checkpoint_path,
    find_latest_checkpoint,
    is_complete_checkpoint,
    is_trainer_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    remove_stale_temporaries,
)
from weightstream.checkpoint.writer import save

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "DiffResult",
    "IncompleteCheckpointError",
    "LazyStateDict",
    "PickleNotAllowedError",
    "checkpoint_path",
    "convert",
    "diff",
    "find_latest_checkpoint",
    "info",
    "is_complete_checkpoint",
    "is_trainer_checkpoint",
    "list_checkpoints",
    "load",
    "prune_checkpoints",
    "remove_stale_temporaries",
    "save",
    "write_safetensors",
    "write_torch",
]

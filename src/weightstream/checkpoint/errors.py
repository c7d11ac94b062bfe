"""Errors raised when a checkpoint cannot be read (or written) as asked.

Every message names the file, what is wrong with it and what to do about it
(design invariant 3). The reading errors subclass ``ValueError`` because a bad
checkpoint is bad input, like a bad config value; a failed write is an
``OSError``.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, corrupt or not what the caller asked for."""


class IncompleteCheckpointError(CheckpointError):
    """The file has no ``__SUCCESS__`` marker: its save never finished."""


class CorruptCheckpointError(CheckpointError):
    """The file is truncated, has flipped bytes, or is missing a dataset."""


class PickleNotAllowedError(CheckpointError):
    """Reading this value needs unpickling, and ``allow_pickle=True`` was not given."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, file size limit, permissions).

    An ``OSError``, not a ``CheckpointError``: the input was fine, the
    environment was not. The target file is untouched (Note [atomic save]).
    """

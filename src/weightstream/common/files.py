"""Files that appear whole or not at all: one helper for every artifact written here."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary name beside ``path`` for the block to write; renamed over ``path``
    (after an fsync) when the block ends, removed if it raises. A reader, or a run
    that crashed, never sees a half-written file. Creates the parent directory.

    (Checkpoints have their own protocol, with a completion marker and a directory
    fsync: Note [atomic save] in checkpoint/writer.py.)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``text`` as the whole content of ``path``, atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)

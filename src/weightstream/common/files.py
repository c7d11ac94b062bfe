"""Files that appear whole or not at all: one helper for every file written here."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


@contextmanager
def atomic_path(target: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """A temporary name beside ``target`` for the block to write; renamed over
    ``target`` when the block ends, removed if it raises. A reader, or a run that
    crashed, never sees a half-written file.

    With ``fsync`` the data is on disk before the rename and the rename before
    the return (the directory is synced too).
    """
    target = Path(target)
    tmp = target.parent / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        yield tmp
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        fsync_path(target.parent, directory=True)


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """Flush ``path`` (a file, or a directory's entries) to the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return  # some platforms cannot open a directory; the rename is still atomic
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``text`` as the whole content of ``path`` (its directory created if need be),
    atomically (see :func:`atomic_path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine is running (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_dead_temporaries(directory: str | os.PathLike, pattern) -> list[tuple[Path, int]]:
    """Delete the files of ``directory`` whose name ``pattern`` (a compiled regex) matches
    with the writing process's pid as its first group, where that process is gone (a
    SIGKILL, or a rank stopped by its launcher, mid-write); a live one's stay. Returns
    (path, size in bytes) of each."""
    folder = Path(os.fspath(directory))
    removed = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        match = pattern.match(entry.name)
        if match and entry.is_file() and not process_alive(int(match.group(1))):
            with suppress(FileNotFoundError):
                size = entry.stat().st_size
                entry.unlink()
                removed.append((entry, size))
    return removed

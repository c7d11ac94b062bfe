"""Trainer checkpoints in a model directory: ``checkpoint_{step}.mdl`` files.

Naming, finding the newest complete one to resume from, and keeping at most
``max_checkpoints``. "Complete" means the file opens as HDF5 and has the
``__SUCCESS__`` marker (Note [atomic save]); an incomplete or damaged file is
never picked for resuming and never counted as one of the kept checkpoints,
so pruning cannot delete the last good checkpoint because a newer one is bad.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from weightstream.checkpoint.format import ATTR_SUCCESS
from weightstream.checkpoint.h5file import open_h5
from weightstream.checkpoint.lazy import load
from weightstream.checkpoint.source import sniff_format
from weightstream.common.files import remove_dead_temporaries

_NAME = re.compile(r"^checkpoint_(\d+)\.mdl$")


def checkpoint_path(model_dir: str | os.PathLike, step: int) -> Path:
    """``model_dir/checkpoint_{step}.mdl``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint_path(): step must be an int >= 0, got {step!r}.")
    return Path(os.fspath(model_dir)) / f"checkpoint_{step}.mdl"


def list_checkpoints(model_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every ``checkpoint_{step}.mdl`` in ``model_dir``, oldest first.

    Temporary files of saves in progress (or killed) never match the pattern.
    """
    directory = Path(os.fspath(model_dir))
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` opens as HDF5 and has ``__SUCCESS__`` (no data is read)."""
    try:
        with open_h5(path) as f:
            return bool(f.attrs.get(ATTR_SUCCESS, False))
    except Exception:  # any failure to open or read means: not usable
        return False


def is_trainer_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is one of our checkpoints with a ``model`` entry (read lazily)."""
    try:
        if sniff_format(Path(path)) != "h5":
            return False
        with load(path) as state:
            return isinstance(state, dict) and isinstance(state.get("model"), dict)
    except Exception:  # unreadable: the caller's own load reports what is wrong
        return False


_TEMPORARY = re.compile(r"^\.checkpoint_\d+\.mdl\.(\d+)-[0-9a-f]+\.tmp$")


def remove_stale_temporaries(model_dir: str | os.PathLike) -> list[tuple[Path, int]]:
    """Delete the temporary files of checkpoint saves whose process is gone (killed
    with SIGKILL mid-save: Note [atomic save] in checkpoint/writer.py); a live
    process's, a save under way, stay. Returns (path, size in bytes) of each."""
    return remove_dead_temporaries(model_dir, _TEMPORARY)


def find_latest_checkpoint(model_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``model_dir``, or None.

    Incomplete or unreadable ``checkpoint_*.mdl`` files are skipped with a warning.
    """
    skipped = []
    found = None
    for step, path in reversed(list_checkpoints(model_dir)):
        if is_complete_checkpoint(path):
            found = path
            break
        skipped.append((step, path))
    for step, path in skipped:
        newest = f"the newest complete one is {found.name}" if found else "no complete one is left"
        warnings.warn(
            f"skipping {path} (step {step}): it is incomplete or unreadable; {newest}. It is "
            f"kept for inspection until a run trains past step {step} and replaces it.",
            stacklevel=2,
        )
    return found


def prune_checkpoints(model_dir: str | os.PathLike, max_checkpoints: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints so that at most ``max_checkpoints`` remain.

    None keeps everything. Incomplete files are neither counted nor deleted
    (they may be a save in progress elsewhere, or evidence of a crash).
    Returns the deleted paths.
    """
    if max_checkpoints is None:
        return []
    if isinstance(max_checkpoints, bool) or not isinstance(max_checkpoints, int):
        raise ValueError(
            f"prune_checkpoints(): max_checkpoints must be a positive int or None, got "
            f"{max_checkpoints!r}."
        )
    if max_checkpoints < 1:
        raise ValueError(
            f"prune_checkpoints(): max_checkpoints={max_checkpoints} would delete every "
            "checkpoint; use a value >= 1, or None to keep them all."
        )
    complete = [path for _, path in list_checkpoints(model_dir) if is_complete_checkpoint(path)]
    removed = []
    for path in complete[: max(0, len(complete) - max_checkpoints)]:
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another process pruned it first
        removed.append(path)
    return removed

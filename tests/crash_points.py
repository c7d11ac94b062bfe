"""Crash points: named moments where a kill test freezes the run command and kills it.

Design invariant 3 says a crash at any moment leaves the newest complete
checkpoint loadable and a resumed run continues exactly. The moments that
matter most (halfway through writing a checkpoint, between its rename and the
directory fsync, in the middle of an optimizer update) last milliseconds, so a
kill timed from outside hits them only by luck. Run as

    python tests/crash_points.py <point>:<n>[@<j>] run CPU -p params.yaml ...

this script installs the point into weightstream's functions (patching them in
this process only; the library ships no crash points) and then runs the
``weightstream`` command with the remaining arguments. The n-th time (counting
from 1) the process passes the point, it stops itself with SIGSTOP: every
thread freezes at that instruction, as in a debugger, and the test
(tests/test_resume_kill.py) delivers SIGKILL to the stopped process. Nothing is
cleaned up, exactly as in a real crash. The points:

* ``save.leaf``: :func:`weightstream.checkpoint.save` wrote one more leaf into
  its temporary file (``LeafWriter.write`` returned: the file is half written);
* ``save.renamed``: the temporary file was renamed over the target, the
  directory not yet fsynced (the directory's ``fsync_path`` of the save's
  ``atomic_path``);
* ``update:<n>@<j>``: the n-th optimizer update of the process (the
  ``grad_scaler.step(optimizer)`` of the trainer's ``apply_gradients``), stopped after its j-th torch operation (default 1), so
  some parameters or optimizer states are updated and others not; at the end of
  the update if it has fewer operations. Operations are counted by a
  TorchFunctionMode, installed only for the armed update.

A process stopped by mistake continues with ``kill -CONT <pid>``; it says so on
stderr before it stops.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

POINTS = ("save.leaf", "save.renamed", "update")


def parse(spec: str) -> tuple[str, int, int]:
    """(point, n, j) of ``<point>:<n>`` or ``update:<n>@<j>``."""
    name, _, count = spec.rpartition(":")
    n, _, j = count.partition("@")
    try:
        parsed = name, int(n), int(j or 1)
    except ValueError:
        raise ValueError(
            f"crash point {spec!r}: expected <point>:<n> or update:<n>@<j>, e.g. save.leaf:3 "
            "(tests/crash_points.py)."
        ) from None
    if name not in POINTS:
        raise ValueError(f"crash point {spec!r}: unknown point {name!r}; use one of {POINTS}.")
    return parsed


def _stop(what: str) -> None:
    sys.stderr.write(
        f"weightstream: stopped at crash point {what}; resume with kill -CONT {os.getpid()}\n"
    )
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


class _Passes:
    """Counts passes of the armed point; stops the process on the n-th."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n, self.seen = name, n, 0

    def passed(self) -> bool:
        """One more pass; True on the armed one."""
        self.seen += 1
        return self.seen == self.n

    def stop(self, detail: str = "") -> None:
        _stop(f"{self.name} #{self.seen}{detail}")


@contextlib.contextmanager
def _counting_ops(passes: _Passes, j: int) -> Iterator[None]:
    """Run the block, stopping the process after its j-th torch operation (or at its end)."""
    from torch.overrides import TorchFunctionMode

    done = 0

    class _Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal done
            result = func(*args, **(kwargs or {}))
            done += 1  # after the operation: it has changed what it writes
            if done == j:
                passes.stop(f", after operation {j}")
            return result

    with _Count():
        yield
    if done < j:
        passes.stop(f", at its end (it has {done} operations)")


def _save_leaf(passes: _Passes) -> None:
    from weightstream.checkpoint import writer

    original = writer.LeafWriter.write

    @functools.wraps(original)
    def write(self, key, name, value):
        original(self, key, name, value)
        if passes.passed():
            passes.stop()

    writer.LeafWriter.write = write


def _save_renamed(passes: _Passes) -> None:
    from weightstream.checkpoint import writer
    from weightstream.common import files

    original_atomic, original_fsync = writer.atomic_path, files.fsync_path
    saving = []  # the directories of the saves under way

    @contextlib.contextmanager
    def atomic_path(target: Path, *, fsync: bool = True):
        assert fsync, "save.renamed is the moment before the directory fsync: save with fsync"
        saving.append(Path(target).parent)
        try:
            with original_atomic(target, fsync=fsync) as tmp:
                yield tmp
        finally:
            saving.pop()

    def fsync_path(path: Path, *, directory: bool = False) -> None:
        # After the rename, before the directory's fsync (common/files.py atomic_path).
        if directory and saving and Path(path) == saving[-1] and passes.passed():
            passes.stop()
        original_fsync(path, directory=directory)

    writer.atomic_path = atomic_path
    files.fsync_path = fsync_path


def _update(passes: _Passes, j: int) -> None:
    from weightstream.train import trainer

    original = trainer.apply_gradients

    @functools.wraps(original)
    def apply_gradients(optimizer, grad_scaler, *args, **kwargs):
        if not passes.passed():
            return original(optimizer, grad_scaler, *args, **kwargs)
        # The update alone is counted: the scaler's step (the trainer always has a
        # weightstream GradScaler; it steps the optimizer).
        assert grad_scaler is not None, "the trainer's step has a GradScaler"
        step: Callable = grad_scaler.step

        def counted(*a, **k):
            with _counting_ops(passes, j):
                return step(*a, **k)

        grad_scaler.step = counted
        try:
            return original(optimizer, grad_scaler, *args, **kwargs)
        finally:
            del grad_scaler.step

    trainer.apply_gradients = apply_gradients


def install(spec: str) -> None:
    """Arm the crash point ``spec`` in this process (see the module docstring)."""
    name, n, j = parse(spec)
    passes = _Passes(name, n)
    if name == "save.leaf":
        _save_leaf(passes)
    elif name == "save.renamed":
        _save_renamed(passes)
    else:
        _update(passes, j)


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: crash_points.py <point>:<n>[@<j>] <weightstream arguments>")
    install(argv[0])
    from weightstream.cli.main import main as weightstream

    return weightstream(argv[1:])


if __name__ == "__main__":
    # Run as a script, this folder leads sys.path; the tests' modules (data/, models.py)
    # must not shadow anything the run imports.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))

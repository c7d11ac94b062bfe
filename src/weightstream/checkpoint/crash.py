"""Crash points: named places where a test can freeze the process and kill it there.

# Note [crash points]

Design invariant 3 says a crash at any moment leaves the newest complete
checkpoint loadable and a resumed run continues exactly. The moments that
matter most (halfway through writing a checkpoint, between its rename and the
directory fsync, in the middle of an optimizer update) last milliseconds, so a
kill timed from outside hits them only by luck. With the environment variable

    WEIGHTSTREAM_CRASH_POINT=<name>:<n>      (or <name>:<n>@<j> for "update")

the n-th time (counting from 1) the process passes the point ``<name>``, it
stops itself with SIGSTOP: every thread freezes at that instruction, as in a
debugger, and the test (tests/test_resume_kill.py) delivers SIGKILL to the
stopped process. Nothing is cleaned up, exactly as in a real crash. The points:

* ``save.leaf``: :func:`weightstream.checkpoint.save` wrote one more leaf into
  its temporary file (the file is half written);
* ``save.renamed``: the temporary file was renamed over the target, the
  directory not yet fsynced;
* ``update``: the n-th optimizer update of the process, stopped after its j-th
  torch operation (default 1), so some parameters or optimizer states are
  updated and others not; at the end of the update if it has fewer
  operations. Counting operations needs a TorchFunctionMode, installed only
  for the armed update.

Outside those tests the variable is unset and a point costs one dict lookup.
A process stopped by mistake (the variable left set) continues with
``kill -CONT <pid>``; it says so on stderr before it stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator

ENV = "WEIGHTSTREAM_CRASH_POINT"

# Passes counted per point name, in this process.
_passes: Counter[str] = Counter()


def _armed() -> tuple[str, int, int] | None:
    """(point, n, j) of the armed pass, or None."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    name, _, count = spec.rpartition(":")
    n, _, j = count.partition("@")
    try:
        return name, int(n), int(j or 1)
    except ValueError:
        raise ValueError(
            f"{ENV}={spec!r}: expected <point>:<n> or update:<n>@<j>, e.g. save.leaf:3 (Note "
            "[crash points] in weightstream/checkpoint/crash.py); unset it outside crash tests."
        ) from None


def _stop(what: str) -> None:
    sys.stderr.write(
        f"weightstream: stopped at crash point {what} ({ENV}); "
        f"resume with kill -CONT {os.getpid()}\n"
    )
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def _is_armed_pass(name: str) -> tuple[bool, int]:
    armed = _armed()
    if armed is None or armed[0] != name:
        return False, 0
    _passes[name] += 1
    return _passes[name] == armed[1], armed[2]


def crash_point(name: str) -> None:
    """Pass the point ``name``; stop the process if it is the armed pass (see the Note)."""
    hit, _ = _is_armed_pass(name)
    if hit:
        _stop(f"{name} #{_passes[name]}")


@contextlib.contextmanager
def counting_ops(name: str) -> Iterator[None]:
    """Pass the point ``name`` (a block of torch operations); see the Note."""
    hit, j = _is_armed_pass(name)
    if not hit:
        yield
        return
    from torch.overrides import TorchFunctionMode

    what = f"{name} #{_passes[name]}"
    done = 0

    class _Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal done
            result = func(*args, **(kwargs or {}))
            done += 1  # after the operation: it has changed what it writes
            if done == j:
                _stop(f"{what}, after operation {j}")
            return result

    with _Count():
        yield
    if done < j:
        _stop(f"{what}, at its end (it has {done} operations)")

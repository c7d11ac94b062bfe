"""weightstream: train PyTorch models larger than device memory by streaming weights.

The public API follows the reference weight-streaming PyTorch API, so code
written for it runs with ``import weightstream as cstorch``.

Note [huge pages for host tensors]
----------------------------------
Training on the CPU, and the host side of training on an accelerator, makes
large host tensors afresh every step: autograd's weight gradients above all
(a 2.2B model: 8.8 GB of them a step). glibc serves every allocation over its
mmap threshold (32 MiB at most; the disk store lowers it to 128 KiB, Note
[disk tier]) with a new mapping, and the kernel faults each 4 KiB page in and
zeroes it: measured here, 40 gradients of 100 MiB made in turn took 2.8 s,
3.6 s of it kernel time, a million page faults. PyTorch's CPU allocator can
ask for transparent huge pages instead (``THP_MEM_ALLOC_ENABLE=1``: tensors
of 2 MiB and more are aligned to 2 MiB and advised ``MADV_HUGEPAGE``), 512x
fewer faults: the same loop 1.1 s. A step of the 2.2B model trained from the
disk store at 1.39x RAM went from 23.7 s to 18.0 s (median), with the same
losses (``benchmarks/larger_than_ram.py``).

PyTorch reads the setting once, at its first large allocation, so it is set
here, before anything of weightstream allocates: where the variable is unset,
on Linux. A user's own value (``THP_MEM_ALLOC_ENABLE=0``) is kept, and a
process that made large tensors before importing weightstream keeps the
allocator it had. Where the kernel's THP mode is ``never`` the advice is a
no-op.

Note [process-wide settings]
----------------------------
What a run remembers between API calls (configuration, steps, half type,
skipped steps) lives in the run context and ends with it (Note [run context] in
weightstream/context.py). Two settings cannot: they belong to the process's
allocators, and weightstream makes exactly these two, never undone:

1. ``THP_MEM_ALLOC_ENABLE=1``, at import, on Linux, where unset (Note [huge
   pages for host tensors] above). PyTorch reads it once, at its first large
   allocation; nothing can take it back afterwards.
2. glibc's mmap threshold fixed at 128 KiB (``mallopt(M_MMAP_THRESHOLD)``),
   by the first ``DiskStore`` of the process (Note [disk tier] in
   runtime/store.py), so freed gradients and device copies go back to the
   system at once. It is not undone when the last store closes, because it
   cannot be: glibc has no getter for the threshold (the value before is
   unknown), and any ``mallopt(M_MMAP_THRESHOLD)`` also turns off glibc's
   dynamic threshold (raised after each large free) for the rest of the
   process; no call turns it back on. 128 KiB is glibc's own starting value,
   so "setting the default back" would be the same call, a no-op that only
   claims a restore. What stays after the store is the fixed threshold: large
   blocks keep being mapped and unmapped rather than kept in the heap: less
   memory held, and page faults for allocations between 128 KiB and 32 MiB
   (a small model's step pays for them: gpt2_tiny_ws trains at 101 samples/s
   with a disk store against 170 in RAM; the compile estimate prices them,
   Note [fresh pages] in compiler/cost.py). A threshold the user set for glibc (``MALLOC_MMAP_THRESHOLD_``
   or ``GLIBC_TUNABLES``) is overridden by the first store.

The run command also sets what a command owning its process may (the seeds,
logging, ``OMP_NUM_THREADS`` per launched rank); the library does not.
"""

import os as _os
import sys as _sys

if _sys.platform.startswith("linux"):
    # Note [huge pages for host tensors]; Note [process-wide settings]
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from weightstream import amp, metrics, optim, utils
from weightstream.backend import CompiledModule, ExecutionMode
from weightstream.checkpoint import load, save
from weightstream.common.version import __version__
from weightstream.compiler.api_compile import compile
from weightstream.context import configure
from weightstream.executor import checkpoint_closure, compile_step, step_closure
from weightstream.runtime.config import StreamingConfig

__all__ = [
    "CompiledModule",
    "ExecutionMode",
    "StreamingConfig",
    "__version__",
    "amp",
    "checkpoint_closure",
    "compile_step",
    "load",
    "metrics",
    "optim",
    "save",
    "step_closure",
    "utils",
    "compile",
    "configure",
]

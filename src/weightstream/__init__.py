"""weightstream: train PyTorch models larger than device memory by streaming weights.

The public API follows the reference weight-streaming PyTorch API, so code
written for it runs with ``import weightstream as cstorch``.
"""

from weightstream import amp, metrics, optim, utils
from weightstream.backend import CompiledModule, ExecutionMode, compile
from weightstream.checkpoint import load, save
from weightstream.common.version import __version__
from weightstream.config import configure
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

"""weightstream: train PyTorch models larger than device memory by streaming weights.

The public API follows the reference weight-streaming PyTorch API, so code
written for it runs with ``import weightstream as cstorch``.
"""

from weightstream import amp, metrics, optim, utils
from weightstream.backend import CompiledModule, ExecutionMode, compile
from weightstream.checkpoint import load, save
from weightstream.config import configure
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.executor import checkpoint_closure, compile_step, step_closure

__version__ = "0.1.0"

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

"""``compile(model, backend=...)``: choose how a model runs.

Backends (names are case-insensitive):

* weight streaming: ``"WSE_WS"``, ``"wse_ws"``, ``"ws"``;
* layer pipelined (whole model resident on the compute device): ``"WSE_LP"``, ``"lp"``;
* plain eager PyTorch on a device: ``"cpu"``, ``"gpu"`` (CUDA).

The compute device of the WS and LP backends is CUDA when available and the
CPU otherwise; pass ``device=`` to choose.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from weightstream.amp import step_helper
from weightstream.amp.half import half_dtype_setting
from weightstream.common.schema import MASTER_DTYPE_HINT
from weightstream.common.units import format_bytes
from weightstream.executor import StepNotRun, only_compiling, step_context
from weightstream.optim.binding import hosts
from weightstream.runtime import swarm
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.engine import StreamingEngine
from weightstream.runtime.recompute import UnitForward, checkpoint_units, without_cache

log = logging.getLogger("weightstream")


class ExecutionMode(enum.Enum):
    WEIGHT_STREAMING = "weight_streaming"
    LAYER_PIPELINED = "layer_pipelined"
    EAGER = "eager"


_BACKENDS = {
    "wse_ws": ExecutionMode.WEIGHT_STREAMING,
    "ws": ExecutionMode.WEIGHT_STREAMING,
    "wse_lp": ExecutionMode.LAYER_PIPELINED,
    "lp": ExecutionMode.LAYER_PIPELINED,
    "cpu": ExecutionMode.EAGER,
    "gpu": ExecutionMode.EAGER,
}
VALID_BACKENDS = ("WSE_WS", "wse_ws", "ws", "WSE_LP", "wse_lp", "lp", "cpu", "gpu")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_backend(backend: str) -> tuple[ExecutionMode, str]:
    if not isinstance(backend, str) or backend.lower() not in _BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; valid backends are: {', '.join(VALID_BACKENDS)} "
            "(weight streaming: WSE_WS / wse_ws / ws; layer pipelined: WSE_LP / wse_lp / lp; "
            "eager: cpu / gpu)."
        )
    return _BACKENDS[backend.lower()], backend.lower()


class CompiledModule(nn.Module):
    """The module returned by :func:`compile`; call it like the original.

    Parameters, buffers and state dicts are the original module's, without any
    prefix, so ``compiled.state_dict()`` equals ``model.state_dict()`` and an
    optimizer may be given either's parameters (in weight streaming they are
    the host masters in the store).
    """

    def __init__(
        self,
        module: nn.Module,
        mode: ExecutionMode,
        device: torch.device,
        engine=None,
        on_meta: bool = False,
        reducer: swarm.GradientReducer | None = None,
        checkpointed: list[UnitForward] | None = None,
    ):
        super().__init__()
        self._orig_mod = module
        self.mode = mode
        self.device = device
        self._engine = engine
        # Layer pipelined with activation_checkpointing: the units' checkpointed
        # forwards (weight streaming: the engine's streamer owns them).
        self._checkpointed = checkpointed or []
        self._on_meta = on_meta
        # Layer pipelined under data parallel: SwarmX's reduce of the resident
        # parameters' gradients (weight streaming: the engine's own).
        self._reducer = reducer
        # Set by the public ``cstorch.compile`` (compiler/api_compile.py): writes the
        # compile directory of a compile_only run's step; what it did, in words.
        self.on_compile_only: Callable[[CompiledModule, tuple, dict], str] | None = None

    @property
    def engine(self) -> StreamingEngine | None:
        """The streaming engine (weight streaming only)."""
        return self._engine

    @property
    def plan(self):
        return None if self._engine is None else self._engine.plan

    @property
    def recomputed_modules(self) -> list[nn.Module]:
        """Layer pipelined with activation checkpointing: the modules whose forward runs
        again in the backward (weight streaming: ``engine.streamer.recompute``)."""
        return [w.module for w in self._checkpointed]

    def no_sync(self):
        """Backwards inside accumulate gradients locally; SwarmX reduces at the first
        backward outside (all micro-batches of a step but the last; Note [swarm reduce])."""
        if self._engine is not None:
            return self._engine.no_sync()
        if self._reducer is not None:
            return self._reducer.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` by the whole model's
        norm, also where a sharded store spreads the gradients over the ranks (as FSDP1's
        method of the same name; Note [changed after the reduce] in runtime/swarm.py).
        Collective under data parallel: every rank calls it. Returns the total norm."""
        params = [p for p in self.parameters() if p.grad is not None]
        return step_helper.clip_grad_norm_(
            params,
            max_norm,
            self._engine,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
        )

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)``, which a
        sharded store accepts between the reduce and the step."""
        params = [p for p in self.parameters() if p.grad is not None]
        step_helper.clip_grad_value_(params, clip_value, self._engine)

    def close(self) -> None:
        """Release the engine's threads, hooks and files (the model stays usable eagerly)."""
        if self._engine is not None:
            self._engine.close()
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        for wrapper in self._checkpointed:
            wrapper.remove()
        self._checkpointed = []

    def forward(self, *args, **kwargs):
        if (mode := only_compiling()) is not None and step_context().in_step:
            raise StepNotRun(mode, self._compile_without_running(mode, args, kwargs))
        if self._engine is not None:
            return self._engine(*args, **kwargs)
        if self._on_meta:
            raise RuntimeError(
                f"the model was compiled for {self.mode.value} with its weights on the meta "
                "device (shapes only), so it cannot run. Fix: build it on the CPU, or use "
                "weight streaming (backend 'wse_ws') with store='disk', which materializes a "
                "meta model in its files."
            )
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(self.device, non_blocking=True), (args, kwargs)
        )
        if self._checkpointed:
            kwargs = without_cache(self._orig_mod, kwargs)
        return self._orig_mod(*args, **kwargs)

    def _compile_without_running(self, mode: str, args: tuple, kwargs: dict) -> str:
        """Plan the model for this batch, as a compile_only step does, and (compile_only)
        write its compile directory (Note [compile only] in weightstream/executor.py);
        what was done, in words."""
        if self._engine is None:
            execution = self.mode.value.replace("_", " ")
            what = f"the model is compiled for {execution} execution (resident: nothing to plan)"
        else:
            plan = self._engine.prepare(*args, **kwargs)
            log.info("Streaming plan: %d units\n%s", len(plan.units), plan.describe())
            log.info("Training state: %s", self._engine.describe_tiers())
            what = (
                f"the model is planned for weight streaming in {len(plan.units)} units, the "
                f"largest {format_bytes(plan.largest_unit_bytes)} of weights"
            )
        if mode == "compile_only" and self.on_compile_only is not None:
            what += "; " + self.on_compile_only(self, args, kwargs)
        return what

    # The original module's view of its own state, without the wrapper prefix.
    def state_dict(self, *args, **kwargs):
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._orig_mod.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        return self._orig_mod.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._orig_mod.named_buffers(prefix, recurse, remove_duplicate)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def compile(
    model: nn.Module,
    backend: str = "wse_ws",
    *,
    device: torch.device | str | None = None,
    streaming: StreamingConfig | None = None,
    **streaming_kwargs,
) -> CompiledModule:
    """Prepare ``model`` to run in the chosen execution mode.

    Like ``torch.compile``, nothing is compiled yet: the weight-streaming plan
    is fixed at the first call, when the batch shape is known.

    Args:
        model: any ``nn.Module``.
        backend: see the module docstring; an unknown name lists the valid ones.
        device: the compute device (default: CUDA if available, else CPU; ``"gpu"``
            means CUDA).
        streaming: a :class:`StreamingConfig`; or give its fields as keyword
            arguments (``prefetch_depth=2, granularity="module"``). Layer pipelined
            takes ``activation_checkpointing`` (applied to the units the config's
            settings choose) and nothing else of it.
    """
    mode, name = resolve_backend(backend)
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile() expects a torch.nn.Module, got {type(model).__name__}.")
    if hosts.holding(model.parameters()) is not None:
        raise ValueError(
            "this module is compiled for weight streaming already: an earlier "
            "cstorch.compile() holds its parameters (its store, hooks and optimizer "
            "binding). Reuse the module that call returned (it runs training and eval "
            "alike), or call its close() first to compile the module again."
        )
    if "master_dtype" in streaming_kwargs:
        raise TypeError(f"compile(): {MASTER_DTYPE_HINT}")
    if streaming is not None and streaming_kwargs:
        raise TypeError("pass either streaming=StreamingConfig(...) or its fields, not both.")
    if mode is ExecutionMode.LAYER_PIPELINED and "activation_checkpointing" in streaming_kwargs:
        value = streaming_kwargs.pop("activation_checkpointing")
        streaming = StreamingConfig.from_kwargs(activation_checkpointing=value)
    if streaming_kwargs and mode is not ExecutionMode.WEIGHT_STREAMING:
        lp = mode is ExecutionMode.LAYER_PIPELINED
        only = " (of them it takes activation_checkpointing)" if lp else ""
        raise TypeError(
            f"streaming options {sorted(streaming_kwargs)} apply only to weight streaming "
            f"(backend 'wse_ws'); backend {backend!r} does not stream{only}."
        )
    if device is None:  # the eager backends name their device
        device = {"gpu": "cuda", "cpu": "cpu"}.get(name) or default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "a CUDA device was requested but torch.cuda.is_available() is False; use "
            "backend 'cpu' or pass device='cpu'."
        )
    if mode is ExecutionMode.WEIGHT_STREAMING:
        config = streaming or StreamingConfig.from_kwargs(**streaming_kwargs)
        if config.compute_dtype == "cbfloat16" and half_dtype_setting.name != "cbfloat16":
            warnings.warn(
                "weightstream: compute_dtype='cbfloat16', but the run's half type is "
                f"{half_dtype_setting.name}, so a GradScaler built now takes its defaults (a "
                "dynamic loss scale of at most 2**15, not cbfloat16's 2**31). Fix: call "
                "cstorch.amp.set_half_dtype('cbfloat16') first, as the reference API does "
                "before the model is built.",
                stacklevel=2,
            )
        engine = StreamingEngine(model, device, config)  # joins the ranks by itself
        return CompiledModule(model, mode, device, engine)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        # Shapes only (a model too large to build, traced to validate or plan it):
        # nothing to move, and running it is refused with a message.
        return CompiledModule(model, mode, device, on_meta=True)
    model.to(device)
    checkpointed = None
    checkpointing = streaming is not None and streaming.activation_checkpointing
    if mode is ExecutionMode.EAGER and checkpointing:
        warnings.warn(
            f"activation_checkpointing is ignored by backend {backend!r}, which runs the "
            "model as it is. Fix: use backend 'wse_ws' or 'wse_lp', or leave it False.",
            stacklevel=2,
        )
    if mode is ExecutionMode.LAYER_PIPELINED and checkpointing:
        # The units weight streaming would recompute, recomputed here with their
        # weights resident (Note [activation checkpointing] in runtime/recompute.py).
        checkpointed = checkpoint_units(model, streaming)
    reducer = None
    if (
        mode is ExecutionMode.LAYER_PIPELINED
        and swarm.init_from_env(device)
        and swarm.world_size() > 1
    ):
        # Data parallel under torchrun: every rank starts from rank 0's weights and
        # SwarmX averages the gradients in each backward (Note [swarm reduce]).
        swarm.broadcast_module(model)
        reducer = swarm.GradientReducer(swarm.resident_buckets(list(model.parameters())))
    return CompiledModule(model, mode, device, reducer=reducer, checkpointed=checkpointed)

"""The base class of every weightstream optimizer.

Note [preinitialized state]
---------------------------
torch.optim creates an optimizer's state lazily, inside the first ``step()``.
Here every state tensor is created by ``preinitialize()`` during construction
instead, because:

* the host weight store sizes and lays out a parameter's state when the
  parameter is registered, long before the first gradient arrives;
* a checkpoint written before the first step already holds the complete
  state, so "resume at step 0" and "resume at step N" take the same path;
* ``load_state_dict`` can copy into tensors that already exist, keeping
  their dtype, device and identity (see :meth:`Optimizer.load_state_dict`).

``step()`` may therefore only update state, never create it.

Note [matching torch.optim bit for bit]
---------------------------------------
Where torch.optim has the same algorithm, a weightstream optimizer performs the
same floating-point operations in the same order as torch's single-tensor
implementation (the one plain eager PyTorch uses on CPU), so parameters match
bitwise (design invariant 1, pinned by tests/test_optim.py). Concretely:

* the per-element work uses ``torch._foreach_*`` ops. On CPU these run the very
  same kernel per tensor as the single-tensor code, with one Python call per
  parameter list instead of one per parameter;
* step-dependent scalars (bias corrections, decayed learning rates) are
  computed in Python double precision from the float32 ``step`` tensor, just as
  torch does, and passed to the kernels as Python numbers;
* torch's fused CPU kernels (``fused=True``) are not used: they are faster but
  round differently (measured: up to 5e-7 apart from the eager result after 50
  Adam/SGD steps).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch import Tensor

from weightstream.common.pages import release_pages
from weightstream.optim.binding import ParameterHost, StateSizes, hosts, placing_state

__all__ = ["Optimizer", "ParamsT"]

ParamsT: TypeAlias = Iterable[Tensor] | Iterable[dict[str, Any]]


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """Evaluate the loss closure with autograd on (``step`` itself runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Optimizer(torch.optim.Optimizer, abc.ABC):
    """Base class of weightstream optimizers (``cstorch.optim.Optimizer``).

    Subclasses implement three methods:

    * ``preinitialize()`` creates every state tensor (Note [preinitialized state]);
    * ``step(closure=None)`` updates parameters and state;
    * ``state_names_to_sparsify()`` names the state tensors shaped like their
      parameter, which follow the parameter's sparsity mask.

    Args:
        params: parameters, or dicts defining parameter groups. A group may carry
            ``tags``, a set of strings that schedulers use to select groups.
        defaults: default hyperparameters of a group.
        enable_global_step: give every parameter a ``state[p]["step"]`` float32
            scalar tensor counting the steps that updated it.
    """

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        enable_global_step: bool = False,
    ) -> None:
        # Set before torch's __init__, which calls add_param_group for each group.
        self.enable_global_step = enable_global_step
        self._preinitialized = False
        self._stepped = False  # a step ran or a state was loaded (Note [state after a cast])
        # id(parameter) -> the dtype its state was made for (Note [state after a cast])
        self._made_for: dict[int, torch.dtype] = {}
        self._engine: ParameterHost | None = None
        super().__init__(params, defaults)
        # Bound before any state exists, so the engine places it (Note [engine binding]).
        self._engine = hosts.holding(self._all_params())
        self._create_state()
        self._preinitialized = True
        if self._engine is not None:
            # Known to the engine, which moves this state with the units it places on
            # the device (Note [device tier] in runtime/placement.py).
            self._engine.bind_optimizer(self)

    # ------------------------------------------------------------------ abstract

    @abc.abstractmethod
    def preinitialize(self) -> None:
        """Create every state tensor of every parameter in ``self.param_groups``."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Update the parameters from their gradients; create no state.

        Subclasses implement :meth:`_update` (or override ``step`` itself, as in
        the reference API). When the parameters are the masters of a streaming
        engine with overlapped updates, the update is applied unit by unit
        behind the next forward (Note [overlapped updates] in runtime/updater.py).
        """
        loss = run_closure(closure)
        self._follow_parameters()
        self._stepped = True
        engine = self.engine
        if engine is not None:
            engine.apply_step(self)
        else:
            self._update(self.param_groups)
        return loss

    def _update(self, groups: list[dict[str, Any]]) -> None:
        """Apply one step to the parameters of ``groups`` (copies of param_groups)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement step() or _update(groups)."
        )

    @property
    def engine(self) -> ParameterHost | None:
        """The streaming engine whose masters this optimizer updates (Note [engine binding]).

        Bound at construction; an optimizer built before ``cstorch.compile`` is
        bound here, the first time anything asks, and its state moves into the
        engine's placement then.
        """
        if self._engine is None:
            engine = hosts.holding(self._all_params())
            if engine is not None:
                self._follow_parameters()  # before the engine places the state
                engine.bind_optimizer(self)
                self._engine = engine
        return self._engine

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def synchronize(self) -> None:
        """Wait for an overlapped step still being applied (a no-op otherwise)."""
        engine = self.engine
        if engine is not None:
            engine.synchronize()

    @abc.abstractmethod
    def state_names_to_sparsify(self) -> list[str]:
        """Names of the state tensors that follow a parameter's sparsity mask."""

    # ------------------------------------------------------------------- groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its state is created at once (not at its first step)."""
        if "tags" in param_group:
            param_group["tags"] = _normalize_tags(param_group["tags"])
        super().add_param_group(param_group)
        if self._preinitialized:
            self._create_state_of({id(p) for p in param_group["params"]})
            if self._engine is not None:
                self._engine.bind_optimizer(self)

    def _create_state(self) -> None:
        """The state of every trainable parameter (Note [state after a cast])."""
        for p in self._all_params():
            if not p.is_floating_point():
                raise TypeError(
                    f"{type(self).__name__} updates real floating-point parameters, but got "
                    f"a parameter of dtype {p.dtype} and shape {tuple(p.shape)}. "
                    "Fix: leave integer/complex tensors out of the optimizer's params."
                )
        if self._engine is not None and not self._preinitialized:
            sizes = self._state_sizes()
            if sizes is not None:
                self._engine.plan_state(sizes)
        with torch.no_grad(), placing_state(self._engine), self._showing(self._trainable):
            self.preinitialize()
            for p in self._all_params():
                if self.enable_global_step and "step" not in self.state[p]:
                    self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                self._made_for[id(p)] = p.dtype

    @staticmethod
    def _trainable(p: Tensor) -> bool:
        return p.requires_grad

    @contextlib.contextmanager
    def _showing(self, keep: Callable[[Tensor], bool]):
        """``self.param_groups`` narrowed to the parameters ``keep`` takes, for
        ``preinitialize``, which walks them all (groups without any are left out)."""
        all_groups = self.param_groups
        self.param_groups = [
            {**g, "params": kept}
            for g in all_groups
            if (kept := [p for p in g["params"] if keep(p)])
        ]
        try:
            yield
        finally:
            self.param_groups = all_groups

    def _create_state_of(self, ids: set[int]) -> None:
        """Create the state of the parameters ``ids`` alone, leaving the others' as it is."""
        with self._showing(lambda p: id(p) in ids):
            self._create_state()

    # Note [state after a cast]
    # -------------------------
    # State is made when the optimizer is built (Note [preinitialized state]), for the
    # parameters that train then, in their dtype then. torch.optim makes it at the
    # first step instead, so code written for it may build the optimizer first and then
    # cast the model (``model.to(torch.bfloat16)``) or unfreeze parameters. Before a
    # step each parameter's state is checked against it: a parameter whose dtype changed
    # gets its state made again (fresh state, as torch's would be: a bf16 master then
    # gets its Kahan buffer and moments of the state_dtype, where fp32 state would have
    # rounded away updates below half a bf16 ulp), and one that trains now but did
    # not then gets its state made. Frozen parameters (``requires_grad=False``, a LoRA
    # base model's) get none, as in torch: zeros of 8 bytes a parameter otherwise,
    # held and checkpointed. A dtype changed after state took a step, or after the
    # streaming engine placed it, is an error: fresh state would lose the moments.

    def _follow_parameters(self) -> None:
        """Make the state of parameters cast or unfrozen since it was made (Note [state
        after a cast])."""
        params = self._all_params()
        cast = [p for p in params if id(p) in self._made_for and self._made_for[id(p)] != p.dtype]
        new = [p for p in params if p.requires_grad and id(p) not in self._made_for]
        if not cast and not new:
            return
        if cast and (self._stepped or self._engine is not None):
            p = cast[0]
            when = "took a step" if self._stepped else "was placed by the streaming engine"
            raise TypeError(
                f"{type(self).__name__}: {len(cast)} parameter(s) changed dtype (one of shape "
                f"{tuple(p.shape)}: {self._made_for[id(p)]} -> {p.dtype}) after the "
                f"optimizer's state {when}. Fix: cast the model (model.to(dtype)) before "
                "building the optimizer and compiling it."
            )
        for p in cast:
            self.state.pop(p, None)
        self._create_state_of({id(p) for p in cast + new})
        if new and self._engine is not None:
            self._engine.bind_optimizer(self)  # places the new state as add_param_group does

    def _state_sizes(self) -> dict[Tensor, list[int]] | None:
        """The bytes of every parameter's state tensors as ``preinitialize`` makes them,
        counted on the meta device (nothing allocated), for the engine to place them by
        (a disk store's RAM tier: Note [hybrid placement]). None where the state is not
        made of zeros alone (an initial value computed from the parameter)."""
        saved, counter = self.state, StateSizes()
        self.state = collections.defaultdict(dict)
        try:
            with torch.no_grad(), placing_state(counter), self._showing(self._trainable):
                self.preinitialize()
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return None
        finally:
            self.state = saved
        return {p: counter.sizes.get(id(p), []) for p in self._all_params()}

    # --------------------------------------------------------------- global step

    def increment_global_step(self, p: Tensor) -> Tensor:
        """Add one to ``state[p]["step"]`` and return that float32 tensor."""
        return self._advance_step_tensors([p])[0]

    def _advance_steps(self, params: list[Tensor]) -> list[float]:
        """Increment the step of each parameter; return the new values as Python floats.

        Reading the values is a host sync on an accelerator; on the CPU host
        store it is a plain read. torch.optim reads them the same way (``.item()``)
        so that step-dependent scalars are computed in double precision.
        """
        return [s.item() for s in self._advance_step_tensors(params)]

    def _advance_step_tensors(self, params: list[Tensor]) -> list[Tensor]:
        try:
            steps = [self.state[p]["step"] for p in params]
        except KeyError:
            raise ValueError(
                f"{type(self).__name__} reads the global step, but a parameter has no "
                "state['step']. Fix: pass enable_global_step=True to Optimizer.__init__."
            ) from None
        if steps:
            torch._foreach_add_(steps, 1.0)
        return steps

    # --------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's format. On a sharded store every rank takes part and gets the
        whole state, never the placeholders of parameters owned elsewhere."""
        self.synchronize()  # the state of an overlapped step must be complete
        state = super().state_dict()
        engine = self.engine
        if engine is not None and engine.grads_sharded:
            state = engine.gather_optimizer_state(self, state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (torch's format).

        The state is checked against the preinitialized state before anything
        changes: every state tensor this optimizer has must be present with the
        same shape. Values are then copied into the preinitialized tensors, which
        keeps their dtype and device (torch would cast scalar state such as
        ASGD's ``eta`` to the parameter dtype) and their identity. Hyperparameters
        of the groups come from the state dict, as in torch.
        """
        self.synchronize()  # never load under a step still being applied
        self._follow_parameters()  # the state to load into, in the parameters' dtypes
        engine = self.engine
        if engine is not None and engine.grads_sharded:
            # Each rank keeps the state of the parameters it owns (Note [sharded store]).
            engine.load_optimizer_state(self, state_dict, self._load_state_dict)
        else:
            self._load_state_dict(state_dict)
        self._stepped = True  # loaded moments: a cast now would lose them

    def _load_state_dict(self, state_dict: dict[str, Any], skip=None) -> None:
        """Check, then load: see :meth:`load_state_dict` and Note [bounded loads].

        ``skip(p)``: parameters whose state stays as it is (a sharded store's
        placeholders of parameters other ranks own); their shapes are checked.
        """
        index_to_param = self._map_saved_indices(state_dict)
        kept = self._check_saved_groups(state_dict["param_groups"])
        groups_before = [set(g) for g in self.param_groups]
        saved_state = state_dict.get("state", {})
        for index, p in index_to_param.items():
            saved = saved_state.get(index, {})
            for key, current in self.state[p].items():
                if not isinstance(current, Tensor) or self._load_converts(saved, key):
                    continue
                shape, dtype = _saved_leaf(saved, key)
                if shape is None:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the state dict has no tensor "
                        f"{key!r} for parameter {index} (shape {tuple(p.shape)}); it was saved "
                        "by an optimizer with different settings (e.g. amsgrad, momentum, "
                        "centered), or by one that creates state lazily (torch.optim before "
                        "its first step). Fix: construct the optimizer with the settings it "
                        "was saved with."
                    )
                if shape != tuple(current.shape):
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: state {key!r} of parameter "
                        f"{index} has shape {shape} in the state dict but "
                        f"{tuple(current.shape)} here. Fix: load the state dict into an "
                        "optimizer over the same model parameters, in the same order."
                    )
                if dtype is not None and dtype.is_floating_point != current.is_floating_point():
                    # Copied, an int8 code would become a moment ~100x too large
                    # (Note [loading another state format]).
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: state {key!r} of parameter "
                        f"{index} is {dtype} in the state dict but {current.dtype} here, and "
                        f"{type(self).__name__} does not convert it: it was saved by another "
                        "optimizer, or another state format of one. Fix: construct the "
                        "optimizer (and its state_dtype) it was saved with."
                    )
        preinitialized = {p: dict(self.state[p]) for p in index_to_param.values()}
        dropped_kahan = False
        # torch sets the hyperparameters and the non-tensor state; the tensors it
        # takes are views of a lazily read file, or its dtype casts of them.
        super().load_state_dict(state_dict)
        for group, values, before in zip(self.param_groups, kept, groups_before):
            group.update(values)  # torch's load drops what the state dict lacks
            for key in self._TORCH_IMPLEMENTATION_KEYS - before:
                group.pop(key, None)  # torch.optim's, which this optimizer does not have
        with torch.no_grad():
            for index, p in index_to_param.items():
                loaded = self.state[p]
                for key, tensor in preinitialized[p].items():
                    if not isinstance(tensor, Tensor):
                        continue
                    if (skip is None or not skip(p)) and self._load_converts(
                        saved_state.get(index, {}), key
                    ):
                        self._load_converted(preinitialized[p], saved_state[index], key)
                    elif skip is None or not skip(p):
                        value = loaded.get(key)
                        if not (isinstance(value, Tensor) and value.dtype == tensor.dtype):
                            # torch cast it to another dtype: copy from the saved value.
                            value = saved_state[index][key]
                        tensor.copy_(value)
                        # One tensor at a time in memory (Note [bounded loads]).
                        release_pages([tensor, value])
                        del value
                    loaded[key] = tensor
                # Saved tensors of another state format (an int8 moment's scales, a
                # Kahan buffer this optimizer does not keep) go: left in the state they
                # would be saved again, and read as this format's by a later load.
                for key in [k for k, v in loaded.items() if isinstance(v, Tensor)]:
                    if key not in preinitialized[p]:
                        del loaded[key]
                        dropped_kahan = dropped_kahan or key == "kahan_comp"
        if dropped_kahan:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the state dict's Kahan buffers (the "
                "rounding residuals of low-precision masters, each below half an ulp of its "
                "weight) are dropped: these parameters keep none (float32 masters). The "
                "weights go on from their low-precision values.",
                stacklevel=3,
            )

    # Note [loading another state format]
    # -----------------------------------
    # A checkpoint's optimizer state may be of another format than the optimizer
    # loading it: the Adam family's moments in float32, bfloat16 or int8 codes with
    # scales (Note [compact optimizer state] in optim/compact.py), a Kahan buffer kept
    # or not (Note [Kahan summation]), as when a run resumes with another state_dtype
    # or master_dtype. Floating formats load by a dtype cast, as torch's own load
    # does; a state the optimizer keeps and the checkpoint has in no castable form
    # is converted here (``_load_converts`` says which, ``_load_converted`` does it):
    # a Kahan buffer the checkpoint lacks starts at zero (no rounding residual
    # known), and the Adam family decodes and re-encodes moments into or out of int8
    # codes. An int8 code copied as a number would be a moment 100x too large.

    def _load_converts(self, saved: Any, key: str) -> bool:
        """Whether state ``key`` loads by conversion from ``saved`` (one parameter's
        saved state), not by a copy (Note [loading another state format])."""
        return key == "kahan_comp" and key not in saved

    def _load_converted(self, state: dict[str, Any], saved: Any, key: str) -> None:
        """Set ``state[key]`` (preinitialized tensors) from ``saved`` in its format."""
        assert key == "kahan_comp", key
        state[key].zero_()

    # Keys of a saved group that are not hyperparameters of the optimizer that saved it:
    # what an LR scheduler adds to the groups, which a run may build after the load.
    _SCHEDULER_GROUP_KEYS = frozenset({"initial_lr"})
    # torch.optim's choices of implementation, not of arithmetic: a torch.optim state dict
    # of the same algorithm loads (they are dropped where this optimizer has none).
    _TORCH_IMPLEMENTATION_KEYS = frozenset({"foreach", "capturable", "differentiable", "fused"})

    def _check_saved_groups(self, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Refuse groups saved by an optimizer of other hyperparameters (another
        optimizer: loaded, an AdamW's ``eps`` and ``amsgrad`` would sit in a Lion's
        groups and its moments in Lion's state). Returns, per group, this optimizer's
        values of the hyperparameters the state dict does not record (one added since it
        was saved), which the load keeps with a warning."""
        kept = []
        for number, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            foreign = sorted(
                set(saved)
                - set(group)
                - {"params"}
                - self._SCHEDULER_GROUP_KEYS
                - self._TORCH_IMPLEMENTATION_KEYS
            )
            if foreign:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: group {number} of the state dict "
                    f"has hyperparameters {foreign}, which {type(self).__name__} does not "
                    "have: it was saved by another optimizer. Fix: construct the optimizer "
                    "it was saved with (the params file's optimizer_type), or start from "
                    "the model weights alone."
                )
            missing = {
                k: v for k, v in group.items()
                if k not in saved and k != "params" and k not in self._SCHEDULER_GROUP_KEYS
            }  # fmt: skip
            if missing:
                warnings.warn(
                    f"{type(self).__name__}.load_state_dict: group {number} of the state dict "
                    f"does not record {sorted(missing)}; this optimizer's values are kept.",
                    stacklevel=4,
                )
            kept.append(missing)
        return kept

    def _map_saved_indices(self, state_dict: dict[str, Any]) -> dict[Any, Tensor]:
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects a dict with 'state' and "
                "'param_groups', as returned by optimizer.state_dict()."
            )
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state dict has "
                f"{len(saved_groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}. Fix: build the optimizer with the same groups."
            )
        mapping: dict[Any, Tensor] = {}
        for number, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: group {number} has "
                    f"{len(saved['params'])} parameters in the state dict but "
                    f"{len(group['params'])} here. Fix: build the optimizer with the same groups."
                )
            mapping.update(zip(saved["params"], group["params"]))
        return mapping


def _normalize_tags(tags: Any) -> set[str]:
    """``"a"`` -> ``{"a"}``; lists, tuples and sets -> set; anything else is an error."""
    if isinstance(tags, str):
        tags = {tags}
    elif isinstance(tags, (list, tuple, set, frozenset)):
        tags = set(tags)
    else:
        raise TypeError(
            f"param group 'tags' must be a string or a set of strings, got {type(tags).__name__}."
        )
    bad = [t for t in tags if not isinstance(t, str)]
    if bad:
        raise TypeError(f"param group 'tags' must contain strings only, got {bad!r}.")
    return tags


def _saved_leaf(saved: Any, key: str) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    """The shape and dtype of tensor ``saved[key]``, (None, None) if it is not a tensor;
    a lazily loaded checkpoint tells them without reading the data."""
    describe = getattr(saved, "describe", None)
    if describe is not None:
        if key not in saved:
            return None, None
        try:
            info = describe(key)
        except TypeError:  # a container
            return None, None
        if info.kind == "tensor" and info.shape is not None:
            dtype = getattr(torch, str(info.dtype).removeprefix("torch."), None)
            return tuple(info.shape), dtype if isinstance(dtype, torch.dtype) else None
    value = saved.get(key) if isinstance(saved, dict) else None
    if isinstance(value, Tensor):
        return tuple(value.shape), value.dtype
    return None, None

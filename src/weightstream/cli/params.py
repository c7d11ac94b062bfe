"""The params file of ``weightstream run``: a tree of typed, validated dataclasses.

A params file is YAML with up to five top-level sections (api-reference section 8)::

    train_input / eval_input -> InputParams      (data processor and loader settings)
    model                    -> ModelParams      (a registry model, its config, precision)
    optimizer                -> OptimizerParams  (optimizer, lr schedule, clipping, loss scaling)
    runconfig                -> RunConfigParams  (steps, checkpoints, logging, cluster, execution)

YAML only deserializes (:func:`load_params` gives a plain dict); every check lives in
the dataclasses' ``__post_init__``, so a Params built in Python is checked exactly
like one read from a file. :func:`parse_params` turns the dict into :class:`Params`
and checks what the mode needs; :func:`apply_overrides` lets command-line values win
over the file; :meth:`Params.to_dict` gives the plain dict written back into
model_dir, which :func:`parse_params` reads back to the same settings.

Errors follow the project convention: TypeError for a value of the wrong type,
ValueError for a wrong value, an unknown key or a missing section; every message
names ``section.key``, what is expected, what was given and how to fix it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import math
import re
import reprlib
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = [
    "EXECUTION_MODES",
    "FP16_TYPES",
    "MODES",
    "OVERRIDE_KEYS",
    "SECTIONS",
    "InputParams",
    "ModelParams",
    "OptimizerParams",
    "Params",
    "RunConfigParams",
    "apply_overrides",
    "load_params",
    "parse_params",
    "save_params",
]

MODES = ("train", "eval", "train_and_eval", "eval_all")
SECTIONS = ("train_input", "eval_input", "model", "optimizer", "runconfig")
FP16_TYPES = ("float16", "bfloat16", "cbfloat16")
EXECUTION_MODES = ("weight_streaming", "layer_pipelined")

# Sections each mode cannot run without; the step count for training is checked apart.
_REQUIRED_SECTIONS = {
    "train": ("train_input", "model", "optimizer"),
    "eval": ("eval_input", "model"),
    "train_and_eval": ("train_input", "eval_input", "model", "optimizer"),
    "eval_all": ("eval_input", "model"),
}

# runconfig keys a command-line flag of the same name overrides (model_dir included).
OVERRIDE_KEYS = (
    "model_dir",
    "checkpoint_path",
    "max_steps",
    "eval_steps",
    "compile_only",
    "validate_only",
    "compile_dir",
    "num_csx",
    "num_wgt_servers",
    "num_workers_per_csx",
    "execution_mode",
)


# ---------------------------------------------------------------------- value checks

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 4


def _got(value: Any) -> str:
    """What a message says was given: the type and a short repr."""
    return f"{type(value).__name__} {_repr.repr(value)}"


def _describe(tp: Any) -> str:
    """An annotation in words, for 'must be ...'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is dict or origin is dict:
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple) or tp in (list, tuple):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        if origin is tuple and args:
            return f"a list of {len(args)} {_plural(args[0])}"
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin in (Union, types.UnionType):
        words = [
            ", ".join(map(repr, typing.get_args(a)))
            if typing.get_origin(a) is Literal
            else _describe(a)
            for a in args
        ]
        return ", ".join(words[:-1]) + " or " + words[-1]
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        tp, "mappings" if (tp is dict or typing.get_origin(tp) is dict) else "values"
    )


def _quoted_number_hint(value: Any) -> str:
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (a number in quotes? write it without quotes)"
    return ""


def _convert(path: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp``; ints become floats where a float
    is expected and lists become tuples where a tuple is expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message, saying null is allowed too
            try:
                return _convert(path, value, options[0])
            except (TypeError, ValueError) as e:
                prefix = f"{path} must be {_describe(options[0])}"
                message = str(e)
                if not message.startswith(prefix):
                    raise
                error = ValueError if isinstance(e, ValueError) else TypeError
                rest = message[len(prefix) :]
                raise error(f"{path} must be {_describe(tp)}{rest}") from None
        for option in options:
            try:
                return _convert(path, value, option)
            except (TypeError, ValueError):
                continue
        hint = _quoted_number_hint(value) if {int, float} & set(options) else ""
        words = [str(w) for o in options if typing.get_origin(o) is Literal for w in o.__args__]
        close = difflib.get_close_matches(value, words, n=1) if isinstance(value, str) else []
        suggestion = f" Did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{path} must be {_describe(tp)}, got {_got(value)}{hint}.{suggestion}")
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        close = (
            difflib.get_close_matches(value, [str(a) for a in args], n=1)
            if isinstance(value, str)
            else []
        )
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{path} must be {_describe(tp)}, got {_got(value)}.{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"{path} must be true or false, got {_got(value)}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            hint = f" (write {int(value)})"
        else:
            hint = _quoted_number_hint(value)
        raise TypeError(f"{path} must be an integer, got {_got(value)}{hint}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ValueError(f"{path} must be a finite number, got {_got(value)}.")
            return number
        raise TypeError(f"{path} must be a number, got {_got(value)}{_quoted_number_hint(value)}.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"{path} must be a string, got {_got(value)}.")
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path} must be a mapping (key: value lines), got {_got(value)}.")
        value_type = args[1] if args else Any
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: keys must be strings, got {_got(key)}.")
            out[key] = _convert(f"{path}.{key}", item, value_type)
        return out
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{path} must be {_describe(tp)}, got {_got(value)}.")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(
                    f"{path} must be {_describe(tp)}, got {len(value)} value(s): {_got(value)}."
                )
            items = [_convert(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_type = args[0] if args else Any
            items = [_convert(f"{path}[{i}]", v, item_type) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    raise AssertionError(f"{path}: no check for annotation {tp!r}")  # a field this file added


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_fields(obj: Any, section: str, skip: tuple[str, ...] = ()) -> None:
    """Check (and normalise) every init field of a dataclass against its annotation."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init or f.name in skip:
            continue
        value = _convert(f"{section}.{f.name}", getattr(obj, f.name), hints[f.name])
        object.__setattr__(obj, f.name, value)


def _at_least(section: str, obj: Any, names: tuple[str, ...], minimum: float, fix: str) -> None:
    """Each named field, when set, must be >= minimum."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            raise ValueError(f"{section}.{name} must be >= {minimum}, got {value!r}. Fix: {fix}.")


def _unknown_keys_error(section: str, unknown: list[str], valid: list[str]) -> ValueError:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
        parts.append(
            f"{key!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
        )
    return ValueError(
        f"{section}: unknown key(s) {', '.join(parts)}. Valid keys in {section}: "
        f"{', '.join(sorted(valid))}."
    )


def _as_section(section: str, raw: Any) -> dict[str, Any]:
    """A section's raw value as a dict with string keys (a copy)."""
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"{section} must be a mapping of key: value lines, got {_got(raw)}. Fix: indent "
            f"the section's keys under '{section}:'."
        )
    for key in raw:
        if not isinstance(key, str):
            raise TypeError(f"{section}: keys must be strings, got {_got(key)}.")
    return copy.deepcopy(dict(raw))


def _init_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _require(section: str, raw: dict[str, Any], name: str, example: str) -> None:
    if name not in raw:
        raise ValueError(f"{section}: missing required key {name!r}. Fix: add '{example}'.")


def _split_extra(section: str, cls: type, values: dict[str, Any]) -> tuple[dict, dict]:
    """A section's keys split into the dataclass's fields and the rest (its ``extra``)."""
    if "extra" in values:
        raise ValueError(
            f"{section}: 'extra' is not a key of the params file. Fix: write its keys directly "
            f"in the {section} section."
        )
    names = set(_init_names(cls))
    known = {k: v for k, v in values.items() if k in names}
    extra = {k: v for k, v in values.items() if k not in names}
    return known, extra


def _plain(value: Any) -> Any:
    """Tuples to lists and mappings to dicts, recursively (what yaml.safe_dump writes)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    return value


# ---------------------------------------------------------------------- input


@dataclass
class InputParams:
    """``train_input`` / ``eval_input``: which data processor and how to load its batches.

    Keys that are not fields (``seq_len``, ``image_size``, ...) go to ``extra`` and
    are passed to the data processor, which says which it accepts
    (``weightstream.data.processors.processor_keys``).
    """

    data_processor: str
    batch_size: int
    data_dir: str | list[str] | None = None
    # None: shuffle the training input, not the eval input (resolved in __post_init__).
    shuffle: bool | None = None
    shuffle_seed: int | None = None
    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    section: InitVar[str] = "train_input"

    def __post_init__(self, section: str) -> None:
        _check_fields(self, section)
        if self.shuffle is None:
            self.shuffle = section == "train_input"
        _at_least(section, self, ("batch_size",), 1, "give the number of samples per step")
        _at_least(section, self, ("shuffle_seed", "num_workers"), 0, "use a value >= 0")
        _at_least(section, self, ("prefetch_factor",), 1, "use a value >= 1")
        if self.num_workers == 0:
            for name, is_set in (
                ("prefetch_factor", self.prefetch_factor is not None),
                ("persistent_workers", self.persistent_workers),
            ):
                if is_set:
                    raise ValueError(
                        f"{section}.{name} needs loader worker processes, but "
                        f"{section}.num_workers is 0. Fix: set num_workers >= 1 or remove {name}."
                    )
        clash = sorted(set(self.extra) & set(_init_names(InputParams)))
        if clash:
            raise ValueError(
                f"{section}.extra repeats the field(s) {clash}. Fix: set them as fields."
            )
        _check_processor_keys(section, self.data_processor, self.extra)

    @classmethod
    def from_dict(cls, raw: Any, section: str = "train_input") -> InputParams:
        values = _as_section(section, raw)
        _require(section, values, "data_processor", "data_processor: <name>")
        _require(section, values, "batch_size", "batch_size: <samples per step>")
        known, extra = _split_extra(section, cls, values)
        return cls(**known, extra=extra, section=section)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.update(_plain(out.pop("extra")))
        return out


def _check_processor_keys(section: str, processor: str, extra: dict[str, Any]) -> None:
    """Reject extra keys the data processor does not take.

    The processors module may not exist yet (it is written separately); then only
    near-misspellings of InputParams fields (``batch_sise``) are rejected: other keys
    cannot be judged without the processor.
    """
    fields = [n for n in _init_names(InputParams) if n != "extra"]
    try:
        module = importlib.import_module("weightstream.data.processors")
    except ModuleNotFoundError as e:
        if e.name not in ("weightstream.data.processors",):
            raise
        module = None
    processor_keys = getattr(module, "processor_keys", None)
    if processor_keys is None:
        typos = [k for k in extra if difflib.get_close_matches(k, fields, n=1, cutoff=0.85)]
        if typos:
            raise _unknown_keys_error(section, typos, fields)
        return
    try:
        accepted = set(processor_keys(processor))
    except (KeyError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ValueError(f"{section}.data_processor: {message}") from None
    unknown = [k for k in extra if k not in accepted]
    if unknown:
        raise _unknown_keys_error(section, unknown, sorted(set(fields) | accepted))


# ---------------------------------------------------------------------- model

_MODEL_OWN_KEYS = ("name", "preset", "mixed_precision", "fp16_type")


@dataclass
class ModelParams:
    """``model``: a model of the registry, its config and its precision.

    ``fields`` holds the model's own keys as written (checked against the model's
    config dataclass); ``config`` is that dataclass built from the preset's values
    overridden by ``fields``.
    """

    name: str
    preset: str | None = None
    mixed_precision: bool = False
    fp16_type: Literal["float16", "bfloat16", "cbfloat16"] = "float16"
    fields: dict[str, Any] = field(default_factory=dict)
    config: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from weightstream.models.registry import get_model_spec

        _check_fields(self, "model", skip=("fields",))
        _convert("model.fields", self.fields, dict[str, Any])
        if self.name == "hf":
            self._hf_post_init()
            return
        try:
            spec = get_model_spec(self.name)
        except ValueError as e:
            raise ValueError(f"model.name: {e}") from None
        if self.preset is not None and self.preset not in spec.presets:
            close = difflib.get_close_matches(self.preset, list(spec.presets), n=3)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            fix = (
                f"Its presets: {', '.join(map(repr, spec.presets))}. Fix: use one of them or "
                f"remove 'preset'."
                if spec.presets
                else "It has no presets. Fix: remove 'preset' and set the fields directly."
            )
            raise ValueError(
                f"model.preset: model {self.name!r} has no preset {self.preset!r}.{hint} {fix}"
            )
        config_hints = _hints(spec.config_cls)
        config_names = [f.name for f in dataclasses.fields(spec.config_cls) if f.init]
        unknown = [k for k in self.fields if k not in config_names]
        if unknown:
            raise _unknown_keys_error(
                f"model ({self.name})", unknown, config_names + list(_MODEL_OWN_KEYS)
            )
        given = {
            key: _convert(f"model.{key}", value, config_hints[key])
            for key, value in self.fields.items()
        }
        values = {**(spec.presets[self.preset] if self.preset else {}), **given}
        try:
            self.config = spec.config_cls(**values)
        except (TypeError, ValueError) as e:
            error = ValueError if isinstance(e, ValueError) else TypeError
            raise error(f"model ({self.name}): {e} Fix the key in the model section.") from None
        self.fields = given

    def _hf_post_init(self) -> None:
        """``name: hf``: a transformers causal LM from ``hf_config`` (models/hf.py)."""
        from weightstream.models import hf

        if self.preset is not None:
            raise ValueError(
                "model.preset: a Hugging Face model ('name: hf') has no presets. Fix: remove "
                "'preset' and override config fields directly (num_hidden_layers: 2)."
            )
        fields = dict(self.fields)
        path = fields.pop("hf_config", None)
        if not isinstance(path, str) or not path:
            raise ValueError(
                "model.hf_config: 'name: hf' needs hf_config, the path of a Hugging Face "
                "model folder or its config.json. Fix: add hf_config: path/to/model."
            )
        self.config = hf.load_config(path, fields)

    @property
    def spec(self):
        """The registry entry (:class:`weightstream.models.registry.ModelSpec`)."""
        from weightstream.models.registry import get_model_spec

        return get_model_spec(self.name)

    def build(self, device: str = "cpu"):
        """The model (an nn.Module) built from :attr:`config` on ``device``.

        The zoo's models are built on the meta device and materialized module by
        module (``common.materialize``): the same numbers as the disk store
        draws when it materializes them, and no draws thrown away. ``"meta"``
        leaves them without storage. A Hugging Face model (``name: hf``) is
        built by ``AutoModelForCausalLM.from_config`` the same way.
        """
        from weightstream.common.materialize import build_materialized

        if self.name == "hf":
            from weightstream.models import hf

            return hf.build(self.config, device)
        return build_materialized(lambda: self.spec.build(self.config), device)

    @classmethod
    def from_dict(cls, raw: Any) -> ModelParams:
        values = _as_section("model", raw)
        _require("model", values, "name", "name: <model name, e.g. gpt2>")
        own = {k: values.pop(k) for k in _MODEL_OWN_KEYS if k in values}
        params = cls(**own, fields=values)
        if "fp16_type" in own and not params.mixed_precision:
            warnings.warn(
                "model.fp16_type is ignored because model.mixed_precision is false; set "
                "mixed_precision: true to train in half precision.",
                UserWarning,
                stacklevel=3,
            )
        return params

    def to_dict(self) -> dict[str, Any]:
        """Own keys and every field of the resolved config (so the file is complete)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _MODEL_OWN_KEYS}
        if not self.mixed_precision:  # ignored then; writing it back would warn on reading
            del out["fp16_type"]
        if self.name == "hf":  # the config file and the overrides, as written
            del out["preset"]
            out.update(_plain(self.fields))
            return out
        out.update(_plain(self.config))
        return out


# ---------------------------------------------------------------------- optimizer

_OPTIMIZER_KWARG_FIELDS = ("weight_decay", "betas", "eps", "momentum")


@dataclass
class OptimizerParams:
    """``optimizer``: the optimizer, its learning-rate schedule, clipping and loss scaling.

    ``learning_rate`` is a number, a numeric string, or a scheduler spec (a dict or a
    list of dicts) passed on unchanged to ``configure_lr_scheduler``. ``None`` for an
    optimizer argument means the optimizer's own default. Keys that are not fields
    (``nesterov``, ``amsgrad``, ...) go to ``extra`` and must be arguments of the
    optimizer's constructor.
    """

    optimizer_type: str
    learning_rate: float | str | dict[str, Any] | list[dict[str, Any]] | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | tuple[float, float] | None = None
    momentum: float | None = None
    max_gradient_norm: float | None = None
    max_gradient_value: float | None = None
    loss_scaling_factor: float | Literal["dynamic"] | None = None
    initial_loss_scale: float | None = None
    steps_per_increase: int | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    grad_accum_steps: int = 1
    # Per-layer lr factors for configure_lr_scheduler(adjust_learning_rate=...).
    adjust_learning_rate: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = "optimizer"
        self.learning_rate = _check_learning_rate(self.learning_rate)
        _check_fields(self, s, skip=("learning_rate",))
        _at_least(s, self, ("weight_decay", "momentum"), 0, "use a value >= 0")
        _at_least(s, self, ("max_gradient_norm", "max_gradient_value"), 0, "use a value >= 0")
        _at_least(s, self, ("steps_per_increase", "grad_accum_steps"), 1, "use a value >= 1")
        for name in ("eps", "initial_loss_scale", "min_loss_scale", "max_loss_scale"):
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            if any(v is not None and v <= 0 for v in values):
                raise ValueError(f"{s}.{name} must be > 0, got {value!r}. Fix: use a value > 0.")
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"{s}.betas must be two numbers in [0, 1), got {list(self.betas)}. "
                f"Fix: e.g. betas: [0.9, 0.999]."
            )
        if self.max_gradient_norm is not None and self.max_gradient_value is not None:
            raise ValueError(
                f"{s}: max_gradient_norm and max_gradient_value are both set; gradients are "
                f"clipped by norm or by value, not both. Fix: remove one of them."
            )
        if isinstance(self.loss_scaling_factor, float) and self.loss_scaling_factor <= 0:
            raise ValueError(
                f"{s}.loss_scaling_factor must be > 0 or 'dynamic', got "
                f"{self.loss_scaling_factor!r}. Fix: use 'dynamic', a positive number, or "
                f"remove it for no loss scaling."
            )
        if (
            self.min_loss_scale is not None
            and self.max_loss_scale is not None
            and self.min_loss_scale > self.max_loss_scale
        ):
            raise ValueError(
                f"{s}: min_loss_scale ({self.min_loss_scale}) is larger than max_loss_scale "
                f"({self.max_loss_scale}). Fix: swap them."
            )
        dynamic_only = [
            n
            for n in (
                "initial_loss_scale",
                "steps_per_increase",
                "min_loss_scale",
                "max_loss_scale",
            )
            if getattr(self, n) is not None
        ]
        if dynamic_only and self.loss_scaling_factor != "dynamic":
            warnings.warn(
                f"{s}: {', '.join(dynamic_only)} only apply to dynamic loss scaling and are "
                f"ignored because loss_scaling_factor is {self.loss_scaling_factor!r}. Set "
                f"loss_scaling_factor: dynamic to use them.",
                UserWarning,
                stacklevel=3,
            )
        _check_optimizer_extra(self.optimizer_type, self.extra)

    @classmethod
    def from_dict(cls, raw: Any) -> OptimizerParams:
        values = _as_section("optimizer", raw)
        _require("optimizer", values, "optimizer_type", "optimizer_type: <name, e.g. AdamW>")
        known, extra = _split_extra("optimizer", cls, values)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.update(_plain(out.pop("extra")))
        return out

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``configure_optimizer(optimizer_type, params, **kwargs)``:
        learning_rate and the optimizer arguments that are set (None ones are left to the
        optimizer's defaults), plus ``extra``."""
        kwargs: dict[str, Any] = {}
        if self.learning_rate is not None:
            kwargs["learning_rate"] = copy.deepcopy(self.learning_rate)
        for name in _OPTIMIZER_KWARG_FIELDS:
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        kwargs.update(copy.deepcopy(self.extra))
        return kwargs

    def grad_scaler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`weightstream.amp.GradScaler`."""
        return {
            "loss_scale": self.loss_scaling_factor,
            "init_scale": self.initial_loss_scale,
            "steps_per_increase": self.steps_per_increase,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
        }


def _check_learning_rate(value: Any) -> Any:
    path = "optimizer.learning_rate"
    fix = (
        "Fix: write a number (learning_rate: 1.0e-3), a scheduler dict "
        "({scheduler: CosineDecay, ...}) or a list of scheduler dicts."
    )
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{path} must be a number or a schedule, got {_got(value)}. {fix}")
    if isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{path}: {_got(value)} is not a number. {fix}") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{path} must be a finite number >= 0, got {_got(value)}. {fix}")
        return value if isinstance(value, str) else number
    entries = [value] if isinstance(value, Mapping) else value
    if not isinstance(entries, (list, tuple)) or not entries:
        raise TypeError(f"{path} must be a number or a schedule, got {_got(value)}. {fix}")
    for index, entry in enumerate(entries):
        where = path if isinstance(value, Mapping) else f"{path}[{index}]"
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where} must be a scheduler dict, got {_got(entry)}. {fix}")
        if not isinstance(entry.get("scheduler"), str):
            raise ValueError(
                f"{where} needs a 'scheduler' key naming the scheduler (e.g. scheduler: "
                f"CosineDecay), got keys {sorted(map(str, entry))}."
            )
        _convert(where, entry, dict[str, Any])  # string keys
    return _plain(value)


def _check_optimizer_extra(optimizer_type: str, extra: dict[str, Any]) -> None:
    """Extra keys must be constructor arguments of the named optimizer.

    An unknown optimizer_type is configure_optimizer's error, not this one's: then the
    extra keys are left for it to judge.
    """
    from weightstream.optim import configure as optim_configure

    fields = [n for n in _init_names(OptimizerParams) if n != "extra"]
    keys = dict(extra)
    nested = keys.pop("optim_params", None)
    if nested is not None:
        keys.update(_convert("optimizer.optim_params", nested, dict[str, Any]))
    if "lr" in keys:
        raise ValueError(
            "optimizer.lr: write the learning rate as 'learning_rate' (the params-file name)."
        )
    try:
        cls = optim_configure._lookup(optimizer_type)
    except ValueError:
        cls = None
    accepted, takes_any = optim_configure._constructor_arguments(cls) if cls else (set(), True)
    for key in keys:
        # Adafactor still takes beta1: retired only for optimizers that do not.
        if key in optim_configure._RETIRED_ALIASES and key not in accepted:
            new, example = optim_configure._RETIRED_ALIASES[key]
            raise ValueError(
                f"optimizer.{key} is a retired name. Fix: use '{new}' (write {example})."
            )
    unknown = [k for k in keys if k not in accepted and k not in fields]
    if unknown and not takes_any:
        raise _unknown_keys_error(
            f"optimizer ({cls.__name__})", unknown, sorted(set(fields) | (accepted - {"lr"}))
        )


# ---------------------------------------------------------------------- runconfig


# The states a warm start may take from a checkpoint (runconfig.load_checkpoint_states).
WARM_START_STATES = ("model", "optimizer", "lr_scheduler", "grad_scaler", "dataloader")


@dataclass
class RunConfigParams:
    """``runconfig``: steps, checkpoints, logging, cluster size and execution mode.

    Step counts follow ``compute_num_steps``: num_epochs and num_steps exclude each
    other; max_steps bounds the global step. ``checkpoint_steps: 0`` checkpoints only
    at the end; ``max_checkpoints: null`` keeps all.
    """

    model_dir: str = "model_dir"
    max_steps: int | None = None
    num_steps: int | None = None
    num_epochs: int | None = None
    steps_per_epoch: int | None = None
    eval_steps: int | None = None
    eval_frequency: int | None = None
    checkpoint_steps: int = 0
    save_initial_checkpoint: bool = False
    max_checkpoints: int | None = None
    autoload_last_checkpoint: bool = True
    checkpoint_path: str | None = None
    # Warm start: which states to take from checkpoint_path (comma-separated).
    load_checkpoint_states: str | None = None
    log_steps: int = 10
    seed: int = 1
    num_csx: int = 1
    num_wgt_servers: int = 24
    num_workers_per_csx: int = 1
    compile_dir: str | None = None
    compile_only: bool = False
    validate_only: bool = False
    execution_mode: Literal["weight_streaming", "layer_pipelined"] = "weight_streaming"
    check_loss_values: bool = True
    prefetch_depth: int = 1
    unit_size_target: int = 64 * 2**20
    overlap_updates: bool = False
    store: Literal["ram", "disk"] = "ram"
    store_dir: str | None = None
    host_memory_budget: int | None = None
    # None: sharded across the ranks (the weight servers) on CPU, as the
    # reference's MemoryX; replicated on accelerators, which cannot shard yet.
    store_sharding: Literal["replicated", "sharded"] | None = None

    def __post_init__(self) -> None:
        s = "runconfig"
        _check_fields(self, s)
        _at_least(
            s,
            self,
            (
                "max_steps",
                "num_steps",
                "num_epochs",
                "steps_per_epoch",
                "eval_steps",
                "eval_frequency",
                "max_checkpoints",
                "log_steps",
                "num_csx",
                "num_wgt_servers",
                "unit_size_target",
                "host_memory_budget",
            ),
            1,
            "use a positive integer",
        )
        _at_least(
            s,
            self,
            ("checkpoint_steps", "num_workers_per_csx", "prefetch_depth", "seed"),
            0,
            "use an integer >= 0",
        )
        if self.seed >= 2**64:
            raise ValueError(f"{s}.seed must be < 2**64, got {self.seed}. Fix: use a smaller seed.")
        if not self.model_dir:
            raise ValueError(f"{s}.model_dir is empty. Fix: give a directory, e.g. model_dir.")
        if self.num_epochs is not None and self.num_steps is not None:
            raise ValueError(
                f"{s}: num_epochs and num_steps are both set; they are mutually exclusive. "
                f"Fix: remove one of them (max_steps can still bound either)."
            )
        if self.store != "disk" and (self.store_dir is not None or self.host_memory_budget):
            raise ValueError(
                f"{s}.store_dir and {s}.host_memory_budget configure the disk store, but "
                f"{s}.store is {self.store!r}. Fix: set store: disk, or remove them."
            )
        if self.compile_only and self.validate_only:
            raise ValueError(
                f"{s}: compile_only and validate_only are both true; they are mutually "
                f"exclusive. Fix: set at most one of them."
            )
        if self.load_checkpoint_states is not None:
            states = [x.strip() for x in str(self.load_checkpoint_states).split(",")]
            bad = [x for x in states if x not in WARM_START_STATES]
            if bad or not states:
                raise ValueError(
                    f"{s}.load_checkpoint_states: unknown state(s) {', '.join(map(repr, bad))}. "
                    f"Fix: a comma-separated subset of {', '.join(WARM_START_STATES)}, e.g. "
                    "'model' for the weights only."
                )
            if not self.checkpoint_path:
                raise ValueError(
                    f"{s}.load_checkpoint_states needs {s}.checkpoint_path, the checkpoint to "
                    "warm-start from (one of ours, a safetensors file or a Hugging Face model "
                    "folder). Fix: set checkpoint_path."
                )
        if self.steps_per_epoch is not None and self.num_epochs is None:
            warnings.warn(
                f"{s}.steps_per_epoch is ignored because num_epochs is not set.",
                UserWarning,
                stacklevel=3,
            )

    @classmethod
    def from_dict(cls, raw: Any) -> RunConfigParams:
        values = _as_section("runconfig", raw)
        names = _init_names(cls)
        unknown = [k for k in values if k not in names]
        if unknown:
            raise _unknown_keys_error("runconfig", unknown, names)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def warm_start_states(self) -> list[str]:
        """The states of ``load_checkpoint_states`` (empty: no warm start)."""
        if self.load_checkpoint_states is None:
            return []
        return [x.strip() for x in self.load_checkpoint_states.split(",")]

    @property
    def has_train_steps(self) -> bool:
        return any(v is not None for v in (self.max_steps, self.num_steps, self.num_epochs))


# ---------------------------------------------------------------------- params


@dataclass
class Params:
    """A whole params file. Which sections must be present depends on the mode
    (:meth:`check_mode`, called by :func:`parse_params`)."""

    model: ModelParams
    train_input: InputParams | None = None
    eval_input: InputParams | None = None
    optimizer: OptimizerParams | None = None
    runconfig: RunConfigParams = field(default_factory=RunConfigParams)

    def __post_init__(self) -> None:
        for name, cls, optional in (
            ("model", ModelParams, False),
            ("train_input", InputParams, True),
            ("eval_input", InputParams, True),
            ("optimizer", OptimizerParams, True),
            ("runconfig", RunConfigParams, False),
        ):
            value = getattr(self, name)
            if not (isinstance(value, cls) or (optional and value is None)):
                raise TypeError(f"Params.{name} must be a {cls.__name__}, got {_got(value)}.")

    def check_mode(self, mode: str) -> None:
        """Raise ValueError when something the mode needs is missing."""
        _check_mode_name(mode)
        missing = [s for s in _REQUIRED_SECTIONS[mode] if getattr(self, s, None) is None]
        if missing:
            raise _missing_sections_error(mode, missing)
        if mode in ("train", "train_and_eval") and not self.runconfig.has_train_steps:
            raise ValueError(
                f"mode {mode!r} needs the number of training steps: set runconfig.max_steps, "
                f"runconfig.num_steps or runconfig.num_epochs (or pass --max_steps)."
            )

    def to_dict(self) -> dict[str, Any]:
        """The plain dict of every present section (written to model_dir as the run's
        params yaml); :func:`parse_params` reads it back to the same settings."""
        out = {}
        for name in SECTIONS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value.to_dict()
        return out


def _check_mode_name(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {_got(mode)}.")


def _missing_sections_error(mode: str, missing: list[str]) -> ValueError:
    return ValueError(
        f"mode {mode!r} needs the section(s) {', '.join(missing)}, missing from the params "
        f"file. Fix: add {' and '.join(repr(m + ':') for m in missing)} (see configs/ for "
        f"examples)."
    )


def parse_params(raw: Any, mode: str) -> Params:
    """The :class:`Params` a raw params dict describes, checked for ``mode``.

    Every present section is checked, even one the mode does not use (so a typo in
    eval_input shows up in a training run, not in the evaluation after it).
    """
    _check_mode_name(mode)
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"the params must be a mapping of sections ({', '.join(SECTIONS)}), got {_got(raw)}."
        )
    for key in raw:
        if not isinstance(key, str):
            raise TypeError(f"params: section names must be strings, got {_got(key)}.")
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise _unknown_keys_error("params file (top level)", unknown, list(SECTIONS))
    present = {k: v for k, v in raw.items() if v is not None}
    missing = [s for s in _REQUIRED_SECTIONS[mode] if s not in present]
    if missing:
        raise _missing_sections_error(mode, missing)
    params = Params(
        model=ModelParams.from_dict(present["model"]),
        train_input=(
            InputParams.from_dict(present["train_input"], "train_input")
            if "train_input" in present
            else None
        ),
        eval_input=(
            InputParams.from_dict(present["eval_input"], "eval_input")
            if "eval_input" in present
            else None
        ),
        optimizer=(
            OptimizerParams.from_dict(present["optimizer"]) if "optimizer" in present else None
        ),
        runconfig=RunConfigParams.from_dict(present.get("runconfig", {})),
    )
    params.check_mode(mode)
    return params


# ---------------------------------------------------------------------- files


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``) and
    refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                line = seen.get(key)
            except TypeError:  # an unhashable key; construct_mapping reports it
                continue
            if line is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first on line {line + 1}); keep one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_params(path: str | Path) -> dict[str, Any]:
    """Read a params YAML file into a plain dict (no checks beyond the YAML itself).

    Raises FileNotFoundError for a missing file, ValueError for invalid YAML (with the
    line) and TypeError when the top level is not a mapping of sections.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"params file {str(path)!r} does not exist. Fix: pass the path of a params "
            f"YAML file with -p (see configs/ for examples)."
        )
    if path.is_dir():
        raise ValueError(f"params file {str(path)!r} is a directory; pass a YAML file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"params file {str(path)!r} is not UTF-8 text: {e}.") from None
    try:
        raw = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and context_mark is not None and context_mark is not mark:
            problem += f" ({context} started at line {context_mark.line + 1})"
        raise ValueError(
            f"params file {str(path)!r} is not valid YAML{where}: {problem}."
        ) from None
    if raw is None:
        raise ValueError(f"params file {str(path)!r} is empty; it needs at least a model section.")
    if not isinstance(raw, dict):
        raise TypeError(
            f"params file {str(path)!r}: the top level must be a mapping of sections "
            f"({', '.join(SECTIONS)}), got {_got(raw)}."
        )
    return raw


def save_params(params: Params, path: str | Path) -> None:
    """Write ``params.to_dict()`` as YAML (the run's params file in model_dir)."""
    Path(path).write_text(
        yaml.safe_dump(params.to_dict(), sort_keys=False, default_flow_style=False),
        encoding="utf-8",
    )


def apply_overrides(raw: Any, args: Any) -> dict[str, Any]:
    """A copy of ``raw`` with the command-line values written into its runconfig.

    ``args`` is an argparse Namespace (or a mapping) with the attributes of
    :data:`OVERRIDE_KEYS`; a value of None (flag not given) leaves the file's value.
    ``--compile_only`` / ``--validate_only`` given on the command line also clear the
    other one from the file, since they exclude each other.
    """
    if not isinstance(raw, Mapping):
        raise TypeError(f"the params must be a mapping of sections, got {_got(raw)}.")
    out = copy.deepcopy(dict(raw))
    get = args.get if isinstance(args, Mapping) else lambda k: getattr(args, k, None)
    values = {k: get(k) for k in OVERRIDE_KEYS}
    values = {k: v for k, v in values.items() if v is not None and v is not False}
    if not values:
        return out
    runconfig = out.get("runconfig")
    runconfig = {} if runconfig is None else _as_section("runconfig", runconfig)
    for flag, other in (("compile_only", "validate_only"), ("validate_only", "compile_only")):
        if values.get(flag):
            runconfig.pop(other, None)
    runconfig.update(values)
    out["runconfig"] = runconfig
    return out

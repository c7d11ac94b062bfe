"""The params file of ``weightstream run``: a tree of typed, validated dataclasses.

A params file is YAML with up to six top-level sections (api-reference section 8)::

    train_input / eval_input -> InputParams      (data processor and loader settings)
    model                    -> ModelParams      (a registry model, its config, precision)
    optimizer                -> OptimizerParams  (optimizer, lr schedule, clipping, loss scaling)
    runconfig                -> RunConfigParams  (steps, checkpoints, logging, cluster, execution)
    peft                     -> PeftParams       (LoRA adapters on a model: {name: hf})

YAML only deserializes (:func:`load_params` gives a plain dict); every check lives in
the dataclasses' ``__post_init__``, so a Params built in Python is checked exactly
like one read from a file. :func:`parse_params` turns the dict into :class:`Params`
and checks what the mode needs; :func:`apply_overrides` lets command-line values win
over the file; :meth:`Params.to_dict` gives the plain dict written back into
model_dir, which :func:`parse_params` reads back to the same settings.

Errors are those of common/schema.py; a missing section is a ValueError too.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from weightstream.common import schema
from weightstream.common.schema import (
    as_section,
    check,
    got,
    init_names,
    plain,
    setting,
    unknown_keys_error,
)
from weightstream.data.params import InputParams
from weightstream.data.section import check_batch_share
from weightstream.models.params import ModelParams, PeftParams
from weightstream.optim.params import OptimizerParams
from weightstream.runtime.config import StreamingConfig

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
    "PeftParams",
    "RunConfigParams",
    "apply_overrides",
    "load_params",
    "parse_params",
    "save_params",
]

MODES = ("train", "eval", "train_and_eval", "eval_all")
SECTIONS = ("train_input", "eval_input", "model", "optimizer", "runconfig", "peft")
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


# ---------------------------------------------------------------------- runconfig

# The states a warm start may take from a checkpoint (runconfig.load_checkpoint_states).
WARM_START_STATES = ("model", "optimizer", "lr_scheduler", "grad_scaler", "dataloader")

# Settings that count something: the bound and its fix, said once.
_positive = functools.partial(setting, ge=1, fix="use a positive integer")
_natural = functools.partial(setting, ge=0, fix="use an integer >= 0")


@dataclass
class RunConfigParams:
    """``runconfig``: steps, checkpoints, logging, cluster size and execution mode,
    and the streaming settings (:class:`StreamingConfig`, in :attr:`streaming`).

    Step counts follow ``compute_num_steps``: num_epochs and num_steps exclude each
    other; max_steps bounds the global step.
    """

    model_dir: str = setting(
        "model_dir", doc="The run's output directory (overridden by -o/--model_dir)."
    )
    max_steps: int | None = _positive(None, doc="The global step at which training stops.")
    num_steps: int | None = _positive(None, doc="Training steps of this run (excludes num_epochs).")
    num_epochs: int | None = _positive(
        None, doc="Training epochs of this run (excludes num_steps)."
    )
    steps_per_epoch: int | None = _positive(
        None, doc="Steps counted as an epoch with num_epochs (default: the loader's length)."
    )
    eval_steps: int | None = _positive(
        None,
        doc="Evaluation steps (default: the whole eval input, less a last partial batch "
        "while eval_input.drop_last is true, its default). More steps than the eval input "
        "has batches read some again (with a warning).",
    )
    eval_frequency: int | None = _positive(
        None,
        doc="train_and_eval evaluates every this many steps while it trains, with the "
        "training's model, as well as after the last step; the training's losses are "
        "those of a run without it (Note [evaluation during training] in "
        "train/trainer.py). None: after training only.",
    )
    checkpoint_steps: int = _natural(
        0, doc="Save a checkpoint every this many steps; 0: only at the end of training."
    )
    save_initial_checkpoint: bool = setting(
        False, doc="Save a checkpoint of the initial weights before the first step."
    )
    max_checkpoints: int | None = _positive(
        None, doc="Keep at most this many checkpoints, deleting the oldest; null: keep all."
    )
    autoload_last_checkpoint: bool = setting(
        True,
        doc="Resume from the newest checkpoint in model_dir when there is one. false starts "
        "at step 0, and refuses a model_dir that holds checkpoints (it would replace some).",
    )
    checkpoint_path: str | None = setting(
        None,
        doc="A checkpoint to start from: one of ours, a safetensors file or a Hugging Face "
        "model folder (overridden by --checkpoint_path).",
    )
    load_checkpoint_states: str | None = setting(
        None,
        doc="Warm start: which states to take from checkpoint_path, comma-separated among "
        + ", ".join(WARM_START_STATES)
        + " ('model' for the weights only); null: resume every state.",
    )
    log_steps: int = _positive(10, doc="Log the loss every this many steps.")
    seed: int = _natural(1, doc="The seed of every random generator of the run (< 2**64).")
    num_csx: int = _positive(1, doc="Compute systems: data-parallel ranks of the run.")
    num_workers_per_csx: int = _natural(
        1,
        doc="The reference's input workers per system: recorded in the data loader's state "
        "and checked on resume. Worker processes come from train_input.num_workers.",
    )
    compile_dir: str | None = setting(
        None, doc="Where the compile directories (ws_<checksum>) go; null: model_dir."
    )
    compile_only: bool = setting(
        False, doc="Compile (trace, plan, estimate) and stop, without running a step."
    )
    validate_only: bool = setting(False, doc="Trace and validate the model only, then stop.")
    execution_mode: Literal["weight_streaming", "layer_pipelined"] = setting(
        "weight_streaming",
        doc="weight_streaming: weights live in the host store and stream to the device; "
        "layer_pipelined: everything resident on the device.",
    )
    check_loss_values: bool = setting(
        True, doc="Stop the run with an error when the loss is NaN or infinite."
    )
    master_dtype: Literal["float32", "bfloat16"] = setting(
        "float32",
        doc="The dtype of the model's parameters, the store's masters: bfloat16 halves "
        "their host bytes (and is the host mirror itself); the Adam family and SGD then "
        "keep a Kahan compensation buffer (Note [Kahan summation] in optim/compact.py).",
    )
    streaming: StreamingConfig = field(default_factory=StreamingConfig)

    def __post_init__(self) -> None:
        s = "runconfig"
        check(self, s, skip=("streaming",))
        if not isinstance(self.streaming, StreamingConfig):
            raise TypeError(f"{s}.streaming must be a StreamingConfig, got {got(self.streaming)}.")
        if self.seed >= 2**64:
            raise ValueError(f"{s}.seed must be < 2**64, got {self.seed}. Fix: use a smaller seed.")
        if not self.model_dir:
            raise ValueError(f"{s}.model_dir is empty. Fix: give a directory, e.g. model_dir.")
        if self.num_epochs is not None and self.num_steps is not None:
            raise ValueError(
                f"{s}: num_epochs and num_steps are both set; they are mutually exclusive. "
                f"Fix: remove one of them (max_steps can still bound either)."
            )
        if self.compile_only and self.validate_only:
            raise ValueError(
                f"{s}: compile_only and validate_only are both true; they are mutually "
                f"exclusive. Fix: set at most one of them."
            )
        if self.load_checkpoint_states is not None:
            bad = [x for x in self.warm_start_states if x not in WARM_START_STATES]
            if bad:
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

    @staticmethod
    def keys() -> list[str]:
        """Every key of the runconfig section: the run's own and the streaming ones."""
        own = [n for n in init_names(RunConfigParams) if n != "streaming"]
        return own + schema.params_names(StreamingConfig)

    @classmethod
    def from_dict(cls, raw: Any) -> RunConfigParams:
        s = "runconfig"
        values = schema.known_keys(s, StreamingConfig, as_section(s, raw), cls.keys())
        streaming_names = schema.params_names(StreamingConfig)
        streaming = {k: values.pop(k) for k in streaming_names if k in values}
        return cls(**values, streaming=StreamingConfig(**streaming, section=s))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        del out["streaming"]
        out.update(plain(self.streaming.params_values()))
        return out

    def __getattr__(self, name: str) -> Any:
        # runconfig.<a streaming setting> reads it from the one StreamingConfig.
        if name in schema.params_names(StreamingConfig) and "streaming" in self.__dict__:
            return getattr(self.streaming, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
    peft: PeftParams | None = None

    def __post_init__(self) -> None:
        for name, cls, optional in (
            ("model", ModelParams, False),
            ("train_input", InputParams, True),
            ("eval_input", InputParams, True),
            ("optimizer", OptimizerParams, True),
            ("runconfig", RunConfigParams, False),
            ("peft", PeftParams, True),
        ):
            value = getattr(self, name)
            if not (isinstance(value, cls) or (optional and value is None)):
                raise TypeError(f"Params.{name} must be a {cls.__name__}, got {got(value)}.")
        if self.peft is not None:
            self._check_peft()

    def _check_peft(self) -> None:
        """LoRA trains adapters on a pretrained transformers model, whose weights a
        warm start reads (Note [lora checkpoints] in cli/run_lora.py)."""
        if self.model.name != "hf":
            raise ValueError(
                f"peft: LoRA adapters need a Hugging Face model, but model.name is "
                f"{self.model.name!r}. Fix: use 'model: {{name: hf, hf_config: FOLDER}}', or "
                "remove the peft section."
            )
        rc = self.runconfig
        if not rc.checkpoint_path or rc.warm_start_states != ["model"]:
            raise ValueError(
                "peft: LoRA trains adapters on pretrained weights, read from the base model's "
                "folder at the start and again on every resume (checkpoints hold the adapters "
                "only). Fix: set runconfig.checkpoint_path to the base model folder and "
                "runconfig.load_checkpoint_states: model."
            )

    def check_mode(self, mode: str) -> None:
        """Raise ValueError when something the mode needs is missing."""
        _check_mode_name(mode)
        missing = [s for s in _REQUIRED_SECTIONS[mode] if getattr(self, s, None) is None]
        if missing:
            raise _missing_sections_error(mode, missing)
        for name in _REQUIRED_SECTIONS[mode]:  # before any rank starts: said once
            if name.endswith("_input") and self.runconfig.num_csx > 1:
                section = getattr(self, name)
                check_batch_share(f"{name}.batch_size", section.batch_size, self.runconfig.num_csx)
        if mode in ("train", "train_and_eval") and not self.runconfig.has_train_steps:
            raise ValueError(
                f"mode {mode!r} needs the number of training steps: set runconfig.max_steps, "
                f"runconfig.num_steps or runconfig.num_epochs (or pass --max_steps)."
            )

    def to_dict(self) -> dict[str, Any]:
        """The plain dict of every present section (written to model_dir as the run's
        params yaml); :func:`parse_params` reads it back to the same settings."""
        return {s: getattr(self, s).to_dict() for s in SECTIONS if getattr(self, s) is not None}


def _check_mode_name(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {got(mode)}.")


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
            f"the params must be a mapping of sections ({', '.join(SECTIONS)}), got {got(raw)}."
        )
    for key in raw:
        if not isinstance(key, str):
            raise TypeError(f"params: section names must be strings, got {got(key)}.")
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise unknown_keys_error("params file (top level)", unknown, list(SECTIONS))
    present = {k: v for k, v in raw.items() if v is not None}
    missing = [s for s in _REQUIRED_SECTIONS[mode] if s not in present]
    if missing:
        raise _missing_sections_error(mode, missing)
    model = ModelParams.from_dict(present["model"])
    inputs = {
        name: InputParams.from_dict(present[name], name)
        for name in ("train_input", "eval_input")
        if name in present
    }
    optimizer = present.get("optimizer")
    peft = present.get("peft")
    params = Params(
        model,
        **inputs,
        optimizer=None if optimizer is None else OptimizerParams.from_dict(optimizer),
        runconfig=RunConfigParams.from_dict(present.get("runconfig", {})),
        peft=None if peft is None else PeftParams.from_dict(peft),
    )
    params.check_mode(mode)
    _check_input_sections(params.train_input, params.eval_input)
    return params


def _check_input_sections(train: InputParams | None, evals: InputParams | None) -> None:
    """The data processors' checks over both sections; like each section's key check
    (``data.params``), looked up when it runs and skipped where the processors module
    is not there or has none."""
    try:
        module = importlib.import_module("weightstream.data.processors")
    except ModuleNotFoundError as e:
        if e.name != "weightstream.data.processors":
            raise
        return
    check = getattr(module, "check_input_sections", None)
    if check is not None:
        check(train and train.to_dict(), evals and evals.to_dict())


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
            f"({', '.join(SECTIONS)}), got {got(raw)}."
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
        raise TypeError(f"the params must be a mapping of sections, got {got(raw)}.")
    out = copy.deepcopy(dict(raw))
    get = args.get if isinstance(args, Mapping) else lambda k: getattr(args, k, None)
    values = {k: get(k) for k in OVERRIDE_KEYS}
    values = {k: v for k, v in values.items() if v is not None and v is not False}
    if not values:
        return out
    runconfig = out.get("runconfig")
    runconfig = {} if runconfig is None else as_section("runconfig", runconfig)
    for flag, other in (("compile_only", "validate_only"), ("validate_only", "compile_only")):
        if values.get(flag):
            runconfig.pop(other, None)
    runconfig.update(values)
    out["runconfig"] = runconfig
    return out

"""The params file's ``model`` section: a model of the registry, its config, its precision."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from weightstream.common.schema import (
    as_section,
    check,
    convert,
    did_you_mean,
    hints,
    init_names,
    plain,
    require,
    setting,
    unknown_keys_error,
)

__all__ = ["ModelParams", "PeftParams"]

_MODEL_OWN_KEYS = ("name", "preset", "mixed_precision", "fp16_type")


@dataclass
class ModelParams:
    """``model``: a model of the registry, its config and its precision.

    ``fields`` holds the model's own keys as written (checked against the model's
    config dataclass); ``config`` is that dataclass built from the preset's values
    overridden by ``fields``.
    """

    name: str = setting(
        doc="A model of the registry (weightstream.models: gpt2, llama, ...), or 'hf' for a "
        "transformers causal LM given by hf_config (a model folder or its config.json)."
    )
    preset: str | None = setting(
        None, doc="One of the model's named configurations; the keys below override it."
    )
    mixed_precision: bool = setting(
        False, doc="Stream and compute in the half precision of fp16_type; masters stay fp32."
    )
    fp16_type: Literal["float16", "bfloat16", "cbfloat16"] = setting(
        "float16", doc="The half precision of mixed_precision."
    )
    fields: dict[str, Any] = field(default_factory=dict)
    config: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from weightstream.models.registry import get_model_spec

        check(self, "model", skip=("fields",))
        convert("model.fields", self.fields, dict[str, Any])
        if self.name == "hf":
            self._hf_post_init()
            return
        try:
            spec = get_model_spec(self.name)
        except ValueError as e:
            raise ValueError(f"model.name: {e}") from None
        if self.preset is not None and self.preset not in spec.presets:
            hint = did_you_mean(self.preset, spec.presets)
            fix = (
                f"Its presets: {', '.join(map(repr, spec.presets))}. Fix: use one of them or "
                f"remove 'preset'."
                if spec.presets
                else "It has no presets. Fix: remove 'preset' and set the fields directly."
            )
            raise ValueError(
                f"model.preset: model {self.name!r} has no preset {self.preset!r}.{hint} {fix}"
            )
        config_hints = hints(spec.config_cls)
        config_names = init_names(spec.config_cls)
        unknown = [k for k in self.fields if k not in config_names]
        if unknown:
            raise unknown_keys_error(
                f"model ({self.name})", unknown, config_names + list(_MODEL_OWN_KEYS)
            )
        given = {
            key: convert(f"model.{key}", value, config_hints[key])
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
        values = as_section("model", raw)
        require("model", values, "name", "name: <model name, e.g. gpt2>")
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
            out.update(plain(self.fields))
            return out
        out.update(plain(self.config))
        return out


# The LoraConfig keys the section types itself; the others are checked against
# LoraConfig's fields and passed as they are (PeftParams.extra).
_PEFT_OWN_KEYS = (
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "exclude_modules",
    "bias",
    "use_rslora",
    "modules_to_save",
    "init_lora_weights",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "lora_bias",
)


@dataclass
class PeftParams:
    """``peft``: train LoRA adapters on a frozen ``model: {name: hf}`` (Note [lora on
    meta] in common/lora.py). The keys are the arguments of peft's ``LoraConfig``;
    the most used are typed here, any other ``LoraConfig`` field goes in
    :attr:`extra` (checked against ``LoraConfig``'s dataclass fields)."""

    r: int = setting(8, ge=1, fix="use a positive rank", doc="The adapters' rank.")
    lora_alpha: int | float = setting(
        8, gt=0, doc="The adapters' scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."
    )
    lora_dropout: float = setting(
        0.0, ge=0.0, doc="Dropout on the adapters' input (0: none, and the run is deterministic)."
    )
    target_modules: list[str] | str | None = setting(
        None,
        doc="The modules that get adapters: names or name suffixes (q_proj, v_proj), a regular "
        "expression, or 'all-linear'; null: peft's default for the model type.",
    )
    exclude_modules: list[str] | str | None = setting(
        None, doc="Modules that get no adapter even where target_modules matches them."
    )
    bias: Literal["none", "all", "lora_only"] = setting(
        "none", doc="Which biases train besides the adapters."
    )
    use_rslora: bool = setting(False, doc="Rank-stabilised scale lora_alpha / sqrt(r).")
    modules_to_save: list[str] | None = setting(
        None,
        doc="Modules trained whole beside the adapters (lm_head): copied from the base by the "
        "warm start, saved in every checkpoint.",
    )
    init_lora_weights: bool | Literal["gaussian"] = setting(
        True,
        doc="lora_A as nn.Linear draws it (true) or N(0, 1/r) ('gaussian'), lora_B zeros; "
        "false: lora_A and lora_B as nn.Linear draws them (the adapters change the model "
        "from step 0). Rules that read the base weights (pissa, olora, ...) are refused.",
    )
    layers_to_transform: list[int] | int | None = setting(
        None, doc="Only these layer indices get adapters (with layers_pattern)."
    )
    layers_pattern: list[str] | str | None = setting(
        None, doc="The name of the model's layer list (layers, h) for layers_to_transform."
    )
    rank_pattern: dict[str, int] = setting(
        default_factory=dict, doc="Per-module ranks: a name pattern -> r."
    )
    alpha_pattern: dict[str, int | float] = setting(
        default_factory=dict, doc="Per-module alphas: a name pattern -> lora_alpha."
    )
    fan_in_fan_out: bool = setting(
        False, doc="The target layers store [in, out] (GPT-2's Conv1D): set true for them."
    )
    lora_bias: bool = setting(False, doc="Give lora_B a trained bias.")
    extra: dict[str, Any] = field(default_factory=dict)
    config: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from weightstream.common import lora

        s = "peft"
        init = self.init_lora_weights
        if isinstance(init, str) and init not in lora.LORA_INITS:
            raise ValueError(
                f"{s}.init_lora_weights: {init!r} is not supported with a streamed base model "
                "(its adapters are drawn before the base weights are read; Note [lora on meta] "
                "in common/lora.py). Fix: use true, false or 'gaussian'."
            )
        check(self, s, skip=("extra",))
        convert(f"{s}.extra", self.extra, dict[str, Any])
        valid = lora.config_fields()
        unknown = [k for k in self.extra if k not in valid]
        if unknown:
            raise unknown_keys_error(s, unknown, sorted(valid))
        for key, why in lora.UNSUPPORTED.items():
            f = valid.get(key)
            if key in self.extra and f is not None and self.extra[key] != _field_default(f):
                raise ValueError(
                    f"{s}.{key}: not supported with a streamed base model ({why}). Fix: "
                    f"remove {key} from the peft section."
                )
        if "task_type" in self.extra and self.extra["task_type"] not in ("CAUSAL_LM", None):
            raise ValueError(
                f"{s}.task_type: a 'model: {{name: hf}}' is a causal LM, got "
                f"{self.extra['task_type']!r}. Fix: remove task_type (CAUSAL_LM is the default)."
            )
        try:
            self.config = lora.lora_config(self.lora_values())
        except Exception as e:  # whatever peft's checks raise: these settings are wrong
            error = TypeError if isinstance(e, TypeError) else ValueError
            raise error(
                f"{s}: peft's LoraConfig refuses these settings: {e} Fix the keys it names."
            ) from None

    def lora_values(self) -> dict[str, Any]:
        """The arguments of peft's ``LoraConfig`` (lists as lists, the defaults left out)."""
        out = {}
        for name in _PEFT_OWN_KEYS:
            value = plain(getattr(self, name))
            if value != plain(_field_default(PeftParams.__dataclass_fields__[name])):
                out[name] = value
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, raw: Any) -> PeftParams:
        values = as_section("peft", raw)
        if "extra" in values:
            raise ValueError(
                "peft: 'extra' is not a key of the params file. Fix: write LoraConfig's keys "
                "directly in the peft section."
            )
        own = {k: values.pop(k) for k in _PEFT_OWN_KEYS if k in values}
        return cls(**own, extra=values)

    def to_dict(self) -> dict[str, Any]:
        out = {name: plain(getattr(self, name)) for name in _PEFT_OWN_KEYS}
        out.update(plain(self.extra))
        return out


def _field_default(f) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING

"""The params file's ``model`` section: a model of the registry, its config, its precision."""

from __future__ import annotations

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

__all__ = ["ModelParams"]

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

"""Read a Hugging Face ``transformers`` configuration (``config.json``) from local files.

Shared by the models (``name: hf`` builds from it) and the checkpoint
converter (``--to hf`` writes it back); transformers is imported only when
used. Nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

from weightstream.common.schema import did_you_mean

CONFIG_FILE = "config.json"


# The oldest versions of the Hugging Face libraries the ``hf`` extra works with
# (pyproject.toml): transformers 5's weight-loading module (renames, the
# conversions ``--to hf`` reverts), peft's ``low_cpu_mem_usage`` adapters.
TRANSFORMERS_MIN = (5, 0)
PEFT_MIN = (0, 17)
_INSTALL = "pip install 'weightstream[hf]'"


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("5.24.0.dev0" -> (5, 24, 0))."""
    numbers = []
    for part in text.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def _checked(name: str, module, minimum: tuple[int, ...], what: str):
    found = getattr(module, "__version__", "0")
    if _version(found) < minimum:
        need = ".".join(map(str, minimum))
        raise ImportError(
            f"{what} needs {name}>={need}, but {name} {found} is installed. Fix: "
            f"{_INSTALL} (or pip install -U '{name}>={need}')."
        )
    return module


def transformers_module():
    """The ``transformers`` package, the one way into it: a missing or too old one
    (< 5) is an ImportError saying what to install."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"model name 'hf' needs the transformers package: {_INSTALL}") from e
    return _checked("transformers", transformers, TRANSFORMERS_MIN, "model name 'hf'")


def peft_module():
    """The ``peft`` package (LoRA: the params file's ``peft`` section, ``checkpoint
    convert --to peft``), checked as :func:`transformers_module` is; transformers
    is checked first, since peft imports it."""
    transformers_module()
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"LoRA (the peft section) needs the peft package: {_INSTALL}") from e
    return _checked("peft", peft, PEFT_MIN, "LoRA (the peft section)")


def file_in(path: str | os.PathLike, name: str) -> Path | None:
    """``path`` itself when it is a file, ``path/name`` when ``path`` is a folder holding
    it (a Hugging Face model folder), else None."""
    p = Path(path)
    if p.is_dir():
        p = p / name
    return p if p.is_file() else None


def config_path(path: str | os.PathLike) -> Path:
    """The ``config.json`` that ``path`` names (the file, or the folder holding it)."""
    found = file_in(path, CONFIG_FILE)
    if found is None:
        raise FileNotFoundError(
            f"hf_config: {path} is not a config.json nor a folder holding one. Fix: give "
            "the path of a Hugging Face model folder (as save_pretrained writes it) or of its "
            "config.json."
        )
    return found


def load_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None):
    """The transformers configuration at ``path``, with ``overrides`` applied."""
    transformers = transformers_module()
    file = config_path(path)
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model.hf_config: cannot read {file} as JSON ({e}).") from e
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            f"model.hf_config: {file} has no 'model_type'; it is not a transformers "
            "configuration. Fix: point hf_config at the config.json of a transformers model."
        )
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as e:
        raise ValueError(f"model.hf_config: {file}: {e}") from e
    known = set(config.to_dict())
    for key, value in (overrides or {}).items():
        if key == "attn_implementation":
            # Not a field of the file but from_pretrained's argument: the attention
            # kernels (sdpa, eager, flash_attention_2...); transformers checks the name
            # when it builds the model. Packed batches need sdpa or eager.
            config._attn_implementation = value
            continue
        if key not in known:
            hint = did_you_mean(key, sorted(known))
            raise ValueError(
                f"model.{key}: {model_type!r} configurations have no field {key!r}.{hint} "
                "Fix: use a field of the model's config.json, or remove the key."
            )
        setattr(config, key, value)
    # Training never reads a key/value cache; building one each step costs memory.
    config.use_cache = False
    return config

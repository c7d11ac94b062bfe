"""A LoRA run's base model (the params file's peft section): what its checkpoints record
of the base, the check that a resume or evaluation has the same base, and the base's
tensors read into the wrapped model.

Note [lora checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~
A LoRA run's checkpoint holds what trains and what resuming it needs: the
adapters (and modules_to_save copies) under the peft model's names, the
optimizer state of those only, the schedulers, grad scaler, data position,
generators and step; not the frozen base, which would cost its full size
(28 GB for a 7B model in fp32) in every checkpoint. The base is read again
from runconfig.checkpoint_path, the folder the run warm-started from, on
every resume and evaluation; the checkpoint's metadata records it
(``peft``: the folder's path then, and a fingerprint of its weight files,
common/lora.py's base_fingerprint), and a resume whose base folder is gone
or holds other weights stops before building anything, saying which base
it needs. ``checkpoint convert --to peft`` writes the adapters as peft's
save_pretrained does; ``--to hf`` merges them into the recorded base.
"""

from __future__ import annotations

from pathlib import Path

from weightstream import checkpoint as ckpt
from weightstream.checkpoint.weights import load_weights
from weightstream.common import lora


def base_record(base: str, peft) -> dict:
    """What a LoRA checkpoint records of its base model (``base``: the folder
    runconfig.checkpoint_path names) and its ``peft`` section."""
    path = Path(base).resolve()
    return {
        "base": str(path),
        "base_fingerprint": lora.base_fingerprint(path),
        "adapter": lora.ADAPTER,
        "lora_config": peft.lora_values(),
    }


def check_base_of(path: Path, base: str) -> None:
    """Refuse to resume (or evaluate) the LoRA checkpoint ``path`` on another base."""
    with ckpt.load(path) as state:
        metadata = state.get("metadata") if isinstance(state, dict) else None
        record = metadata.get("peft") if isinstance(metadata, dict) else None
        record = _read_small(record)
    if not isinstance(record, dict) or "base_fingerprint" not in record:
        raise ValueError(
            f"{path} is not a checkpoint of a LoRA run (its metadata records no base model), "
            "but the params file has a peft section. Fix: resume it with the params file it "
            "was written with, or train in a new model_dir (-o)."
        )
    base = Path(base)
    if not base.exists():
        raise ValueError(
            f"{path} holds LoRA adapters of the base model at {record.get('base')}, read "
            f"from runconfig.checkpoint_path; {base} does not exist. Fix: set "
            "runconfig.checkpoint_path to that base model folder (or a copy of it)."
        )
    if lora.base_fingerprint(base) != record["base_fingerprint"]:
        raise ValueError(
            f"{path} holds LoRA adapters of the base model at {record.get('base')}, but "
            f"runconfig.checkpoint_path {base} holds other weights (their files differ). "
            "Fix: set runconfig.checkpoint_path to the base the adapters were trained on."
        )


def load_base(model, base: str) -> None:
    """The frozen base's tensors, from the base folder, under their transformers
    names (Note [lora on meta]); the adapters keep their values."""
    names = lora.base_names(model)
    load_weights(
        model,
        Path(base),
        name_map=lambda name: (names.get(name) or name, False),
        only=lambda name: names.get(name) is not None,
        renames_of=model.get_base_model(),
    )


def trained_keys(model) -> tuple[str, ...]:
    """The names of the model's trainable tensors: what a LoRA checkpoint holds."""
    return tuple(name for name, q in model.named_parameters() if q.requires_grad)


def _read_small(value):
    return value.to_dict() if isinstance(value, ckpt.LazyStateDict) else value

"""The params file's ``train_input`` / ``eval_input`` sections: which data processor
and how to load its batches."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import InitVar, dataclass, field
from typing import Any

from weightstream.common.schema import (
    as_section,
    check,
    init_names,
    plain,
    require,
    setting,
    split_extra,
    unknown_keys_error,
)

__all__ = ["InputParams"]


@dataclass
class InputParams:
    """``train_input`` / ``eval_input``: which data processor and how to load its batches.

    Keys that are not fields (``seq_len``, ``image_size``, ...) go to ``extra`` and
    are passed to the data processor, which says which it accepts
    (``weightstream.data.processors.processor_keys``).
    """

    data_processor: str = setting(
        doc="The data processor that makes the batches (weightstream.data.processors; "
        "its own keys, such as seq_len, go in the same section)."
    )
    batch_size: int = setting(
        ge=1,
        fix="give the number of samples per batch",
        doc="Samples per batch (a step takes optimizer.grad_accum_steps batches).",
    )
    data_dir: str | list[str] | None = setting(
        None, doc="The processor's data: a directory, a file or a list of them."
    )
    shuffle: bool | None = setting(
        None, doc="Shuffle the samples; null: the training input is shuffled, eval is not."
    )
    shuffle_seed: int | None = setting(
        None, ge=0, doc="The shuffle's seed (default: drawn from the run's seed)."
    )
    drop_last: bool = setting(
        True,
        doc="Drop the last, partial batch of an epoch (an eval input too: the default eval "
        "then leaves those samples out); false keeps it, smaller.",
    )
    num_workers: int = setting(
        0, ge=0, doc="Loader worker processes; 0 loads in the training process."
    )
    prefetch_factor: int | None = setting(
        None, ge=1, doc="Batches each worker loads ahead (needs num_workers >= 1)."
    )
    persistent_workers: bool = setting(
        False, doc="Keep the workers alive between epochs (needs num_workers >= 1)."
    )
    extra: dict[str, Any] = field(default_factory=dict)
    section: InitVar[str] = "train_input"

    def __post_init__(self, section: str) -> None:
        check(self, section)
        if self.shuffle is None:
            self.shuffle = section == "train_input"
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
        clash = sorted(set(self.extra) & set(init_names(InputParams)))
        if clash:
            raise ValueError(
                f"{section}.extra repeats the field(s) {clash}. Fix: set them as fields."
            )
        _check_processor_keys(section, self.data_processor, self.extra)

    @classmethod
    def from_dict(cls, raw: Any, section: str = "train_input") -> InputParams:
        values = as_section(section, raw)
        require(section, values, "data_processor", "data_processor: <name>")
        require(section, values, "batch_size", "batch_size: <samples per step>")
        known, extra = split_extra(section, cls, values)
        return cls(**known, extra=extra, section=section)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.update(plain(out.pop("extra")))
        return out


def _check_processor_keys(section: str, processor: str, extra: dict[str, Any]) -> None:
    """Reject extra keys the data processor does not take.

    The processors module is looked up when the check runs (tests replace it;
    without it, only near-misspellings of InputParams fields such as
    ``batch_sise`` are rejected: other keys cannot be judged without the processor).
    """
    fields = [n for n in init_names(InputParams) if n != "extra"]
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
            raise unknown_keys_error(section, typos, fields)
        return
    try:
        accepted = set(processor_keys(processor))
    except (KeyError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ValueError(f"{section}.data_processor: {message}") from None
    unknown = [k for k in extra if k not in accepted]
    if unknown:
        raise unknown_keys_error(section, unknown, sorted(set(fields) | accepted))

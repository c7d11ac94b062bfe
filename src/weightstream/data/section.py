"""Reading a data processor's input section: typed getters, and the keys every processor shares.

Used by the processors of ``processors.py``. Errors name the key as the
params file spells it (``train_input.batch_size``) and say what to write instead.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightstream.common.schema import did_you_mean
from weightstream.data._checks import check_int

# The two names of the sequence length (``max_sequence_length``: the reference's).
SEQ_KEYS = frozenset({"seq_len", "max_sequence_length"})


class Section:
    """The input section being read: typed getters whose errors name ``section.key``.

    ``keys``: the keys processor ``name`` accepts; any other key is refused.
    """

    def __init__(
        self, name: str, params: Mapping[str, Any], is_training: bool, keys: frozenset[str]
    ) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(
                f"{'train_input' if is_training else 'eval_input'} must be a mapping of keys to "
                f"values, got {type(params).__name__}."
            )
        self.processor = name
        self.section = "train_input" if is_training else "eval_input"
        self.params = dict(params)
        unknown = sorted(set(self.params) - keys)
        if unknown:
            key = unknown[0]
            hint = did_you_mean(key, sorted(keys))
            raise ValueError(
                f"{self.section}.{key} is not a key of data_processor {name!r}.{hint} "
                f"Valid keys: {', '.join(sorted(keys))}."
            )

    def where(self, key: str) -> str:
        return f"{self.section}.{key}"

    def has(self, key: str) -> bool:
        return self.params.get(key) is not None

    def get(self, key: str, default: Any) -> Any:
        # A key given as null means "the default", as if it were absent: the
        # params parser writes every common key, with None for unset ones.
        value = self.params.get(key)
        return default if value is None else value

    def int_(self, key: str, default: int | None, minimum: int) -> int:
        value = self.get(key, default)
        if value is None:
            raise ValueError(
                f"{self.where(key)} is required by data_processor {self.processor!r}; add it."
            )
        check_int(self.where(key), value, minimum)
        return value

    def path_(self, key: str) -> str:
        value = self.get(key, None)
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError(f"{self.where(key)} must be a path, got {value!r}.")
        return os.fspath(value)

    def float_(self, key: str, default: float, low: float, high: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
            raise ValueError(
                f"{self.where(key)} must be a number strictly between {low} and {high}, got "
                f"{value!r}."
            )
        return float(value)

    def bool_(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise TypeError(
                f"{self.where(key)} must be true or false, got {type(value).__name__} {value!r}."
            )
        return value

    def choice(self, key: str, default: Any, choices: tuple) -> Any:
        value = self.get(key, default)
        if value not in choices:
            raise ValueError(
                f"{self.where(key)} must be one of {', '.join(map(repr, choices))}, got {value!r}."
            )
        return value

    def seq_len(self, default: int | None) -> int:
        """``seq_len``, or its reference name ``max_sequence_length`` (both: they must agree)."""
        given = {k: self.params[k] for k in sorted(SEQ_KEYS) if self.params.get(k) is not None}
        if len(given) == 2 and given["seq_len"] != given["max_sequence_length"]:
            raise ValueError(
                f"{self.where('seq_len')} ({given['seq_len']}) and "
                f"{self.where('max_sequence_length')} ({given['max_sequence_length']}) name the "
                "same setting with different values; keep one of them."
            )
        key = next(iter(given), "seq_len")
        return self.int_(key, default, minimum=1)

    def ignore(self, key: str, why: str) -> None:
        if self.has(key):
            warnings.warn(f"{self.where(key)} is ignored: {why}.", stacklevel=3)


@dataclass(frozen=True)
class LoaderSettings:
    """The common keys, checked; ``per_rank_batch`` is this rank's share of batch_size."""

    batch_size: int
    per_rank_batch: int
    shuffle: bool
    shuffle_seed: int
    drop_last: bool
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    rank: int
    num_ranks: int

    def worker_kwargs(self) -> dict[str, Any]:
        if self.num_workers == 0:
            return {"num_workers": 0}
        kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            "persistent_workers": self.persistent_workers,
        }
        if self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


def check_batch_share(where: str, batch_size: int, num_ranks: int) -> None:
    """Each of ``num_ranks`` data-parallel ranks takes the same share of a global batch."""
    if batch_size % num_ranks:
        raise ValueError(
            f"{where} = {batch_size} (the global batch) does not divide by the "
            f"{num_ranks} data-parallel ranks, and each rank must get the same share. Use a "
            f"multiple of {num_ranks}, e.g. {(batch_size // num_ranks + 1) * num_ranks}."
        )


def loader_settings(s: Section, is_training: bool, rank: int, num_ranks: int) -> LoaderSettings:
    """The common keys of ``s``, checked, for this rank of ``num_ranks``."""
    batch_size = s.int_("batch_size", None, minimum=1)
    check_batch_share(s.where("batch_size"), batch_size, num_ranks)
    num_workers = s.int_("num_workers", 0, minimum=0)
    prefetch = s.int_("prefetch_factor", None, minimum=1) if s.has("prefetch_factor") else None
    persistent = s.bool_("persistent_workers", False)
    if num_workers == 0:
        s.ignore("prefetch_factor", "it applies to worker processes and num_workers is 0")
        if persistent:
            s.ignore("persistent_workers", "it applies to worker processes and num_workers is 0")
            persistent = False
    return LoaderSettings(
        batch_size=batch_size,
        per_rank_batch=batch_size // num_ranks,
        shuffle=s.bool_("shuffle", is_training),
        shuffle_seed=s.int_("shuffle_seed", 0, minimum=0),
        drop_last=s.bool_("drop_last", True),
        num_workers=num_workers,
        prefetch_factor=prefetch,
        persistent_workers=persistent,
        rank=rank,
        num_ranks=num_ranks,
    )

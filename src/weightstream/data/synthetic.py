"""SyntheticDataset: the same sample at every index, for benchmarks and smoke tests.

It isolates the rest of a run from input: no file I/O, no decoding, no
randomness, so throughput measured with it is the model's, and results do
not depend on where or how often the data is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from weightstream.data._checks import check_int

__all__ = ["SyntheticDataset"]


class SyntheticDataset(torch.utils.data.IterableDataset):
    """A dataset whose every sample is built from ``sample_spec``.

    ``sample_spec`` is a tensor, or a dict / list / tuple nesting tensors
    (numbers and None are passed through). A tensor on the ``meta`` device
    (``torch.empty(shape, dtype=..., device="meta")``) is a spec: its sample
    is zeros of that shape and dtype. Any other tensor is the sample's value.
    Every sample is a fresh copy with the structure of ``sample_spec``, so a
    consumer that modifies a sample in place does not change the next one.

    With ``num_samples`` the dataset has that length and supports indexing
    (``ds[i]``); with None it is an infinite stream, so a loader over it needs
    ``num_steps`` or ``max_steps``. As an IterableDataset it splits its
    samples among the worker processes of a torch DataLoader (worker ``w``
    yields samples ``w, w + num_workers, ...``) so ``num_workers > 0`` does
    not multiply the sample count.

    Example::

        ds = SyntheticDataset({"x": torch.empty(3, 224, 224, device="meta"),
                               "y": torch.tensor(1)}, num_samples=1024)
        loader = torch.utils.data.DataLoader(ds, batch_size=32)
    """

    def __init__(self, sample_spec: Any, num_samples: int | None = None) -> None:
        super().__init__()
        if num_samples is not None:
            check_int("num_samples", num_samples, minimum=1)
        _validate(sample_spec, path="sample_spec")
        self.sample_spec = sample_spec
        self.num_samples = num_samples

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError(
                "This SyntheticDataset is infinite (num_samples=None) and has no length; "
                "give num_samples, or run it with num_steps/max_steps."
            )
        return self.num_samples

    def __getitem__(self, index: int) -> Any:
        if self.num_samples is not None and not -self.num_samples <= index < self.num_samples:
            raise IndexError(
                f"SyntheticDataset index {index} out of range for {self.num_samples} samples."
            )
        return _materialize(self.sample_spec)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self.num_samples is None:
            while True:
                yield _materialize(self.sample_spec)
        count = max(0, math.ceil((self.num_samples - worker) / workers))
        for _ in range(count):
            yield _materialize(self.sample_spec)


def _validate(spec: Any, path: str) -> None:
    if isinstance(spec, torch.Tensor) or spec is None or isinstance(spec, (bool, int, float)):
        return
    if isinstance(spec, dict):
        for key, value in spec.items():
            _validate(value, f"{path}[{key!r}]")
        return
    if isinstance(spec, (list, tuple)):
        for i, value in enumerate(spec):
            _validate(value, f"{path}[{i}]")
        return
    raise TypeError(
        f"{path} is a {type(spec).__name__}; a sample spec holds tensors (a meta tensor such "
        "as torch.empty(shape, device='meta') stands for zeros of its shape and dtype), "
        "numbers or None, nested in dicts, lists and tuples."
    )


def _materialize(spec: Any) -> Any:
    if isinstance(spec, torch.Tensor):
        if spec.device.type == "meta":
            return torch.zeros(spec.shape, dtype=spec.dtype)
        return spec.clone()
    if isinstance(spec, dict):
        return type(spec)((k, _materialize(v)) for k, v in spec.items())
    if isinstance(spec, tuple) and hasattr(spec, "_fields"):  # namedtuple
        return type(spec)(*(_materialize(v) for v in spec))
    if isinstance(spec, (list, tuple)):
        return type(spec)(_materialize(v) for v in spec)
    return spec

"""How many steps a run takes from a loader: :func:`compute_num_steps` (seed 003).

A *step* is one optimizer step. With gradient accumulation one step consumes
``grad_accum_steps`` batches of the loader, so lengths measured in loader
batches (``len(dl)``, ``steps_per_epoch``) are divided by ``grad_accum_steps``
to get steps, while ``num_steps``, ``max_steps`` and ``initial_step`` are
already counted in steps. With the default ``grad_accum_steps=1`` a step is a
batch.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightstream.data._checks import check_int

__all__ = ["compute_num_steps", "loader_length"]


def loader_length(dl: Iterable) -> int | None:
    """``len(dl)``, or None when the loader has no length (e.g. an IterableDataset without one)."""
    try:
        return len(dl)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        # torch raises TypeError for an IterableDataset without __len__; some
        # user loaders raise NotImplementedError from an abstract __len__.
        return None


def compute_num_steps(
    dl: Iterable,
    initial_step: int = 0,
    num_steps: int | None = None,
    max_steps: int | None = None,
    num_epochs: int | None = None,
    steps_per_epoch: int | None = None,
    grad_accum_steps: int = 1,
) -> int:
    """The number of steps to run on ``dl``.

    Rules (reference semantics):

    - ``num_epochs`` and ``num_steps`` are mutually exclusive;
    - ``steps_per_epoch`` (in loader batches) defaults to ``len(dl)`` and must
      not exceed it; with ``grad_accum_steps > 1`` an epoch is
      ``steps_per_epoch // grad_accum_steps`` steps;
    - ``num_epochs`` needs the epoch length: it is an error when ``dl`` has no
      length and ``steps_per_epoch`` is not given;
    - the result is ``min(num_epochs * steps_per_epoch, num_steps,
      max_steps - initial_step)`` over the terms that are given; at least one
      of ``num_steps``, ``max_steps``, ``num_epochs`` must be given, and
      ``max_steps`` must be greater than ``initial_step``.

    The loader is iterated again when it runs out, so ``num_steps`` may exceed
    ``len(dl)``. Of a ``cstorch.utils.data.DataLoader``, an epoch is a pass over
    the loader its ``input_fn`` made, not the steps it was asked to run.
    """
    from weightstream.data.dataloader import DataLoader

    if isinstance(dl, DataLoader):
        dl = dl.loader
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("initial_step", initial_step, minimum=0)
    for name, value in (
        ("num_steps", num_steps),
        ("max_steps", max_steps),
        ("num_epochs", num_epochs),
        ("steps_per_epoch", steps_per_epoch),
    ):
        if value is not None:
            check_int(name, value, minimum=1)

    if num_epochs is not None and num_steps is not None:
        raise ValueError(
            f"num_epochs ({num_epochs}) and num_steps ({num_steps}) are mutually exclusive: "
            "pass num_steps to run a fixed number of steps, or num_epochs (optionally with "
            "steps_per_epoch) to run whole epochs, not both. max_steps may cap either."
        )
    if num_steps is None and max_steps is None and num_epochs is None:
        raise ValueError(
            "No step count given: pass num_steps, max_steps or num_epochs "
            "(e.g. DataLoader(input_fn, num_steps=1000))."
        )
    if max_steps is not None and max_steps <= initial_step:
        raise ValueError(
            f"max_steps ({max_steps}) must be greater than initial_step ({initial_step}): "
            f"the run would have no steps left. Raise max_steps above {initial_step}, or "
            "use num_steps to run a number of steps counted from initial_step."
        )

    length = loader_length(dl)
    if steps_per_epoch is not None and length is not None and steps_per_epoch > length:
        raise ValueError(
            f"steps_per_epoch ({steps_per_epoch}) exceeds the length of the dataloader "
            f"({length} batches): an epoch cannot be longer than one pass over the data. "
            f"Pass steps_per_epoch <= {length}, or leave it unset to use {length}."
        )
    batches_per_epoch = steps_per_epoch if steps_per_epoch is not None else length

    totals = []
    if num_epochs is not None:
        if batches_per_epoch is None:
            raise ValueError(
                f"num_epochs ({num_epochs}) needs the length of an epoch, but the dataloader "
                f"has no length ({type(dl).__name__} does not define __len__). Pass "
                "steps_per_epoch to say how many batches make an epoch, or use num_steps."
            )
        if batches_per_epoch < grad_accum_steps:
            raise ValueError(
                f"An epoch of {batches_per_epoch} batch(es) is shorter than one step of "
                f"grad_accum_steps={grad_accum_steps} batches, so num_epochs would run no "
                "steps. Use a longer epoch (more data or a larger steps_per_epoch), fewer "
                "grad_accum_steps, or num_steps."
            )
        totals.append(num_epochs * (batches_per_epoch // grad_accum_steps))
    if num_steps is not None:
        totals.append(num_steps)
    if max_steps is not None:
        totals.append(max_steps - initial_step)
    return min(totals)

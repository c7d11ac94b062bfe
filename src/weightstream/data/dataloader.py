"""DataLoader: runs a user's input function for a fixed number of steps, restartably.

Note [restart by replay]: a torch DataLoader cannot say where it is, and its
order (shuffle, worker seeds) comes from RNG draws made when a pass begins.
So this wrapper records, for the pass in progress, everything that decides
that pass (the states of the generators it draws from, the user's own
dataset/sampler state, and a private RNG stream seeded from a per-run seed
and the pass number) plus how many batches of the pass were consumed. A
restored loader puts those back, begins the same pass, and skips the consumed
batches: in the DistributedSampler when one orders the data (no data is
loaded), otherwise by drawing and discarding them. A loader that keeps its own
state (``state_dict``/``load_state_dict`` on the loader) is trusted instead.

Note [private data RNG]: the underlying loader draws from the global torch RNG
(RandomSampler's seed, the worker base seed, random transforms with
``num_workers=0``). If it shared the user's stream, the order of epoch 2 would
depend on how much dropout the model drew during epoch 1, which a restart
cannot reproduce. Every call into the underlying loader therefore runs with
the global CPU RNG swapped for a stream owned by this DataLoader, reseeded at
each pass from (seed, pass number). As a side effect the model's random
stream no longer depends on data loading. Python's ``random`` and numpy's
global RNG are not swapped: draw from torch, or seed from the sample index.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from weightstream.context import current_config
from weightstream.data import loader_parts, resume, streaming
from weightstream.data._checks import check_int
from weightstream.data.sampler import DistributedSampler
from weightstream.data.state import (
    aggregate_state_dict,
    deaggregate_state_dict,
    is_aggregated,
    validate_worker_state,
)
from weightstream.data.steps import compute_num_steps
from weightstream.data.streaming import get_streaming_rank, num_streamers

__all__ = ["DataLoader"]


class _DataRNG:
    """The torch CPU RNG stream the underlying loader draws from; see Note [private data RNG].

    Used as a context manager around each call into the loader: it swaps its
    state in and, on exit, keeps the advanced state and puts the caller's back.
    """

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self._saved: torch.Tensor | None = None

    def reseed(self, seed: int, epoch: int) -> None:
        # SeedSequence mixes (seed, epoch) so consecutive passes get unrelated streams.
        mixed = int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0])
        self.state = torch.Generator().manual_seed(mixed).get_state()

    def __enter__(self) -> None:
        assert self.state is not None, "reseed() before the first use"
        self._saved = torch.get_rng_state()
        torch.set_rng_state(self.state)

    def __exit__(self, *exc: object) -> None:
        self.state = torch.get_rng_state()
        torch.set_rng_state(self._saved)
        self._saved = None


class DataLoader:
    """Build the per-process loader with ``input_fn(*args, **kwargs)`` and yield a fixed number of batches.

    ``input_fn`` returns a torch DataLoader or any re-iterable; each streamer
    (data-parallel rank) calls it itself, so it should shard its data by
    :func:`get_streaming_rank` / :func:`num_streamers` (or use
    :class:`DistributedSampler`); an input_fn that does not is taken to make
    global batches, and each rank gets its share of every one (Note [rank
    share]). The keyword arguments ``num_steps``,
    ``max_steps``, ``num_epochs``, ``steps_per_epoch``, ``initial_step`` and
    ``grad_accum_steps`` belong to this class (see :func:`compute_num_steps`);
    all other arguments go to ``input_fn``.

    Iterating yields ``len(self)`` batches: ``num_steps * grad_accum_steps``,
    where ``num_steps = compute_num_steps(...)``. When the underlying loader
    runs out (or, with ``steps_per_epoch``, after that many batches) a new
    pass begins: a new epoch of the torch DataLoader, with ``set_epoch(epoch)``
    called first on samplers and datasets that have it. Iterating again
    continues the data where the previous iteration stopped.

    ``state_dict()`` gives this worker's position (module
    ``weightstream.data.state``); a new DataLoader built with the same
    ``input_fn`` and arguments continues at exactly the next batch after
    ``load_state_dict(sd)``, which must come before iteration starts. See
    Note [restart by replay] for how, and its limits: the loader must be
    deterministic given its RNG draws, and with ``num_workers > 0`` and a
    DistributedSampler, random transforms inside worker processes are not
    replayed (indices are).
    """

    def __init__(
        self,
        input_fn: Callable[..., Iterable],
        *args: Any,
        num_steps: int | None = None,
        max_steps: int | None = None,
        num_epochs: int | None = None,
        steps_per_epoch: int | None = None,
        initial_step: int | None = None,
        grad_accum_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        if not callable(input_fn):
            hint = (
                " To use an existing loader, wrap it: DataLoader(lambda: loader, num_steps=...)."
                if isinstance(input_fn, Iterable)
                else ""
            )
            raise TypeError(
                "DataLoader's first argument must be a function that builds the loader "
                f"(input_fn), got {type(input_fn).__name__}.{hint}"
            )
        if initial_step is not None:
            check_int("initial_step", initial_step, minimum=0)
        with streaming.watching() as watch:
            loader = input_fn(*args, **kwargs)
        # Each rank's share of every batch, when input_fn makes global batches
        # (Note [rank share]).
        self._share: tuple[int, int] | None = None
        if num_streamers() > 1 and not watch.consulted and not loader_parts.shards_itself(loader):
            self._share = (get_streaming_rank(), num_streamers())
        if not isinstance(loader, Iterable):
            raise TypeError(
                f"input_fn must return a torch DataLoader or another iterable, got "
                f"{type(loader).__name__}."
            )
        self._loader = loader
        self._step_kwargs = {
            "num_steps": num_steps,
            "max_steps": max_steps,
            "num_epochs": num_epochs,
            "steps_per_epoch": steps_per_epoch,
            "grad_accum_steps": grad_accum_steps,
        }
        self._initial_step_given = initial_step is not None
        self._initial_step = initial_step or 0
        self._num_steps = compute_num_steps(loader, self._initial_step, **self._step_kwargs)
        self._grad_accum_steps = grad_accum_steps
        self._steps_per_epoch = steps_per_epoch
        self._stateful = loader_parts.is_stateful(loader)

        # Seed of the private data RNG (Note [private data RNG]); it travels in
        # the state so a restored run draws the same streams. Reading
        # initial_seed() consumes nothing from the user's RNG.
        self._seed = torch.initial_seed() % 2**63
        self._rng = _DataRNG()
        # Position: pass number and batches consumed in it.
        self._epoch = 0
        self._batch_in_epoch = 0
        self._it: Iterator | None = None  # iterator of the pass in progress
        self._pass_limit: int | None = None  # batches in this pass, when known
        self._pass_start: dict | None = None  # loader_parts.capture() when the pass began
        self._restore: dict | None = None  # loaded position, applied when iteration begins
        # Counters of the worker record.
        self._worker_step = 0
        self._samples_streamed = 0
        self._batches_run = 0  # batches yielded by this object (appliance_step counts from here)
        self._started = False
        self._generation = 0  # which __iter__ may advance the position

    # -- sizes -----------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """Steps one iteration runs (each step is ``grad_accum_steps`` batches)."""
        return self._num_steps

    @property
    def loader(self) -> Iterable:
        """The object ``input_fn`` returned."""
        return self._loader

    def __len__(self) -> int:
        return self._num_steps * self._grad_accum_steps

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> Iterator:
        self._started = True
        self._generation += 1
        return self._iterate(self._generation)

    def _iterate(self, generation: int) -> Iterator:
        from weightstream.context import LoaderSteps
        from weightstream.executor import only_compiling, step_context

        # A run that executes nothing needs the batch its compile plans for, and no
        # other (Note [compile only] in weightstream/executor.py).
        compiling = only_compiling() is not None
        count = 1 if compiling else len(self)
        # Checkpoint closures count this iteration's steps (Note [checkpoint steps]), each
        # of grad_accum_steps batches.
        steps = LoaderSteps(self._initial_step + self._batches_run // self._grad_accum_steps,
                            1 if compiling else self._num_steps)  # fmt: skip
        first = True  # compared over the ranks (Note [rank share])
        for _ in range(count):
            if generation != self._generation:
                raise RuntimeError(
                    "This iteration of the DataLoader was superseded: a newer `for ... in "
                    "dataloader` started, and both cannot advance one position. Finish or drop "
                    "the old iterator."
                )
            batch = self._next_batch()
            if first and num_streamers() > 1:
                streaming.check_first_batch(batch, shared=self._share is not None)
            first = False
            if self._share is not None:
                batch = streaming.rank_share(batch, *self._share)
            # Count before yielding: a state_dict() taken in the loop body includes this batch.
            self._worker_step += 1
            self._batches_run += 1
            self._samples_streamed += streaming.batch_size_of(batch)
            step_context().loader = steps  # the steps of this batch are this loader's
            yield batch

    def _next_batch(self) -> Any:
        empty_passes = 0
        while True:
            if self._it is None:
                if empty_passes > 1:
                    raise ValueError(
                        "The loader built by input_fn yielded no batches in two passes in a row "
                        f"(passes {self._epoch - 2} and {self._epoch - 1}). "
                        "If input_fn returns a generator or another one-shot iterator, return a "
                        "re-iterable object instead (a torch DataLoader, a list), since the "
                        "loader is iterated again when it runs out; otherwise check that its "
                        "dataset is not empty."
                    )
                self._begin_pass()
                empty_passes += 1
            if self._pass_limit is not None and self._batch_in_epoch >= self._pass_limit:
                self._end_pass()
                continue
            try:
                with self._rng:
                    batch = next(self._it)
            except StopIteration:
                self._end_pass()
                continue
            self._batch_in_epoch += 1
            return batch

    def _begin_pass(self) -> None:
        """Start pass ``self._epoch`` (Note [restart by replay]), restoring a loaded position."""
        restore, self._restore = self._restore, None
        loader = self._loader
        skip = 0
        if restore is None:
            self._pass_start = None if self._stateful else loader_parts.capture(loader)
        elif not self._stateful:
            self._apply_capture(restore["generators"], restore["user_state"])
            self._pass_start = {k: restore[k] for k in ("generators", "user_state")}
            skip = restore["batch_in_epoch"]
        loader_parts.set_epoch(loader, self._epoch)
        if restore is not None and self._stateful and restore["user_state"] is not None:
            loader.load_state_dict(restore["user_state"]["loader"])
        length = None if self._stateful else loader_parts.trusted_length(loader)
        spe = self._steps_per_epoch if self._steps_per_epoch is not None else length
        # Whole steps per pass, so a gradient-accumulation step does not span two
        # epochs (unless a pass is shorter than one step: then it has to).
        ga = self._grad_accum_steps
        self._pass_limit = None if spe is None else (spe // ga) * ga if spe >= ga else spe
        target = loader_parts.fast_forward_target(loader) if skip else None
        if target is not None:
            sampler, items_per_batch = target
            sampler.fast_forward(skip * items_per_batch)
        self._rng.reseed(self._seed, self._epoch)
        with self._rng:
            self._it = iter(loader)
        if skip and target is None:
            self._replay(skip)
        if restore is not None:
            self._batch_in_epoch = restore["batch_in_epoch"]
            if restore["rng_state"] is not None:
                # Where the stream stood after the last consumed batch (equal to
                # the replayed one; needed when the sampler skipped instead).
                self._rng.state = restore["rng_state"].clone()

    def _replay(self, batches: int) -> None:
        for i in range(batches):
            try:
                with self._rng:
                    next(self._it)
            except StopIteration:
                raise ValueError(
                    f"The restored DataLoader state is {batches} batches into pass "
                    f"{self._epoch}, but the loader built by input_fn has only {i} there. Build "
                    "the DataLoader with the same input_fn and arguments as the run that saved "
                    "the state."
                ) from None

    def _end_pass(self) -> None:
        # Dropping the iterator shuts down its worker processes.
        self._it = None
        self._epoch += 1
        self._batch_in_epoch = 0
        self._pass_limit = None
        self._pass_start = None

    def _apply_capture(self, gen_states: dict, user_state: dict | None) -> None:
        gens = loader_parts.generators(self._loader)
        for name, state in gen_states.items():
            if name in gens:
                gens[name].set_state(state)
        parts = loader_parts.stateful_parts(self._loader)
        for name, state in (user_state or {}).items():
            if name in parts:
                parts[name].load_state_dict(copy.deepcopy(state))

    # -- restartable state ------------------------------------------------------------

    def state_dict(self) -> dict:
        """This worker's position and counters (see ``weightstream.data.state``)."""
        if self._restore is not None:
            position = {k: self._restore[k] for k in resume.POSITION_KEYS}
            user_state = self._restore["user_state"]
        else:
            if self._it is not None and (
                self._pass_limit is None or self._batch_in_epoch < self._pass_limit
            ):
                # Mid-pass: what the pass began from, and how far into it we are.
                epoch, batch, rng_state = self._epoch, self._batch_in_epoch, self._rng.state.clone()
                start = self._pass_start
            else:
                # Between passes (or at the end of a pass of known length): the next
                # pass begins from the loader as it is now.
                epoch, batch, rng_state = self._epoch + (1 if self._it is not None else 0), 0, None
                start = None if self._stateful else loader_parts.capture(self._loader)
            position = {
                "seed": self._seed,
                "epoch": epoch,
                "batch_in_epoch": batch,
                "rng_state": rng_state,
                "generators": {} if self._stateful else start["generators"],
            }
            user_state = (
                {"loader": self._loader.state_dict()} if self._stateful else start["user_state"]
            )
        config = current_config()
        return copy.deepcopy(
            {
                "local_worker_id": 0,  # one input worker per process (Note in streaming.py)
                "num_workers_per_csx": config.num_workers_per_csx,
                "num_csx": config.num_csx,
                "wse_id": get_streaming_rank(),
                "appliance_step": self._initial_step + self._batches_run // self._grad_accum_steps,
                "worker_step": self._worker_step,
                "samples_streamed": self._samples_streamed,
                "user_state": user_state or None,
                "position": position,
                "layout": {
                    "num_streamers": num_streamers(),
                    "input_workers": loader_parts.input_workers(self._loader),
                },
                "global_position": self._global_position(
                    position["epoch"], position["batch_in_epoch"]
                ),
            }
        )

    def _global_order(self) -> tuple[DistributedSampler, int] | None:
        """The sampler whose global order alone decides the batches, and its items per batch."""
        return None if self._stateful else loader_parts.fast_forward_target(self._loader)

    def _global_position(self, epoch: int, batch_in_epoch: int) -> dict | None:
        """Note [global position] in weightstream.data.state, or None without a global order."""
        target = self._global_order()
        if target is None:
            return None
        order = resume.order_settings(*target)
        return {
            "epoch": epoch,
            # Each rank yields one batch of every global batch, so its count is the global one.
            "batches_in_epoch": batch_in_epoch,
            "samples_in_epoch": batch_in_epoch * order["global_batch_size"],
            **order,
        }

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Continue from a state saved by ``state_dict()`` (this worker's, or an aggregated one).

        Must be called before iteration starts. strict: a state with wrong or
        missing keys, or saved by another worker or a differently built loader,
        raises ValueError; otherwise it warns and loads what matches. Unless
        ``initial_step`` was given, the run continues from the saved
        ``appliance_step`` (which shortens a ``max_steps`` run accordingly).

        A state saved by another number of streamers loads when a
        DistributedSampler orders the data and the global batch and the order
        are unchanged (Note [another number of ranks]); a changed global batch,
        dataset or shuffle seed raises ValueError saying which, whatever
        ``strict`` says, since the position would count batches of another order.
        """
        if self._started:
            raise RuntimeError(
                "DataLoader.load_state_dict() must be called before iteration starts; this "
                "DataLoader was already iterated. Build a new DataLoader and load the state "
                "into it before the first `for batch in dataloader`."
            )
        streamers = num_streamers()
        if is_aggregated(state_dict):
            workers = deaggregate_state_dict(state_dict)
            saved_streamers = len(workers)  # one worker per streamer (Note in streaming.py)
        else:
            workers = [validate_worker_state(state_dict, strict=strict)]
            saved_streamers = resume.saved_layout(workers[0])[0]
        if saved_streamers is not None and saved_streamers != streamers:
            state = resume.rebase(
                self._loader, self._global_order(), workers, saved_streamers, strict
            )
        else:
            state = resume.own_worker_state(workers) if is_aggregated(state_dict) else workers[0]
            target = self._global_order()
            shared = self._share is not None or (
                state["global_position"] is not None and target is not None
            )
            resume.check_same_streamer(self._loader, state, strict, shared)
            if state["global_position"] is not None and target is not None:
                # Here too: a per-rank batch of another size is another global batch.
                resume.check_order(state["global_position"], target)
        position = resume.check_position(state["position"], strict)
        user_state = resume.check_user_state(
            self._loader, self._stateful, state["user_state"], strict
        )
        generators = position["generators"] if position is not None else {}
        generators = resume.check_generators(self._loader, generators, strict)

        if not self._initial_step_given:
            try:
                num_steps = compute_num_steps(
                    self._loader, state["appliance_step"], **self._step_kwargs
                )
            except ValueError as err:
                raise ValueError(
                    f"The loaded DataLoader state is at step {state['appliance_step']}: {err}"
                ) from None
            self._initial_step, self._num_steps = state["appliance_step"], num_steps
        elif self._initial_step != state["appliance_step"]:
            warnings.warn(
                f"initial_step={self._initial_step} was given but the loaded state is at step "
                f"{state['appliance_step']}; counting steps from initial_step.",
                stacklevel=2,
            )
        self._worker_step = state["worker_step"]
        self._samples_streamed = state["samples_streamed"]
        if position is None:
            return  # non-strict load without a position: the data starts from its beginning
        self._seed = position["seed"]
        self._epoch = position["epoch"]
        self._batch_in_epoch = position["batch_in_epoch"]
        self._restore = {**position, "generators": generators, "user_state": user_state}

    # The reference protocol has these on the loader; they combine any workers' states.
    aggregate_state_dict = staticmethod(aggregate_state_dict)
    deaggregate_state_dict = staticmethod(deaggregate_state_dict)

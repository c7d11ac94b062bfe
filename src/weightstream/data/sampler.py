"""DistributedSampler: one global sample order, shared out among the streamers.

Note [global order]: the order of samples is a property of the run, not of
the cluster. Each epoch has one *global sequence* of sample indices (a
permutation drawn from ``seed`` and the epoch, or ``0..N-1`` unshuffled),
grouped into batches of ``batch_size`` when that is set. Item ``j`` of the
sequence (a sample, or a batch) goes to shard ``j % num_shards``. Interleaving
the shards' outputs round-robin therefore gives back the global sequence,
whatever the number of shards: a run restarted on a different number of ranks
(with ``start_index`` = the number of samples streamed globally) continues the
same sequence. Only the tail of an epoch depends on the number of shards,
because ``drop_last``/``pad_last`` make every shard's share equally long (ranks
step in lock step).

Note [an uneven last round]: with ``drop_last=False`` (and no ``pad_last``) an epoch
may end in a round of fewer batches than shards: 6 samples left for 2 shards of
batches of 8 would be one batch of 6 for shard 0 and none for shard 1, which then
ends its pass a step early while shard 0 waits for it in a collective (a hang, or
gloo's size mismatch). With ``even_last_round`` (an evaluation's loaders: one pass,
whose metrics add up any batch sizes) such a round is dealt out in even parts instead
(3 and 3), so every shard yields as many batches and their interleaving is still the
global sequence; a tail of fewer samples than shards is refused when the sampler is
built. Training leaves it off: its loader goes on into the next pass, so every rank
steps as often, and a rank's gradients count as an equal share of the global batch,
which parts of unequal sizes would not be.

Note [moving a state between layouts]: the *order* settings (seed, shuffle,
dataset length, samples per epoch, tail rule) fix the global sequence; the
*layout* (num_shards, shard_index, batch_size) only says who yields which part
of it. A saved state is therefore loadable by a sampler of another layout when
the two give the same epoch sequence: shards step in lock step, so a shard
that yielded ``p`` items of a pass means the whole cluster consumed ``p``
rounds (``p * batch_size * num_shards`` samples) of it, which the new layout
continues from if that is a whole number of its own rounds. Epochs, the
``start_index`` skip and the epoch offset are counted in global samples and
epochs already, and carry over unchanged.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized

import numpy as np
import torch.utils.data

from weightstream.data._checks import check_int
from weightstream.data.streaming import get_streaming_rank, num_streamers

__all__ = ["DistributedSampler"]


def data_fingerprint(dataset: object) -> str | None:
    """A string that changes when the dataset's contents do, where the dataset has one.

    A dataset may carry it as ``fingerprint`` (this package's file-backed datasets: the
    text corpus, the Hugging Face rows); a ``datasets.Dataset`` carries its own as
    ``_fingerprint``. A resume compares it, so that data edited in place to the same
    number of samples is refused rather than continued at a position of another order.
    """
    for name in ("fingerprint", "_fingerprint"):
        value = getattr(dataset, name, None)
        if isinstance(value, str):
            return value
    return None


# Config fields that fix the global order; a state saved under other values cannot be resumed.
_ORDER_KEYS = ("seed", "shuffle", "num_samples", "drop_last", "pad_last")
# Added later than the others: a state without it is still accepted (not checked).
_OPTIONAL_ORDER_KEYS = ("dataset_len",)
# Config fields of the layout: who yields which part of the order (Note [moving a state
# between layouts]); a state may move to another layout.
_LAYOUT_KEYS = ("batch_size", "num_shards", "shard_index")
_POSITION_KEYS = ("epoch", "epoch_offset", "pending_skip", "pass_skip", "in_pass", "position")


class DistributedSampler(torch.utils.data.Sampler):
    """Yield this streamer's share of a global sample order that no cluster size changes.

    See Note [global order]. Use it as ``sampler=`` of a torch DataLoader (it
    yields sample indices) or, with ``batch_size`` set, as ``batch_sampler=``
    (it yields lists of indices).

    Args:
        dataset: any sized dataset; only ``len(dataset)`` is used.
        shuffle: draw each epoch's order from ``seed`` and the epoch
            (:meth:`set_epoch`); otherwise ``0, 1, ..., N-1``.
        seed: shuffling seed; None means 0, so that every rank agrees without
            communicating (a per-process random seed would give the ranks
            different orders and duplicate samples).
        start_index: skip this many samples of the global order before the
            first pass; may run past the end of an epoch, into the following
            epochs. Use the number of samples streamed globally to resume.
        shard: give each streamer its share (``j % num_shards``); False makes
            every streamer yield the whole sequence.
        batch_size: yield batches of this many indices (per streamer) and
            shard whole batches.
        drop_last: drop the epoch's tail that cannot give every shard a full,
            equal share.
        num_samples: samples per epoch; default ``len(dataset)``. Fewer takes
            the first ``num_samples`` of the epoch's order; more chains fresh
            permutations of the dataset.
        pad_last: instead of dropping the tail, pad it by wrapping around to
            the start of the epoch's order (needs ``drop_last=False``).
        num_shards, shard_index: override the streamer count and rank (default
            :func:`num_streamers` and :func:`get_streaming_rank`), e.g. to
            shard across processes that are not torch.distributed ranks.

    Each pass yields one epoch; call :meth:`set_epoch` between passes to
    reshuffle (``weightstream.utils.data.DataLoader`` does). Randomness inside
    the dataset should be derived from the sample index, not from a process's
    RNG stream, if it must be identical after a restart on another cluster.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int | None = None,
        start_index: int = 0,
        shard: bool = True,
        batch_size: int | None = None,
        drop_last: bool = True,
        num_samples: int | None = None,
        pad_last: bool = False,
        *,
        num_shards: int | None = None,
        shard_index: int | None = None,
        even_last_round: bool = False,
    ) -> None:
        super().__init__()
        try:
            self._dataset_len = len(dataset)
        except TypeError:
            raise TypeError(
                f"DistributedSampler needs a dataset with a length; {type(dataset).__name__} "
                "has no __len__. An IterableDataset shards itself: use "
                "get_streaming_rank()/num_streamers() inside its __iter__ instead."
            ) from None
        if self._dataset_len == 0:
            raise ValueError("DistributedSampler got an empty dataset; there is nothing to sample.")
        for name, value in (
            ("shuffle", shuffle),
            ("shard", shard),
            ("drop_last", drop_last),
            ("pad_last", pad_last),
            ("even_last_round", even_last_round),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}.")
        seed = 0 if seed is None else seed
        check_int("seed", seed, minimum=0)
        check_int("start_index", start_index, minimum=0)
        if batch_size is not None:
            check_int("batch_size", batch_size, minimum=1)
        if num_samples is not None:
            check_int("num_samples", num_samples, minimum=1)
        if drop_last and pad_last:
            raise ValueError(
                "drop_last=True and pad_last=True contradict each other (drop the epoch's "
                "uneven tail, or pad it). Pass drop_last=False together with pad_last=True."
            )
        if not shard:
            if num_shards not in (None, 1) or shard_index not in (None, 0):
                raise ValueError(
                    "num_shards/shard_index were given with shard=False, which makes every "
                    "streamer yield the whole sequence. Pass shard=True to shard."
                )
            num_shards, shard_index = 1, 0
        else:
            num_shards = num_streamers() if num_shards is None else num_shards
            shard_index = get_streaming_rank() if shard_index is None else shard_index
            check_int("num_shards", num_shards, minimum=1)
            check_int("shard_index", shard_index, minimum=0)
            if shard_index >= num_shards:
                raise ValueError(
                    f"shard_index ({shard_index}) must be < num_shards ({num_shards})."
                )
        if batch_size is not None and start_index % batch_size:
            raise ValueError(
                f"start_index ({start_index}) must be a multiple of batch_size ({batch_size}), "
                "since whole batches are skipped. Resume from a batch boundary."
            )

        self.shuffle = shuffle
        self.seed = seed
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.pad_last = pad_last
        self.even_last_round = even_last_round
        self.num_samples = self._dataset_len if num_samples is None else num_samples
        self.data_fingerprint = data_fingerprint(dataset)
        self.num_shards = num_shards
        self.shard_index = shard_index
        self.start_index = start_index

        self.epoch = 0
        epoch_samples = self._epoch_length()
        tail = epoch_samples % self._round()
        if even_last_round and batch_size is not None and 0 < tail < num_shards:
            raise ValueError(
                f"An epoch of {epoch_samples} samples leaves {tail} for its last global batch "
                f"(of {self._round()}: batch_size={batch_size} on each of {num_shards} "
                f"shards), fewer than the shards: {num_shards - tail} of them would have no "
                "batch while the others wait for them in their collectives. Fix: "
                f"drop_last=True (drops the {tail}), pad_last=True (repeats "
                f"{self._round() - tail} samples of the epoch's start), or a batch size "
                "that leaves no such tail."
            )
        if epoch_samples == 0:
            raise ValueError(
                f"An epoch of {self.num_samples} samples gives no full share to each of "
                f"{num_shards} shard(s) with batch_size={batch_size} and drop_last=True. Use "
                "fewer shards, a smaller batch_size, more samples, or drop_last=False."
            )
        # start_index may span whole epochs: those shift the epoch used for
        # shuffling, the rest is skipped at the start of the first pass.
        self._epoch_offset, self._pending_skip = divmod(start_index, epoch_samples)
        self._pass_skip = 0  # skip used by the current pass
        self._in_pass = False  # a pass started since the last set_epoch
        self._position = 0  # items this shard yielded in the current pass
        self._resume: int | None = None  # items to skip at the next __iter__ (restored state)

    # -- the global order -------------------------------------------------------------

    def _unit(self) -> int:
        return self.batch_size or 1

    def _round(self) -> int:
        # Samples in one round of items: one item for every shard.
        return self._unit() * self.num_shards

    def _epoch_length(self) -> int:
        """Samples in one epoch's global sequence, after dropping or padding its tail."""
        return _epoch_length(self.num_samples, self._round(), self.drop_last, self.pad_last)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of sample indices, ``num_samples`` long (before the tail rule)."""
        n = self._dataset_len
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64) % n
        # One independent permutation per repetition of the dataset; SeedSequence
        # mixes (seed, epoch, repetition) so neighbouring seeds give unrelated orders.
        reps = math.ceil(self.num_samples / n)
        parts = [
            np.random.default_rng([self.seed, epoch, rep]).permutation(n) for rep in range(reps)
        ]
        return np.concatenate(parts)[: self.num_samples]

    def _global_sequence(self, epoch: int) -> np.ndarray:
        order = self._epoch_order(epoch)
        length = self._epoch_length()
        if length <= len(order):
            return order[:length]
        # pad_last: wrap around to the start of the epoch's order.
        return order[np.arange(length) % len(order)]

    def _shard_items(self, epoch: int, skip: int) -> list:
        seq = self._global_sequence(epoch)[skip:]
        if self.batch_size is None:
            return seq[self.shard_index :: self.num_shards].tolist()
        bs, n = self.batch_size, self.num_shards
        if self.even_last_round and _tail_resplit(len(seq), bs, n):  # Note [an uneven last round]
            full = len(seq) // (bs * n) * (bs * n)
            batches = [seq[i : i + bs] for i in range(0, full, bs)]
            batches += np.array_split(seq[full:], n)
        else:
            batches = [seq[i : i + bs] for i in range(0, len(seq), bs)]
        return [b.tolist() for b in batches[self.shard_index :: n]]

    def _num_shard_items(self, skip: int) -> int:
        return _num_shard_items(
            self._epoch_length(), skip, self._unit(), self.num_shards, self.shard_index,
            self.even_last_round,
        )  # fmt: skip

    @property
    def dataset_len(self) -> int:
        """``len(dataset)``: part of the order (a state of another dataset does not fit)."""
        return self._dataset_len

    # -- Sampler protocol --------------------------------------------------------------

    def __iter__(self) -> Iterator:
        if self._resume is not None:
            start, self._resume = self._resume, None
            skip = self._pass_skip
        else:
            start, skip = 0, self._pending_skip
            self._pending_skip = 0
            self._pass_skip = skip
        self._in_pass = True
        items = self._shard_items(self.epoch + self._epoch_offset, skip)
        self._position = start
        for item in items[start:]:
            # Count before yielding: a consumer that stops here has received it.
            self._position += 1
            yield item

    def __len__(self) -> int:
        """Items (indices, or batches) the next pass yields on this shard."""
        if self._resume is not None:
            return max(0, self._num_shard_items(self._pass_skip) - self._resume)
        return self._num_shard_items(self._pending_skip)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next pass (and forget any position in the current one)."""
        check_int("epoch", epoch, minimum=0)
        self.epoch = epoch
        self._in_pass = False
        self._position = 0
        self._resume = None

    def fast_forward(self, items: int) -> None:
        """Make the next pass start ``items`` items (indices or batches) into this shard's share.

        A restored ``DataLoader`` uses this to skip the batches already
        consumed without loading them. Call it after :meth:`set_epoch`.
        """
        check_int("items", items, minimum=0)
        if not self._in_pass:
            # The pass has not started: it will use the pending start_index skip.
            self._pass_skip, self._pending_skip = self._pending_skip, 0
        self._in_pass = True
        self._resume = items
        self._position = items

    # -- restartable state -------------------------------------------------------------

    def state_dict(self) -> dict:
        """The order's configuration and this shard's position in it."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "dataset_len": self._dataset_len,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "pad_last": self.pad_last,
            "num_shards": self.num_shards,
            "shard_index": self.shard_index,
            "epoch": self.epoch,
            "epoch_offset": self._epoch_offset,
            "pending_skip": self._pending_skip,
            "pass_skip": self._pass_skip,
            "in_pass": self._in_pass,
            "position": self._position,
        }

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Continue from ``state_dict``: the next pass resumes where the saved one stopped.

        The sampler must give the same global order as the one that saved the
        state (same seed, shuffle, dataset length, num_samples and tail rule).
        Its layout (num_shards, shard_index, batch_size) may differ when the
        epochs come out equally long and the saved position is a whole number
        of this sampler's rounds (Note [moving a state between layouts]).
        """
        self._load(self.adapt_state_dict(state_dict, strict))

    def adapt_state_dict(self, state_dict: dict, strict: bool = True) -> dict:
        """``state_dict`` (saved by a sampler of the same order) as this sampler's layout would save it.

        Raises ValueError naming what differs when the order differs, or when
        the saved position cannot be expressed in this layout. See
        :meth:`load_state_dict`.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"DistributedSampler.load_state_dict expects a dict, got {type(state_dict).__name__}."
            )
        expected = set(_ORDER_KEYS) | set(_LAYOUT_KEYS) | set(_POSITION_KEYS)
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected - set(_OPTIONAL_ORDER_KEYS))
        if missing:
            raise ValueError(
                f"DistributedSampler state is missing key(s) {missing}; pass a dict returned "
                "by DistributedSampler.state_dict()."
            )
        if unexpected:
            message = f"DistributedSampler state has unexpected key(s) {unexpected}"
            if strict:
                raise ValueError(
                    message + "; pass load_state_dict(sd, strict=False) to ignore them."
                )
            warnings.warn(message + "; ignoring them.", stacklevel=3)
        mine = self.state_dict()
        order_keys = _ORDER_KEYS + tuple(k for k in _OPTIONAL_ORDER_KEYS if k in state_dict)
        differ = [k for k in order_keys if state_dict[k] != mine[k]]
        if differ:
            details = ", ".join(f"{k}: saved {state_dict[k]!r}, here {mine[k]!r}" for k in differ)
            raise ValueError(
                f"DistributedSampler state was saved with a different order ({details}). Build "
                "the sampler with the saved settings, or start a new order (without the state)."
            )
        for key in ("epoch", "epoch_offset", "pending_skip", "pass_skip", "position"):
            check_int(key, state_dict[key], minimum=0)
        state = {**mine, **{k: state_dict[k] for k in _POSITION_KEYS}}
        if all(state_dict[k] == mine[k] for k in _LAYOUT_KEYS):
            return state
        # Another layout: Note [moving a state between layouts].
        saved_unit = state_dict["batch_size"] or 1
        saved_round = saved_unit * state_dict["num_shards"]
        saved_length = _epoch_length(self.num_samples, saved_round, self.drop_last, self.pad_last)
        layout = (
            f"batch_size={state_dict['batch_size']} x num_shards={state_dict['num_shards']}, "
            f"here batch_size={self.batch_size} x num_shards={self.num_shards}"
        )
        if saved_length != self._epoch_length():
            raise ValueError(
                f"DistributedSampler state was saved by another layout ({layout}) whose epochs "
                f"hold {saved_length} samples, but this sampler's hold {self._epoch_length()} "
                "(the tail rule cuts them to whole rounds of batch_size x num_shards), so the "
                "two do not continue the same sequence. Choose batch_size and num_shards whose "
                f"product is {saved_round}, as when the state was saved."
            )
        position = state_dict["position"]
        saved_items = _num_shard_items(
            saved_length,
            state_dict["pass_skip"],
            saved_unit,
            state_dict["num_shards"],
            state_dict["shard_index"],
            self.even_last_round,  # a setting of the loader, not of the order
        )
        if not state_dict["in_pass"]:
            position = 0  # no pass begun: nothing consumed yet
        elif position >= saved_items:
            position = self._num_shard_items(state_dict["pass_skip"])  # the pass was finished
        else:
            consumed = position * saved_round  # every shard yielded as many items (lock step)
            if consumed % self._round():
                raise ValueError(
                    f"DistributedSampler state was saved {consumed} samples into a pass by "
                    f"another layout ({layout}); that is not a whole number of this sampler's "
                    f"rounds of {self._round()} samples, so no shard would start on the next "
                    f"sample. Choose batch_size and num_shards whose product divides {consumed} "
                    f"(e.g. {saved_round}, as when the state was saved)."
                )
            position = consumed // self._round()
        state["position"] = position
        return state

    def _load(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self._epoch_offset = state["epoch_offset"]
        self._pending_skip = state["pending_skip"]
        self._pass_skip = state["pass_skip"]
        self._in_pass = bool(state["in_pass"])
        self._position = state["position"]
        # A finished pass is not resumed (it would yield nothing): the next
        # pass starts afresh, as torch samplers do.
        finished = self._position >= self._num_shard_items(self._pass_skip)
        self._resume = self._position if self._in_pass and not finished else None


def _epoch_length(num_samples: int, round_: int, drop_last: bool, pad_last: bool) -> int:
    """Samples in an epoch's global sequence whose rounds (one item per shard) hold ``round_``."""
    if drop_last:
        return (num_samples // round_) * round_
    if pad_last:
        return math.ceil(num_samples / round_) * round_
    return num_samples


def _tail_resplit(length: int, batch_size: int, shards: int) -> bool:
    """Whether a pass of ``length`` samples ends in a round of fewer batches than shards
    that is dealt out in even parts instead (Note [an uneven last round])."""
    tail = length % (batch_size * shards)
    return shards > 1 and tail >= shards and math.ceil(tail / batch_size) < shards


def _num_shard_items(
    epoch_length: int, skip: int, unit: int, shards: int, index: int, even_last_round: bool
) -> int:
    """Items (of ``unit`` samples) shard ``index`` of ``shards`` yields from a pass skipping ``skip``."""
    if even_last_round and unit > 1 and _tail_resplit(epoch_length - skip, unit, shards):
        return (epoch_length - skip) // (unit * shards) + 1
    items = math.ceil((epoch_length - skip) / unit)
    return max(0, math.ceil((items - index) / shards))

"""Fitting a saved worker state to this run's loader: the checks of ``DataLoader.load_state_dict``.

A state that does not fit (another loader, another streamer, another sample
order) is refused with an error that says what differs and how to resume, or,
with ``strict=False`` where that is safe, loaded with a warning.

Note [another number of ranks]: each rank saves its own position, but when a
DistributedSampler decides the batches the positions are one place in one
global order, recorded as ``global_position`` (Note [global position] in
``weightstream.data.state``). A state saved by N ranks then loads on M ranks:
any one worker's position serves every rank, because the pass number, the
batches consumed (one per rank per global batch) and the private RNG stream
are the same on all ranks; only the sampler's layout (shards, per-rank batch)
changes, which the sampler converts itself. The global batch and the order
must stay the same, which is checked against the record at load time (before
any batch is drawn) so that a changed setting is reported, not trained on.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from weightstream.context import current_config
from weightstream.data import loader_parts
from weightstream.data.sampler import DistributedSampler
from weightstream.data.streaming import get_streaming_rank, num_streamers

POSITION_KEYS = ("seed", "epoch", "batch_in_epoch", "rng_state", "generators")

# The settings of a global position that must not change, and how to name them.
ORDER_LABELS = {
    "global_batch_size": "global batch size",
    "shuffle": "shuffle",
    "shuffle_seed": "shuffle seed",
    "dataset_len": "dataset length",
    "num_samples": "samples per epoch",
    "drop_last": "drop_last",
    "pad_last": "pad_last",
    "data_fingerprint": "data fingerprint",
}


def order_settings(sampler: DistributedSampler, items_per_batch: int) -> dict:
    """What fixes a global order and its batches (Note [global position] in weightstream.data.state)."""
    return {
        "global_batch_size": items_per_batch * (sampler.batch_size or 1) * sampler.num_shards,
        "shuffle": sampler.shuffle,
        "shuffle_seed": sampler.seed,
        "dataset_len": sampler.dataset_len,
        "num_samples": sampler.num_samples,
        "drop_last": sampler.drop_last,
        "pad_last": sampler.pad_last,
        "data_fingerprint": sampler.data_fingerprint,
    }


def saved_layout(state: dict) -> tuple[int | None, int | None]:
    """(streamers, input workers) a worker state was saved with; None where it does not say."""
    layout = state.get("layout") or {}
    values = []
    for key in ("num_streamers", "input_workers"):
        value = layout.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(
                f"DataLoader state layout {key!r} must be an int or None, got {value!r}; the "
                "state is corrupt or was not produced by DataLoader.state_dict()."
            )
        values.append(value)
    return values[0], values[1]


def check_same_streamer(loader: Any, state: dict, strict: bool, serves_every_rank: bool) -> None:
    """Checks of a state loaded by the number of streamers that saved it.
    ``serves_every_rank``: another streamer's position is this one's too (every rank
    iterates the same global batches and takes its share, or one global order decides
    them: Note [another number of ranks]), as when rank 0 alone saved it."""
    rank = get_streaming_rank()
    if state["wse_id"] != rank and not serves_every_rank:
        mismatch(
            strict,
            f"the state was saved by streamer {state['wse_id']} but this process is streamer "
            f"{rank}. Load each process's own state, or the aggregated state of all workers "
            "(aggregate_state_dict) from which each process picks its own",
        )
    saved_workers = saved_layout(state)[1]
    workers = loader_parts.input_workers(loader)
    if (
        saved_workers is not None
        and workers is not None
        and saved_workers != workers
        and loader_parts.splits_over_workers(loader)
    ):
        # A map-style loader's order comes from its sampler in this process,
        # whatever the worker count; an IterableDataset deals itself out to
        # the workers, whose outputs torch interleaves: another order.
        mismatch(
            strict,
            f"it was saved with num_workers={saved_workers} input worker processes and the "
            f"loader built by input_fn has num_workers={workers}; its dataset is an "
            "IterableDataset, which splits its data over the workers itself, so the saved "
            f"position is a place in another order. Resume with num_workers={saved_workers}",
        )
    config = current_config()
    for key in ("num_csx", "num_workers_per_csx"):
        if state[key] != getattr(config, key):
            warnings.warn(
                f"DataLoader state was saved with {key}={state[key]}, this run has "
                f"{getattr(config, key)}; the saved position is per streamer and is used as is.",
                stacklevel=3,
            )


def own_worker_state(workers: list[dict]) -> dict:
    rank = get_streaming_rank()
    for worker in workers:
        if worker["wse_id"] == rank and worker["local_worker_id"] == 0:
            return worker
    raise ValueError(
        f"The aggregated DataLoader state has no state for streamer {rank} "
        f"(it has wse_id {sorted(w['wse_id'] for w in workers)})."
    )


def rebase(
    loader: Any,
    target: tuple[DistributedSampler, int] | None,
    workers: list[dict],
    saved_streamers: int,
    strict: bool,
) -> dict:
    """This streamer's state from the states of another number of streamers.

    Note [another number of ranks]. ``workers`` holds every streamer's state
    (an aggregated state) or one of them.
    """
    streamers, rank = num_streamers(), get_streaming_rank()
    saved = (
        f"The DataLoader state holds the position of {saved_streamers} streamer(s) "
        f"(data-parallel ranks) but this run has {streamers}"
    )
    if target is None:
        raise ValueError(
            f"{saved}. A position moves to another number of ranks only when one global "
            "sample order decides the batches: a torch DataLoader over a map-style dataset "
            "without a state_dict of its own, ordered by weightstream's DistributedSampler "
            "(as sampler or batch_sampler). The loader built by input_fn is not ordered so, "
            f"and its per-rank positions cannot be mapped. Resume on {saved_streamers} "
            "rank(s), or order the data with a DistributedSampler."
        )
    positions = [w["global_position"] for w in workers]
    if positions[0] is None:
        raise ValueError(
            f"{saved}, and the state records no global position (its loader had no global "
            "sample order, or it was saved before weightstream recorded one), so each "
            f"position fits only the rank that saved it. Resume on {saved_streamers} rank(s)."
        )
    if any(p != positions[0] for p in positions):  # aggregate_state_dict checks it too
        raise ValueError(
            f"{saved}, and their global positions disagree ({positions}): the states are "
            "not from one step of one run. Load the state saved at one checkpoint step."
        )
    record = positions[0]
    check_order(record, target)
    template = workers[0]
    position = template["position"]
    if position is not None and (
        position.get("epoch"),
        position.get("batch_in_epoch"),
    ) != (record["epoch"], record["batches_in_epoch"]):
        raise ValueError(
            f"{saved}; its position (pass {position.get('epoch')}, batch "
            f"{position.get('batch_in_epoch')}) disagrees with its global position (pass "
            f"{record['epoch']}, batch {record['batches_in_epoch']}): the state is corrupt. "
            "Resume from another checkpoint."
        )
    sampler = target[0]
    user_state = copy.deepcopy(template["user_state"])
    for name, part in loader_parts.stateful_parts(loader).items():
        if part is sampler and user_state and name in user_state:
            # The saved shard's sampler state, as this shard's sampler would save it.
            user_state[name] = sampler.adapt_state_dict(user_state[name], strict)
    # Samples streamed so far, shared as if this run had always had `streamers`
    # ranks (their sum stays the global count). One saved state stands for all
    # of its ranks, which streamed equally (lock step).
    total = sum(w["samples_streamed"] for w in workers)
    if len(workers) == 1:
        total *= saved_streamers
    base, extra = divmod(total, streamers)
    config = current_config()
    return {
        **template,
        "local_worker_id": 0,
        "num_workers_per_csx": config.num_workers_per_csx,
        "num_csx": config.num_csx,
        "wse_id": rank,
        "samples_streamed": base + (1 if rank < extra else 0),
        "user_state": user_state,
        "layout": None,  # rebuilt by the next state_dict()
    }


def check_order(saved: dict, target: tuple[DistributedSampler, int]) -> None:
    """Refuse a global position in another order than this loader's (Note [global position])."""
    mine = order_settings(*target)
    differ = [k for k in ORDER_LABELS if k in saved and saved[k] != mine[k]]
    if "data_fingerprint" in differ and None in (
        saved["data_fingerprint"],
        mine["data_fingerprint"],
    ):
        differ.remove("data_fingerprint")  # one side cannot tell: a dataset without one
    if not differ:
        return
    details = "; ".join(f"{ORDER_LABELS[k]}: saved {saved[k]!r}, here {mine[k]!r}" for k in differ)
    fixes = []
    if "global_batch_size" in differ:
        g = saved["global_batch_size"]
        fixes.append(
            f"keep the global batch at {g} samples whatever the number of ranks (M ranks "
            f"take {g}/M each; in a params file train_input.batch_size is the global batch)"
        )
    if "shuffle" in differ or "shuffle_seed" in differ:
        fixes.append(
            f"set the shuffle settings back to shuffle={saved.get('shuffle')!r}, "
            f"seed={saved.get('shuffle_seed')!r} (train_input.shuffle, shuffle_seed)"
        )
    if "dataset_len" in differ or "num_samples" in differ:
        fixes.append("read the same data as the run that saved it")
    elif "data_fingerprint" in differ:
        fixes.append(
            "read the same data as the run that saved it (its contents changed since, or "
            "what makes samples of them: the tokenizer, seq_len, packing, the eval split)"
        )
    if "drop_last" in differ or "pad_last" in differ:
        fixes.append(
            f"set drop_last={saved.get('drop_last')!r}, pad_last={saved.get('pad_last')!r} back"
        )
    raise ValueError(
        f"The DataLoader state is a position in another sample order than this loader's "
        f"({details}): it counts batches of the order it was saved in, so it cannot "
        f"continue this one. To resume, {'; '.join(fixes)}. To train with the new "
        "settings instead, start a new run (another model_dir) without this state."
    )


def mismatch(strict: bool, message: str) -> None:
    if strict:
        raise ValueError(
            f"DataLoader state does not fit: {message}. Pass strict=False to load it anyway."
        )
    warnings.warn(f"DataLoader state does not fit: {message}; loading it anyway.", stacklevel=3)


def check_position(position: dict | None, strict: bool) -> dict | None:
    if position is None:
        return None
    missing = [k for k in POSITION_KEYS if k not in position]
    unexpected = sorted(str(k) for k in position if k not in POSITION_KEYS)
    if missing or unexpected:
        mismatch(
            strict,
            f"its 'position' has missing key(s) {missing} and unexpected key(s) {unexpected}",
        )
        if missing:
            warnings.warn(
                "DataLoader state has no usable position; the data starts from its beginning.",
                stacklevel=3,
            )
            return None
    for key in ("seed", "epoch", "batch_in_epoch"):
        value = position[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"DataLoader state position {key!r} must be a non-negative int, got {value!r}."
            )
    rng_state = position["rng_state"]
    if rng_state is not None and not isinstance(rng_state, torch.Tensor):
        raise ValueError(
            f"DataLoader state position 'rng_state' must be a tensor or None, got "
            f"{type(rng_state).__name__}."
        )
    return {k: position[k] for k in POSITION_KEYS}


def check_user_state(
    loader: Any, stateful: bool, user_state: dict | None, strict: bool
) -> dict | None:
    have = {"loader"} if stateful else set(loader_parts.stateful_parts(loader))
    has = "has state_dict/load_state_dict on"
    return _fit(user_state or {}, have, "user state", has, strict) or None


def check_generators(loader: Any, saved: dict, strict: bool) -> dict:
    have = set(loader_parts.generators(loader))
    return _fit(saved, have, "generator states", "draws from generators", strict)


def _fit(saved: dict, have: set, held: str, has: str, strict: bool) -> dict:
    """``saved`` without the parts the loader does not have; a mismatch if the sets differ."""
    if set(saved) != have:
        mismatch(
            strict,
            f"it holds {held} for {sorted(saved)} but the loader built by input_fn {has} "
            f"{sorted(have)}. Build the DataLoader with the same input_fn as the run that "
            "saved the state",
        )
    return {k: v for k, v in saved.items() if k in have}

"""The restartable state of a DataLoader: one worker's record, and many workers' combined.

A *worker state* is what one streamer's ``DataLoader.state_dict()`` returns::

    {
      "local_worker_id": 0,        # index of this input worker on its system (one per process here)
      "num_workers_per_csx": 1,    # from the run configuration, for the record
      "num_csx": 1,                # from the run configuration, for the record
      "wse_id": 0,                 # streaming rank: which system this worker feeds
      "appliance_step": 120,       # global step the run had reached
      "worker_step": 120,          # batches this worker yielded since the run began
      "samples_streamed": 3840,    # samples in those batches
      "user_state": {...} | None,  # state_dict() of the user's loader, or of its dataset/samplers
      "position": {...},           # where this worker is in its data (see DataLoader)
      "layout": {                  # under which split of the data the position was saved
        "num_streamers": 2,        #   data-parallel ranks streaming
        "input_workers": 0,        #   worker processes of the loader input_fn built (None: unknown)
      },
      "global_position": {...} | None,  # the rank-independent position, see below
    }

Note [global position]: when a DistributedSampler orders the data (one
global sample order, Note [global order] in sampler.py), where a run stands
does not depend on how many ranks stream it: ``global_position`` records it as::

    {
      "epoch": 3,                  # pass over the data (the sampler's epoch)
      "batches_in_epoch": 5,       # global batches of the pass consumed
      "samples_in_epoch": 40,      # samples of the pass all ranks consumed (after a start_index skip)
      "global_batch_size": 8,      # samples in one batch over all ranks (per-rank batch x ranks)
      "shuffle": True,             # the order: these, and global_batch_size, must be
      "shuffle_seed": 3,           #   the same in a run that resumes from the record
      "dataset_len": 1437,
      "num_samples": 1437,         # samples per epoch
      "drop_last": True,
      "pad_last": False,
      "data_fingerprint": "3f0c...",  # changes with the data's contents; None: unknown
    }

Every rank's record is the same, so a run on any number of ranks M whose
per-rank batch is ``global_batch_size / M`` continues at the next global
batch from it (``DataLoader.load_state_dict``). It is None when the loader has
no such order (an IterableDataset that shards itself, a loader keeping its
own state): then the position is per streamer and resumes only on the same
number of ranks (and, for an IterableDataset, which splits itself over the
input workers, the same number of those).

``layout`` and ``global_position`` were added after the other keys: a state
without them still loads (as one saved by the same layout, without a global
position). ``data_fingerprint`` (``data_fingerprint`` in sampler.py) came later
still; it is compared only where both the record and the loader's dataset have one.

An *aggregated state* (:func:`aggregate_state_dict`) holds the worker states
of a whole run, in streaming-rank order, plus run-wide totals and the
workers' common ``global_position``; it is what a checkpoint stores under the
key ``"dataloader"``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

__all__ = [
    "OPTIONAL_WORKER_STATE_KEYS",
    "WORKER_STATE_KEYS",
    "aggregate_state_dict",
    "deaggregate_state_dict",
    "validate_worker_state",
]

WORKER_STATE_KEYS = (
    "local_worker_id",
    "num_workers_per_csx",
    "num_csx",
    "wse_id",
    "appliance_step",
    "worker_step",
    "samples_streamed",
    "user_state",
    "position",
)
# Keys a state may lack (states saved before they existed); missing means None.
OPTIONAL_WORKER_STATE_KEYS = ("layout", "global_position")
_COUNTER_KEYS = WORKER_STATE_KEYS[:7]
_AGGREGATE_KEYS = (
    "num_csx",
    "num_workers_per_csx",
    "appliance_step",
    "samples_streamed",
    "worker_states",
)


def validate_worker_state(state, strict: bool = True) -> dict:
    """Check a worker state's keys and counters; return it, missing keys filled when not strict.

    strict: wrong or missing keys raise ValueError. Not strict: they warn;
    unexpected keys are ignored and missing counters count from 0 (a missing
    position restarts the data from its beginning).
    """
    if not isinstance(state, dict):
        raise TypeError(
            f"A DataLoader state must be a dict (from DataLoader.state_dict()), got "
            f"{type(state).__name__}."
        )
    missing = [k for k in WORKER_STATE_KEYS if k not in state]
    known = WORKER_STATE_KEYS + OPTIONAL_WORKER_STATE_KEYS
    unexpected = sorted(str(k) for k in state if k not in known)
    if missing or unexpected:
        problems = [f"missing key(s) {missing}"] if missing else []
        if unexpected:
            problems.append(f"unexpected key(s) {unexpected}")
        problem = "; ".join(problems)
        if strict:
            raise ValueError(
                f"DataLoader state does not match this DataLoader: {problem}. Pass the dict "
                "returned by DataLoader.state_dict() (or its aggregate_state_dict() of all "
                "workers), or load_state_dict(sd, strict=False) to load what matches."
            )
        warnings.warn(
            f"DataLoader state: {problem}; loading what matches (missing counters start at 0, "
            "a missing position restarts the data from its beginning).",
            stacklevel=3,
        )
        state = {k: v for k, v in state.items() if k in known}
        for key in missing:
            state[key] = None if key in ("user_state", "position") else 0
    for key in _COUNTER_KEYS:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"DataLoader state key {key!r} must be a non-negative int, got {value!r}; the "
                "state is corrupt or was not produced by DataLoader.state_dict()."
            )
    state = {**dict.fromkeys(OPTIONAL_WORKER_STATE_KEYS), **state}
    for key in ("position", *OPTIONAL_WORKER_STATE_KEYS):
        if state[key] is not None and not isinstance(state[key], dict):
            raise ValueError(
                f"DataLoader state key {key!r} must be a dict or None, got "
                f"{type(state[key]).__name__}; the state is corrupt or was not produced by "
                "DataLoader.state_dict()."
            )
    return state


def aggregate_state_dict(worker_states: Sequence[dict]) -> dict:
    """Combine the worker states of a run into one state (for the checkpoint).

    The worker states are kept whole, ordered by ``(wse_id, local_worker_id)``;
    ``samples_streamed`` is their sum (the samples consumed globally, see
    DistributedSampler's ``start_index``) and ``global_position`` their
    common one (Note [global position]). All workers must come from one run at
    one step: same ``num_csx``, ``num_workers_per_csx``, ``appliance_step``
    and global position, and no worker twice.
    """
    if isinstance(worker_states, dict) or not isinstance(worker_states, Sequence):
        raise TypeError(
            "aggregate_state_dict expects a list of worker states (one DataLoader.state_dict() "
            f"per worker), got {type(worker_states).__name__}."
        )
    if not worker_states:
        raise ValueError("aggregate_state_dict got no worker states; pass one per worker.")
    states = [validate_worker_state(s) for s in worker_states]
    for key in ("num_csx", "num_workers_per_csx", "appliance_step"):
        values = sorted({s[key] for s in states})
        if len(values) > 1:
            raise ValueError(
                f"Worker states disagree on {key} ({values}): they are not from one run at one "
                "step. Aggregate the states saved together at the same checkpoint step."
            )
    ids = [(s["wse_id"], s["local_worker_id"]) for s in states]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(
            f"Worker state(s) for (wse_id, local_worker_id) {duplicates} appear more than once; "
            "pass exactly one state per worker."
        )
    ordered = [copy.deepcopy(s) for _, s in sorted(zip(ids, states), key=lambda p: p[0])]
    positions = [s["global_position"] for s in ordered]
    if any(p != positions[0] for p in positions):
        raise ValueError(
            f"Worker states disagree on their global position ({positions}): the ranks were not "
            "at the same place of one sample order. Aggregate the states saved together at the "
            "same checkpoint step by one run."
        )
    return {
        "num_csx": states[0]["num_csx"],
        "num_workers_per_csx": states[0]["num_workers_per_csx"],
        "appliance_step": states[0]["appliance_step"],
        "samples_streamed": sum(s["samples_streamed"] for s in states),
        # The same for every worker (checked above): the run's place in its global order.
        "global_position": copy.deepcopy(positions[0]),
        "worker_states": ordered,
    }


def deaggregate_state_dict(aggregated_state_dict: dict) -> list[dict]:
    """Split an aggregated state back into its worker states (ordered by wse_id, local_worker_id)."""
    if not isinstance(aggregated_state_dict, dict):
        raise TypeError(
            "deaggregate_state_dict expects the dict returned by aggregate_state_dict, got "
            f"{type(aggregated_state_dict).__name__}."
        )
    missing = [k for k in _AGGREGATE_KEYS if k not in aggregated_state_dict]
    if missing:
        raise ValueError(
            f"Aggregated DataLoader state is missing key(s) {missing}; pass the dict returned "
            "by aggregate_state_dict()."
        )
    workers = aggregated_state_dict["worker_states"]
    if not isinstance(workers, (list, tuple)) or not workers:
        raise ValueError("Aggregated DataLoader state has no worker states.")
    return [copy.deepcopy(validate_worker_state(s)) for s in workers]


def is_aggregated(state) -> bool:
    """Whether ``state`` is an aggregated state rather than one worker's."""
    return isinstance(state, dict) and "worker_states" in state

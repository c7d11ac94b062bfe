"""``weightstream.utils.data``: the reference API's ``cstorch.utils.data`` names.

The implementation lives in :mod:`weightstream.data`; this module only gives
it the reference's import path.
"""

from weightstream.data import (
    DataLoader,
    DistributedSampler,
    SyntheticDataset,
    aggregate_state_dict,
    compute_num_steps,
    deaggregate_state_dict,
    get_streaming_batch_size,
    get_streaming_rank,
    is_streamer,
    num_streamers,
)

__all__ = [
    "DataLoader",
    "DistributedSampler",
    "SyntheticDataset",
    "aggregate_state_dict",
    "compute_num_steps",
    "deaggregate_state_dict",
    "get_streaming_batch_size",
    "get_streaming_rank",
    "is_streamer",
    "num_streamers",
]

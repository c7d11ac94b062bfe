"""Input pipeline: the step-counting, restartable DataLoader and its samplers and helpers.

User code reaches these as ``weightstream.utils.data`` (reference name
``cstorch.utils.data``). Modules, by what they own:

- ``dataloader``: :class:`DataLoader` (runs ``input_fn``'s loader for a number of steps);
- ``resume``: the checks that fit a saved state to the loader (``load_state_dict``);
- ``steps``: :func:`compute_num_steps`;
- ``state``: the worker state and :func:`aggregate_state_dict` / :func:`deaggregate_state_dict`;
- ``loader_parts``: what in a user's loader decides its order (read, never modified);
- ``sampler``: :class:`DistributedSampler`;
- ``synthetic``: :class:`SyntheticDataset`;
- ``streaming``: who streams and with what batch size (:func:`batch_size_of`, rank shares).
"""

from weightstream.data.dataloader import DataLoader
from weightstream.data.sampler import DistributedSampler
from weightstream.data.state import aggregate_state_dict, deaggregate_state_dict
from weightstream.data.steps import compute_num_steps
from weightstream.data.streaming import (
    get_streaming_batch_size,
    get_streaming_rank,
    is_streamer,
    num_streamers,
)
from weightstream.data.synthetic import SyntheticDataset

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

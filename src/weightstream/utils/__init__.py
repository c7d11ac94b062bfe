"""Utilities under the reference API's ``cstorch.utils`` path.

``weightstream.utils.data`` holds the input pipeline names (``DataLoader``,
``DistributedSampler``, ...); it is imported here so that
``weightstream.utils.data.DataLoader`` works after ``import weightstream.utils``.
"""

from weightstream.utils import data

__all__ = ["data"]

"""``weightstream.utils.data``: the reference API's ``cstorch.utils.data`` names.

The implementation lives in :mod:`weightstream.data`; this module only gives
its public names (``weightstream.data.__all__``) the reference's import path.
"""

import weightstream.data as _data
from weightstream.data import *  # noqa: F403

__all__ = list(_data.__all__)

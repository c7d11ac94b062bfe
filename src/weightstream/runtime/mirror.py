"""The host mirror: a unit's weights in their compute dtype, the source of its fetches.

Note [host mirror]
------------------
Without a mirror every fetch reads the fp32 masters and casts them on the way
(``DeviceOps.copy_flat``): on an accelerator that is one small copy per
parameter tensor from pageable memory, which the driver stages through a
bounce buffer and so runs synchronously with the host, and a bf16 run moves
the cast on the host twice a step (forward and backward fetch).

With ``StreamingConfig.host_mirror`` each dtype group of a unit has one flat
host buffer (pinned where the device reads host memory asynchronously:
``DeviceOps.host_empty``) holding the masters cast to the group's compute dtype
back to back, in the layout of the device buffer. A fetch is then one
contiguous copy of that buffer, asynchronous on the copy stream, of 2 bytes a
parameter in bf16 instead of 4.

When it is written: at the first forward fetch of the unit in each forward
pass (``Streamer.begin_forward`` opens a new generation), so everything that
changed the masters between two forwards is seen, whatever wrote them: the
optimizer, ``load_state_dict``, a user's ``p.data.mul_()`` (which no version
counter sees). The backward fetches (and the recomputes of activation
checkpointing) of that pass copy the mirror as it is: the masters cannot
change between a forward and its backward without autograd's saved-tensor
check failing in eager PyTorch too. A fetch of a unit whose mirror was never
written (a backward-only fetch) writes it. The cast is the one the fetch did
before, so the device copy holds the same bits (exactness is unchanged).

Where it is used: the RAM store without sharding and without a postprocess
(cbfloat16 rounds the device copy). A sharded store broadcasts from the owner's
masters and the disk store pages its masters in (Note [disk tier]); both fetch
as before. Cost: host memory of the compute-dtype weights of the whole model
(2 bytes a parameter in bf16), which is why the default is on only for
accelerators, where it buys the asynchronous copy; on a CPU the device copy is
a host copy either way (the bytes moved per step are the same).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from weightstream.common.flat import flatten


class HostMirror:
    """One dtype group of one unit, cast and flattened in host memory (the Note)."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self.generation: int | None = None  # the forward pass that last wrote it
        # Owner: this mirror. Why: a prefetch thread and the compute thread may
        # fetch the same unit (a module called twice) at the same time.
        self._lock = threading.Lock()

    def source(self, masters: Sequence[torch.Tensor], generation: int | None) -> torch.Tensor:
        """The flat buffer, written from ``masters`` first if it belongs to an earlier
        forward pass (``generation``; None: a backward fetch, which writes it only if
        it was never written)."""
        with self._lock:
            stale = self.generation is None or (
                generation is not None and generation != self.generation
            )
            if stale:
                with torch.no_grad():
                    flatten(masters, out=self.flat)
                self.generation = generation if generation is not None else -1
        return self.flat

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

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

Written by the update: where the engine's updater applies the optimizer step
(``overlap_updates`` or ``update_in_backward``: Notes [overlapped updates] and
[updates in backward] in updater.py), each share, once applied, writes its
masters' slices into every mirror that holds them (a tied weight into both of
its units'), on the update worker, behind the backward or the next forward:
the forward's fetch then only copies, and a frozen unit's mirror is written
once (measured on an H100, 4.9B Llama: the
forward's casts held its 29 fetches to 0.77 s, against 0.18 s of copies). The
next forward trusts such a mirror only while each master's version counter
and address are those its slice was written from, so ``load_state_dict``, an
in-place write to the parameter (``with torch.no_grad(): p.mul_(2)``) and
``p.data = t`` make the fetch write it again. An in-place write through
``p.data`` between ``step()`` and the next forward is not seen in these modes,
as it already raced with an overlapped update there: write the parameter
itself under ``torch.no_grad()``.

Where it is used: the RAM store without sharding and without a postprocess
(cbfloat16 rounds the device copy). A sharded store broadcasts from the owner's
masters and the disk store pages its masters in (Note [disk tier]); both fetch
as before. Cost: host memory of the compute-dtype weights of the whole model
(2 bytes a parameter in bf16), which is why the default is on only for
accelerators, where it buys the asynchronous copy; on a CPU the device copy is
a host copy either way (the bytes moved per step are the same).

Masters already in the compute dtype (bf16 masters: ``runconfig.master_dtype``,
Note [Kahan summation] in optim/compact.py) need no cast: the mirror is the
masters themselves. The unit's masters are moved into the flat buffer once
(each ``p.data`` a view of it), so the fetch copies the masters with no second
host copy and nothing to write; the optimizer updates the views in place. A
master that is not a view of the buffer any more (``p.data = t``) makes the
mirror an ordinary one again, written as above; a tied master already in
another unit's mirror keeps the group ordinary from the start.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from weightstream.common.flat import flatten, unflatten_views
from weightstream.runtime.config import StreamingConfig


def host_mirror_of(
    config: StreamingConfig, device: torch.device, on_disk: bool, sharded: bool
) -> tuple[bool, str | None]:
    """Whether ``host_mirror`` asks for a mirror (its default: on accelerators), and
    what makes the fetches read the masters themselves instead, if anything (the Note)."""
    wanted = config.host_mirror
    if wanted is None:
        wanted = device.type != "cpu"
    blocked = None
    if on_disk:
        blocked = "a disk store"
    elif sharded:
        blocked = "a sharded store"
    elif config.compute_dtype == "cbfloat16":
        blocked = "cbfloat16"
    return wanted, blocked


class HostMirror:
    """One dtype group of one unit, cast and flattened in host memory (the Note)."""

    def __init__(
        self,
        flat: torch.Tensor,
        masters: Sequence[torch.Tensor],
        by_update: bool,
        aliased: bool = False,
    ):
        self.flat = flat
        self._views = unflatten_views(flat, masters)
        # The masters are views of ``flat`` (same dtype: the Note's last paragraph).
        self.aliased = aliased
        if aliased:
            with torch.no_grad():
                flatten(masters, out=flat)
                for m, view in zip(masters, self._views):
                    m.data = view
        # Per master: (version, address) it was last written from; None: never.
        self._written: list[tuple[int, int] | None] = [None] * len(masters)
        self.generation: int | None = None  # the forward pass that last wrote it
        # The update writes what it changes: trusted while the stamps hold.
        self._by_update = by_update
        # Owner: this mirror. Why: a prefetch thread and the compute thread may
        # fetch the same unit (a module called twice) at the same time, and the
        # update worker writes slices of it.
        self._lock = threading.Lock()

    def source(self, masters: Sequence[torch.Tensor], generation: int | None) -> torch.Tensor:
        """The flat buffer, written from ``masters`` first unless it is current: written
        by the update from these very masters, or by this forward pass (``generation``;
        None: a backward fetch, which writes it only if it was never written)."""
        with self._lock:
            if self.aliased:
                if all(m.data_ptr() == v.data_ptr() for m, v in zip(masters, self._views)):
                    return self.flat
                self.aliased = False  # a master was replaced: written from now on
            if self._by_update:
                current = all(w == _stamp(m) for w, m in zip(self._written, masters))
            else:
                current = self.generation is not None and (
                    generation is None or generation == self.generation
                )
            if not current:
                with torch.no_grad():
                    flatten(masters, out=self.flat)
                self._written = [_stamp(m) for m in masters]
                self.generation = generation if generation is not None else -1
        return self.flat

    def updated(self, i: int, master: torch.Tensor) -> None:
        """Master ``i`` was just updated: write its slice (a mirror never written
        stays so; its first fetch writes it whole)."""
        with self._lock:
            if self.generation is None or (
                self.aliased and master.data_ptr() == self._views[i].data_ptr()
            ):
                return
            with torch.no_grad():
                self._views[i].copy_(master)
            self._written[i] = _stamp(master)

    @property
    def nbytes(self) -> int:
        """Host bytes held beside the masters (none while it is the masters)."""
        return 0 if self.aliased else self.flat.numel() * self.flat.element_size()


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """What an in-place write (its version counter) or a new ``.data`` (its address)
    changes."""
    return t._version, t.data_ptr()

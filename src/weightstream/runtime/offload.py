"""Activation offload: the tensors a forward saves for its backward, kept in host memory.

Note [activation offload]
-------------------------
With ``StreamingConfig(activation_offload=True)`` (the reference's activation
servers, ``max_act_per_csx``, are host memory here) every tensor of at least
``MIN_BYTES`` that the forward saves for the backward and that is not a
streamed weight (those are fetched again: Note [streaming and autograd] in
streamer.py) goes to host memory as soon as it is saved, and comes back when the
backward needs it. Device memory then holds the activations of the units still
computing, not of the whole forward. With ``activation_checkpointing`` the
tensors saved are the checkpointed units' inputs (the recomputed ones are held
by the checkpoint, inside the unit's backward window, and are not offloaded):
together the activation memory is about one unit's, whatever the depth.

How: the streamer's pack hook hands such a tensor to :meth:`ActivationOffload.pack`,
which starts its copy into new page-locked host memory on the offload stream
(after the compute stream's work so far; the device tensor is recorded on that
stream, so its memory is not reused before the copy read it) and returns a
record; the device tensor is free as soon as the forward drops it. The unpack
hook brings a record back: a copy on the offload stream (which ran the copy out
first) into a new device tensor that the compute stream waits for (an event,
not a host sync). The
backward uses saved tensors in about the reverse order of the forward, so
each unpack also starts the way back of the ``depth`` records saved just
before it (prefetch), and their copies overlap the backward's compute. A
record whose copy came back is handed out once and let go, so device memory
holds at most the prefetched records beside the ones in use; unpacking it again
(``retain_graph``) copies it again.

Only while a forward runs: a tensor saved during the backward (a recompute,
a double backward) stays where it is. Exact: the values are copied bit for
bit, in the tensor's own dtype; the copy back has the saved tensor's sizes
(contiguous, like ``torch.autograd.graph.save_on_cpu``). On the CPU the
"device" is host memory already: the record is a host copy and the way back
gives it as it is, so the option costs a copy and saves nothing there (the
engine warns); it exists there so that the same code is tested everywhere.
"""

from __future__ import annotations

import weakref

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors stay on the device: not worth a copy


class _Offloaded:
    """A saved tensor on its way to host memory and back."""

    __slots__ = ("__weakref__", "back", "back_event", "host", "index", "saved")

    def __init__(self, host: torch.Tensor, saved: list[weakref.ref]):
        self.host = host  # page-locked on accelerators; written by the copy out
        self.saved = saved  # the records of the same forward, in save order
        self.index = len(saved)  # this one's position there
        self.back: torch.Tensor | None = None  # the device copy, once started
        self.back_event = None


class ActivationOffload:
    """Moves the forward's saved activations to host memory and back (the Note)."""

    def __init__(self, ops, depth: int = 2):
        self.ops = ops
        self.depth = depth  # records brought back ahead of the one unpacked
        self._records: list[weakref.ref] = []  # this forward's, in save order
        self.bytes_out = 0  # bytes sent to host memory, for tests and benchmarks

    def begin_forward(self) -> None:
        self._records = []

    def wants(self, t: torch.Tensor) -> bool:
        return t.device == self.ops.device and t.numel() * t.element_size() >= MIN_BYTES

    def pack(self, t: torch.Tensor) -> _Offloaded:
        record = _Offloaded(self.ops.to_host(t), self._records)
        self._records.append(weakref.ref(record))
        self.bytes_out += t.numel() * t.element_size()
        return record

    def unpack(self, record: _Offloaded) -> torch.Tensor:
        self._bring_back(record)
        for ref in record.saved[max(record.index - self.depth, 0) : record.index]:
            earlier = ref()
            if earlier is not None:
                self._bring_back(earlier)
        tensor, event = record.back, record.back_event
        record.back = record.back_event = None  # handed out once: its memory goes with use
        self.ops.wait_copy(event)
        return tensor

    def _bring_back(self, record: _Offloaded) -> None:
        if record.back is None:
            record.back, record.back_event = self.ops.to_device(record.host)

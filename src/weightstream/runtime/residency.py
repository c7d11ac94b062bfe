"""Measures how many bytes of streamed weights are alive on the device.

Every flat device buffer the streamer allocates is registered here with a weak
reference, so the count is what really exists (a buffer that something still
holds stays counted after the streamer dropped it), not what the streamer
believes. The peak is sampled at each allocation, which is where it can grow.
"""

from __future__ import annotations

import threading
import weakref

import torch


class ResidencyMeter:
    def __init__(self) -> None:
        # Owner: this meter. Why: buffers are allocated on the prefetch thread
        # and freed on the compute thread.
        self._lock = threading.Lock()
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak_bytes = 0
        self.total_fetched_bytes = 0

    def track(self, buffer: torch.Tensor) -> None:
        key = id(buffer)
        nbytes = buffer.numel() * buffer.element_size()

        meter = weakref.ref(self)

        def _gone(_ref, key=key):
            m = meter()
            if m is not None:
                with m._lock:
                    m._live.pop(key, None)

        with self._lock:
            self._live[key] = (weakref.ref(buffer, _gone), nbytes)
            self.total_fetched_bytes += nbytes
            current = sum(n for ref, n in self._live.values() if ref() is not None)
            self.peak_bytes = max(self.peak_bytes, current)

    def current_bytes(self) -> int:
        with self._lock:
            return sum(n for ref, n in self._live.values() if ref() is not None)

"""What a run measured about itself: ``performance/performance.json``.

The fields are those of the reference (seed 000): compile_time,
est_samples_per_sec, programming_time, samples_per_sec,
suspected_input_bottleneck, total_samples, total_time. Time spent waiting for
the next batch is measured separately from the step itself; the input is a
suspected bottleneck when that wait exceeds ``INPUT_BOTTLENECK_FRACTION`` of
the step time.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from weightstream.common.files import write_text_atomic

# Waiting for input longer than this fraction of the compute time per step
# means the accelerator would idle: more input workers would help.
INPUT_BOTTLENECK_FRACTION = 0.10


@dataclass
class PerformanceTracker:
    compile_time: float = 0.0
    est_samples_per_sec: float | None = None
    programming_time: float = 0.0
    total_samples: int = 0
    input_wait_time: float = 0.0
    step_time: float = 0.0
    step_times: list[float] = field(default_factory=list)
    _started: float | None = None
    _stopped: float | None = None
    _paused: float = 0.0  # seconds left out of total_time (evaluations during training)
    _pause_began: float | None = None

    def start(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self) -> None:
        self._stopped = time.perf_counter()

    def pause(self) -> None:
        """Leave the time until :meth:`resume` out of ``total_time``."""
        if self._pause_began is None:
            self._pause_began = time.perf_counter()

    def resume(self) -> None:
        if self._pause_began is not None:
            self._paused += time.perf_counter() - self._pause_began
            self._pause_began = None

    def add_step(self, seconds: float, input_wait: float, samples: int) -> None:
        self.step_time += seconds
        self.step_times.append(seconds)
        self.input_wait_time += input_wait
        self.total_samples += samples

    @property
    def total_time(self) -> float:
        if self._started is None:
            return 0.0
        end = self._stopped if self._stopped is not None else time.perf_counter()
        return end - self._started - self._paused

    @property
    def samples_per_sec(self) -> float:
        return self.total_samples / self.total_time if self.total_time > 0 else 0.0

    @property
    def suspected_input_bottleneck(self) -> bool:
        return (
            self.step_time > 0 and self.input_wait_time > INPUT_BOTTLENECK_FRACTION * self.step_time
        )

    def to_dict(self) -> dict:
        return {
            "compile_time": round(self.compile_time, 6),
            "est_samples_per_sec": self.est_samples_per_sec,
            "programming_time": round(self.programming_time, 6),
            "samples_per_sec": round(self.samples_per_sec, 6),
            "suspected_input_bottleneck": self.suspected_input_bottleneck,
            "total_samples": self.total_samples,
            "total_time": round(self.total_time, 6),
        }

    def write(self, model_dir: str | os.PathLike) -> Path:
        """Write ``model_dir/performance/performance.json`` atomically."""
        path = Path(model_dir) / "performance" / "performance.json"
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

"""TensorBoard scalars of a run: all the values of one step in one event.

Note [one event per step]
-------------------------
torch's ``SummaryWriter.add_scalar`` writes one event per scalar, and
TensorBoard's writer thread serialises and checksums each event in Python (its
CRC-32C is pure Python where TensorFlow is absent). Measured on a 2-vCPU host:
four ``add_scalar`` calls a step cost about 260 us of CPU, 100 us of it in the
calling thread; one event carrying the step's four values costs about 90 us.
Inside an FC-MNIST run (a 2 ms step, the writer switched on and off every 25
steps) the writer cost 190-230 us a step, and 110-150 us as one event.
TensorBoard reads it as the same four scalars (``EventAccumulator.Scalars(tag)``),
so the files mean what they did.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class ScalarWriter:
    """Writes a step's scalars to the TensorBoard event files in ``logdir``.

    ``purge_step``: as torch's ``SummaryWriter`` (TensorBoard hides events of
    steps from this one on logged earlier, by a run that was killed)."""

    def __init__(self, logdir: str | os.PathLike, purge_step: int | None = None) -> None:
        # Slow to import: only when a writer is made.
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._summary = Summary
        self._writer = SummaryWriter(str(logdir), purge_step=purge_step)

    def add(self, step: int, values: Mapping[str, float]) -> None:
        """One event at ``step`` holding every ``tag: value`` (Note [one event per step])."""
        value = self._summary.Value
        summary = self._summary(
            value=[value(tag=tag, simple_value=float(v)) for tag, v in values.items()]
        )
        # The same file writer add_scalar writes through (opened again after close).
        self._writer._get_file_writer().add_summary(summary, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class NoScalarWriter:
    """Stands in for a ``ScalarWriter`` where nothing is logged (ranks other than 0)."""

    def add(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

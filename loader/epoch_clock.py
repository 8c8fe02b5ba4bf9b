"""An epoch's clock as the caller reads it (``ShardIter.stats``): the batches and real samples
``next()`` handed over, the time it spent blocked, and the figures they make."""

from __future__ import annotations

import time
from typing import Any, Optional

__all__ = ["EpochClock"]


class EpochClock:
    """One epoch's counts, from its first ``next()`` to its last batch handed over."""

    def __init__(self) -> None:
        self.batches, self.samples, self.blocked = 0, 0, 0.0
        self.t0: Optional[float] = None  # the epoch's first next() (time.perf_counter)
        self.t1: Optional[float] = None  # its last batch handed over

    def begin(self, t0: float) -> None:
        """A ``next()`` called at ``t0``: the first starts the epoch's clock."""
        if self.t0 is None:
            self.t0 = t0

    def took(self, t0: float, samples: int) -> None:
        """A batch of ``samples`` real samples handed over by a ``next()`` called at ``t0``."""
        self.batches += 1
        self.samples += samples
        t1 = time.perf_counter()
        self.blocked += t1 - t0
        self.t1 = t1

    def figures(self, reader: Any) -> dict:
        """Samples/s, payload MB/s and the data-stall fraction so far, of the epoch ``reader`` (a
        :class:`loader.reader.Reader`) is in."""
        wall = (self.t1 or 0) - (self.t0 or 0)
        payload = self.samples * (reader.schema.x_floats + reader.schema.label_floats + 1) * 4
        return {
            "epoch": reader.epoch,
            "generation": reader.plan.generation if reader.plan is not None else None,  # None: closed
            "batches": self.batches,  # read by this process (after a resume: since it)
            "samples": self.samples,
            "seconds": wall,
            "samples_per_s": self.samples / wall if wall > 0 else 0.0,
            "payload_mb_per_s": payload / wall / 1e6 if wall > 0 else 0.0,
            "stall_fraction": self.blocked / wall if wall > 0 else 0.0,
        }

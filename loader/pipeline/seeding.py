"""Where an epoch's randomness comes from: one function, so an epoch's order is a function of
``(seed, epoch, part)`` alone and two runs with the same arguments read the same batches."""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["epoch_shuffle", "segment_order"]


def epoch_shuffle(seed: int, epoch: int, part_index: int, readers: int, shuffle: bool
                  ) -> tuple[list[int], Optional[np.random.Generator]]:
    """The native readers' record-shuffle seeds (one per reader) and the shuffle buffer's draw
    generator (None: no shuffle, samples leave the buffer oldest first).

    MXNet's reader takes an int31 seed; reader ``r`` of every part uses ``seed + r`` (a part
    reads its own records, so parts need no seed of their own there). The buffer's generator
    is seeded by (seed, epoch, part).
    """
    natives = [((seed + r) * 1_000_003 + epoch * 7919) % (2**31 - 1) for r in range(readers)]
    return natives, (np.random.default_rng([seed, epoch, part_index]) if shuffle else None)


def segment_order(seed: int, epoch: int, part_index: int, shuffle: bool) -> Optional[np.random.Generator]:
    """The generator that orders a streamed part's shards (``loader.pipeline.segments``); None: stored order."""
    return np.random.default_rng([seed, epoch, part_index, 1]) if shuffle else None

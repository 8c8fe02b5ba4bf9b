"""How a generation is split between distributed parts, and a part between native readers.

Parts are balanced by samples: of a generation's N samples (in record order), part ``p`` of ``P``
gets samples ``[p*N//P, (p+1)*N//P)``, i.e. ``N//P`` or ``N//P + 1`` of them. A packed record
that straddles a boundary is read by both neighbouring parts and each keeps only its own items
(:class:`Trim`). Where a record cannot be told apart from the others of its date (two records
with one key, see ``shardgen.format``), the boundary moves to the nearer record edge instead.

Each part's records are then cut into ``readers`` contiguous ranges, one per native iterator.
Everything here is a pure function of the records' counts: every worker computes the same split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["MIN_READER_RECORDS", "Trim", "PartSplit", "SharedRecords", "sample_bounds", "split_part",
           "shards_needed"]

MIN_READER_RECORDS = 64  # fewer records per reader: fewer readers


@dataclass(frozen=True)
class Trim:
    """Record ``record`` (global index) is shared with a neighbouring part: keep items ``[lo, hi)``."""

    record: int
    lo: int
    hi: int


@dataclass(frozen=True)
class PartSplit:
    """What one part reads: records ``[first, stop)``, the trims of its shared records, the record
    ranges of its readers, and the sample count of every part (batch counts depend on all)."""

    part_samples: tuple[int, ...]
    part_index: int
    first: int
    stop: int
    trims: tuple[Trim, ...]
    readers: tuple[tuple[int, int], ...]

    @property
    def samples(self) -> int:
        return self.part_samples[self.part_index]


def sample_bounds(counts: np.ndarray, num_parts: int, can_split: Callable[[int], bool]) -> np.ndarray:
    """``num_parts + 1`` sample positions where the parts begin (and the last one ends). A bound
    inside record ``i`` stays there when ``can_split(i)``, else moves to the nearer record edge."""
    cum = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    total = int(cum[-1])
    bounds = np.array([p * total // num_parts for p in range(num_parts + 1)], np.int64)
    for p in range(1, num_parts):
        s = int(bounds[p])
        i = int(np.searchsorted(cum, s, side="right")) - 1  # the record holding sample s
        if cum[i] == s or can_split(i):
            continue
        lo, hi = int(cum[i]), int(cum[i + 1])
        bounds[p] = lo if s - lo <= hi - s else hi
    return np.maximum.accumulate(bounds)


def shards_needed(samples: Sequence[int], stays: Sequence[bool], num_parts: int, part_index: int, *,
                  edges: bool = False) -> np.ndarray:
    """Which shards part ``part_index`` must read (a bool per shard), knowing only each shard's
    sample count (the manifest's): those holding its samples, and those where another part's
    bound falls inside a record unless ``stays[k]`` says a bound there stays put (records of one
    sample, or told apart: the manifest's ``distinct``). The others' records matter to the split
    only by their count: ``sample_bounds`` gives the same bounds from one pseudo-record per shard.
    ``edges``: of the part's own shards, only those its bounds fall inside."""
    cum = np.concatenate(([0], np.cumsum(samples, dtype=np.int64)))
    total = int(cum[-1])
    bounds = [p * total // num_parts for p in range(num_parts + 1)]
    s0, s1 = bounds[part_index], bounds[part_index + 1]

    def inside(b: int) -> Optional[int]:
        """The shard sample ``b`` falls strictly inside, if any."""
        k = int(np.searchsorted(cum, b, side="right")) - 1
        return k if 0 <= k < len(samples) and cum[k] < b < cum[k + 1] else None

    need = (cum[:-1] < max(s1, s0 + 1)) & (cum[1:] > s0)
    if edges:  # only those its own bounds fall inside (the others are streamed: ``pipeline.segments``)
        need[:] = False
        need[[k for k in map(inside, (s0, s1)) if k is not None]] = True
    for k in map(inside, bounds[1:-1]):
        if k is not None and not stays[k]:
            need[k] = True
    return need


def split_part(counts: np.ndarray, num_parts: int, part_index: int, readers: int,
               can_split: Callable[[int], bool]) -> PartSplit:
    """The records, trims and reader ranges of part ``part_index``; readers shrink so each has at
    least ``MIN_READER_RECORDS`` records (MXNet's iterator cannot be empty)."""
    cum = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    bounds = sample_bounds(counts, num_parts, can_split)
    part_samples = tuple(int(n) for n in np.diff(bounds))
    s0, s1 = int(bounds[part_index]), int(bounds[part_index + 1])
    if s0 == s1:
        return PartSplit(part_samples, part_index, 0, 0, (), ())
    first = int(np.searchsorted(cum, s0, side="right")) - 1
    stop = int(np.searchsorted(cum, s1, side="left"))
    spans = {}
    if s0 > cum[first]:
        spans[first] = [s0 - int(cum[first]), int(counts[first])]
    if s1 < cum[stop]:
        lo = spans.get(stop - 1, [0])[0]
        spans[stop - 1] = [lo, s1 - int(cum[stop - 1])]
    trims = tuple(Trim(r, lo, hi) for r, (lo, hi) in sorted(spans.items()))
    n = stop - first
    r = max(1, min(readers, n // MIN_READER_RECORDS))
    edges = [first + n * k // r for k in range(r + 1)]
    return PartSplit(part_samples, part_index, first, stop, trims, tuple(zip(edges[:-1], edges[1:])))


class SharedRecords:
    """A part's trimmed records, recognised among the records its readers return: by day, window
    count and key words (``Schema.key_words``; the head of a packed record starts with its window
    count, then its day). Counts how often each was seen: exactly once per epoch."""

    def __init__(self, trims: Sequence[Trim], days: Sequence[float], keys: Sequence[np.ndarray],
                 counts: Sequence[int], key_words: Sequence[int], pack: int):
        self.day = np.array(days, np.float32)
        self.key = np.stack(keys).astype(np.float32)
        self.count = np.array(counts, np.float32)
        self.lo = np.array([t.lo for t in trims], np.int64)
        self.hi = np.array([t.hi for t in trims], np.int64)
        self.words, self.pack = list(key_words), pack
        self.seen = np.zeros(len(trims), np.int64)

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Items ``[lo, hi)`` to keep of each record in ``rows`` (payloads): all of them, but of a
        shared record only this part's."""
        match = ((rows[:, 1, None] == self.day[None, :]) & (rows[:, 0, None] == self.count[None, :])
                 & (rows[:, self.words, None] == self.key.T[None, :, :]).all(axis=1))
        first, last = np.zeros(len(rows), np.int64), np.full(len(rows), self.pack, np.int64)
        rec, which = np.nonzero(match)
        first[rec], last[rec] = self.lo[which], self.hi[which]
        np.add.at(self.seen, which, 1)
        return first, last

    @property
    def each_seen_once(self) -> bool:
        return bool((self.seen == 1).all())

"""An epoch's reading order, as a value: which sample every position of the epoch holds, and
which of those positions each part reads (MosaicML Streaming's idea, ``streaming/base/shuffle``,
made exact across packed records and the same for every store).

The order is a pure function of ``(seed, epoch, the selected shards' sample counts in store order,
canonical_parts, block, the layout's pack)`` and of nothing else: not the cache's size, how many
native reads are open or how large their batches are, ``prefetch_buffer``, ``preprocess_threads``,
the store's kind, nor the number of workers reading it.

1. **Canonical parts.** The epoch's ``N`` samples, in store order, are split into
   ``K = canonical_parts`` ranges ``[c*N//K, (c+1)*N//K)``; a bound may fall inside a shard or a
   packed record (both sides read that record and each keeps its own samples).
2. **Shards.** Each canonical part's shard pieces are permuted by ``(seed, epoch, c)``.
3. **Blocks.** A canonical part of ``n`` samples is read in ``nb = ceil(n / block)`` blocks. One
   block is an exact shuffle of the part. With more (shuffled), every block takes a *stripe*: a
   piece of every date. Each shard piece is cut into ``nb`` sub-pieces of about equal size, at
   multiples of the layout's pack (full records: a block reads whole records), and block ``b``
   takes sub-piece ``(b - r) mod nb``, ``r`` drawn per piece by ``(seed, epoch, c)``. So a batch
   mixes every date of the part whatever fits in memory (blocks of consecutive shard pieces held
   358 of 2,500 dates at ten years). A block's pieces are read in store order (a one-block part holds the same
   records in the same slots every epoch, and its next epoch gathers from the block kept whole:
   ``loader.pipeline.memory.Arena.keep_whole``), and its samples are permuted by
   ``(seed, epoch, c, b)``. A block's records are held in memory while it is read, so ``block``
   is the shuffle buffer. In order, the part's samples are cut into blocks of equal size.
4. **The epoch** (``E``) is the canonical parts' orders end to end.

Without ``shuffle`` nothing is permuted: ``E`` is the store order.

**Parts and phases.** A phase of ``P`` parts splits what is left of ``E`` into ``P`` contiguous
slices balanced by samples (``len // P`` or one more); part ``p`` reads slice ``p`` in order,
``batch_size`` samples a batch. A saved state lists its phases (``num_parts``, ``batch_size``,
batches read); every worker of a ``dist_sync`` job is at the same batch, so the phases say exactly
which samples were consumed, and a job on any other number of parts splits the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["MAX_CANONICAL_PARTS", "OrderSpec", "Phase", "Block", "Visit", "EpochOrder",
           "remainder", "slice_of", "cut", "count"]

MAX_CANONICAL_PARTS = 1 << 16  # more ranges than workers anyone runs; the order's tables grow with it


@dataclass(frozen=True)
class OrderSpec:
    """What shapes an epoch's order besides the shards: recorded in every saved state."""

    seed: int
    shuffle: bool
    canonical_parts: int
    block: int  # samples per full block (the shuffle window)
    grain: int = 1  # samples per full record (the layout's pack): stripes are cut at its multiples
    stripes: bool = True  # a shuffled part of several blocks reads them in stripes (else consecutive pieces)

    def __post_init__(self) -> None:
        if not 1 <= self.canonical_parts <= MAX_CANONICAL_PARTS or self.block < 1 or self.grain < 1:
            raise ValueError(f"canonical_parts must be in [1, {MAX_CANONICAL_PARTS}], block and grain >= 1, got "
                             f"{self.canonical_parts}, {self.block}, {self.grain}")


class Phase(NamedTuple):
    """A stretch of an epoch read by ``num_parts`` parts, ``batches`` batches of ``batch_size`` each."""

    num_parts: int
    batch_size: int
    batches: int


class Block(NamedTuple):
    """Block ``b`` of canonical part ``c``: its shard pieces ``(shard, lo, hi)`` (samples of the
    shard, in store order: the order they are read in) and the permutation of its samples (None:
    in order)."""

    c: int
    b: int
    pieces: tuple
    perm: Optional[np.ndarray]

    @property
    def samples(self) -> int:
        return int(sum(hi - lo for _, lo, hi in self.pieces))


class Visit(NamedTuple):
    """Positions ``[u0, u1)`` of block ``(c, b)``, read in one go."""

    c: int
    b: int
    u0: int
    u1: int


Intervals = list  # [(a, b), ...]: positions of E, in reading order


def count(intervals: Sequence[tuple[int, int]]) -> int:
    return int(sum(b - a for a, b in intervals))


def cut(intervals: Sequence[tuple[int, int]], start: int, stop: int) -> Intervals:
    """Positions ``[start, stop)`` of the sequence ``intervals`` describes."""
    out, at = [], 0
    for a, b in intervals:
        lo, hi = max(start - at, 0), min(stop - at, b - a)
        if lo < hi:
            out.append((a + lo, a + hi))
        at += b - a
        if at >= stop:
            break
    return out


def slice_of(rest: Intervals, num_parts: int, part_index: int) -> Intervals:
    """Part ``part_index``'s slice of ``rest`` in a phase of ``num_parts`` parts."""
    m = count(rest)
    return cut(rest, part_index * m // num_parts, (part_index + 1) * m // num_parts)


def remainder(total: int, phases: Sequence[Phase]) -> Intervals:
    """What is left of an epoch of ``total`` samples after ``phases``; ValueError if a phase
    read more batches than its largest slice holds (a padded last batch counts; a part that ran
    out a batch early repeats one, so every part reads as many)."""
    rest: Intervals = [(0, total)] if total else []
    for phase in phases:
        tails, slices = [], [slice_of(rest, phase.num_parts, p) for p in range(phase.num_parts)]
        most = max(count(s) for s in slices)
        if phase.batches > -(-most // phase.batch_size):
            raise ValueError(f"{phase.num_parts} parts read {phase.batches} batches of {phase.batch_size}, their "
                             f"slices hold at most {most:,} samples")
        for mine in slices:
            tails += cut(mine, phase.batches * phase.batch_size, count(mine))
        rest = tails
    return rest


class EpochOrder:
    """The order of one epoch of shards with ``samples`` (per shard, store order)."""

    def __init__(self, samples: Sequence[int], spec: OrderSpec, epoch: int):
        self.samples = np.asarray(samples, np.int64)
        self.spec, self.epoch = spec, int(epoch)
        self.total = int(self.samples.sum())
        k = spec.canonical_parts
        self.canon = np.array([c * self.total // k for c in range(k + 1)], np.int64)  # E bounds of each
        self._canonical: dict = {}
        self._stripes: dict = {}  # c -> (cuts, rotation) of a canonical part read in stripes

    def _rng(self, *words: int) -> np.random.Generator:
        return np.random.default_rng([self.spec.seed, self.epoch, *words])

    def canonical(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Canonical part ``c``: its pieces ``(shard, lo, hi)`` in reading order, where each piece
        starts in its sequence, and where each block starts (and the last ends)."""
        hit = self._canonical.get(c)
        if hit is None:
            hit = self._canonical[c] = self._make_canonical(c)
        return hit

    def _make_canonical(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cum = np.concatenate(([0], np.cumsum(self.samples)))
        s0, s1 = int(self.canon[c]), int(self.canon[c + 1])
        first = int(np.searchsorted(cum, s0, side="right")) - 1
        rows = []
        for k in range(max(first, 0), len(self.samples)):
            lo, hi = max(s0, cum[k]), min(s1, cum[k + 1])
            if cum[k] >= s1:
                break
            if lo < hi:
                rows.append((k, lo - cum[k], hi - cum[k]))
        pieces = np.array(rows, np.int64).reshape(-1, 3)
        if self.spec.shuffle and len(pieces) > 1:
            pieces = pieces[self._rng(c, 0).permutation(len(pieces))]
        starts = np.concatenate(([0], np.cumsum(pieces[:, 2] - pieces[:, 1])))
        n, nb = s1 - s0, max(1, -(-(s1 - s0) // self.spec.block))
        if nb == 1 or not self.spec.shuffle or not self.spec.stripes:
            return pieces, starts, _block_bounds(n, self.spec.block)
        # Stripes: piece p's u units (its shard's samples per record) are cut into nb sub-pieces of
        # q or q + 1 units (u = q * nb + rem); block b takes sub-piece (b - r_p) mod nb, the first rem
        # of which are the larger, and r_p = a shift drawn per epoch + the rems of the pieces before, mod nb:
        # block sizes differ by at most a unit, and each epoch's blocks take other records of each date.
        lo, hi, g = pieces[:, 1], pieces[:, 2], self.spec.grain
        first = lo // g  # units are the shard's records (a grid of g samples: full records), clipped to the piece
        q, rem = np.divmod(-(-hi // g) - first, nb)
        units = np.concatenate((np.zeros((len(lo), 1), np.int64),
                                np.cumsum(q[:, None] + (np.arange(nb)[None, :] < rem[:, None]), axis=1)), axis=1)
        cuts = np.clip((first[:, None] + units) * g, lo[:, None], hi[:, None]) - lo[:, None]
        rotation = (self._rng(c, 2).integers(nb) + np.cumsum(rem) - rem) % nb
        taken = (np.arange(nb)[None, :] - rotation[:, None]) % nb  # the sub-piece of each piece block b takes
        sizes = np.diff(cuts, axis=1)[np.arange(len(pieces))[:, None], taken]
        self._stripes[c] = (cuts, taken)
        return pieces, starts, np.concatenate(([0], np.cumsum(sizes.sum(axis=0))))

    def block(self, c: int, b: int) -> Block:
        pieces, starts, bounds = self.canonical(c)
        q0, q1 = int(bounds[b]), int(bounds[b + 1])
        perm = self._rng(c, 1, b).permutation(q1 - q0) if self.spec.shuffle else None
        if c in self._stripes:
            cuts, taken = self._stripes[c]
            rows = np.arange(len(pieces))
            lo, hi = cuts[rows, taken[:, b]], cuts[rows, taken[:, b] + 1]
            out = sorted((int(k), int(a + x), int(a + y)) for (k, a, _), x, y in zip(pieces, lo, hi) if x < y)
            return Block(c, b, tuple(out), perm)
        out = []
        i = int(np.searchsorted(starts, q0, side="right")) - 1
        while i < len(pieces) and starts[i] < q1:
            k, lo, hi = (int(v) for v in pieces[i])
            a, z = max(q0 - starts[i], 0), min(q1 - starts[i], hi - lo)
            if a < z:
                out.append((k, lo + a, lo + z))
            i += 1
        out.sort()
        return Block(c, b, tuple(out), perm)

    def visits(self, intervals: Intervals) -> Iterator[Visit]:
        """The blocks ``intervals`` (positions of E) pass through, in reading order."""
        for a, z in intervals:
            while a < z:
                c = int(np.searchsorted(self.canon, a, side="right")) - 1
                bounds = self.canonical(c)[2]
                q = a - int(self.canon[c])
                b = int(np.searchsorted(bounds, q, side="right")) - 1
                u1 = min(int(bounds[b + 1]), q + (z - a))
                yield Visit(c, b, q - int(bounds[b]), u1 - int(bounds[b]))
                a += u1 - q

    def shards_of(self, intervals: Intervals) -> set:
        """The shards ``intervals`` read samples of (whole blocks: a block is read whole)."""
        seen, out = set(), set()
        for v in self.visits(intervals):
            seen.add((v.c, v.b))
        for c in {c for c, _ in seen}:
            pieces, _, bounds = self.canonical(c)
            blocks = [b for b in range(len(bounds) - 1) if (c, b) in seen]
            if len(blocks) == len(bounds) - 1:  # every block: the part's pieces (no block made: stripes)
                out.update(int(k) for k in pieces[:, 0])
            else:
                for b in blocks:
                    out.update(k for k, _, _ in self.block(c, b).pieces)
        return out


def _block_bounds(n: int, block: int) -> np.ndarray:
    """Where the blocks of a sequence of ``n`` samples start (and the last ends): as few blocks of at
    most ``block`` samples as hold them, of equal size (a short last block would mix few dates)."""
    blocks = max(1, -(-n // block))
    return np.array([i * n // blocks for i in range(blocks + 1)], np.int64)

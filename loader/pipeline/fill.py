"""Filling one block of the order (:mod:`loader.pipeline.order`) into a shuffle buffer: the loader
thread's work (:mod:`loader.pipeline.pipeline`). For a block it

1. takes the block's shard pieces in groups of at most ``cap`` bytes of files (``store.group_bytes()``:
   a third of a cache's limit, else ``CHECK_GROUP_BYTES``), and has the plan fetch (an object store;
   nothing for a folder), open and check each group's files (:meth:`PlanFiles.ensure`);
2. maps the group's samples to records: each record gets the next slot of the block's buffer and
   the items of it the block holds (a record at a block's or canonical part's edge is read by
   both sides, each keeping its own items);
3. cuts the group's records into reads of at most a tape's bytes (:class:`loader.source.plan.Read`),
   and reads each through MXNet's native iterator into the buffer, the next one opened while one
   is read (its own I/O thread reads ahead);
4. returns the block's emission order: its items' codes in the order of the block's permutation.

Which record lands in which slot, and so every batch, is fixed by the order alone: the cache's
size and the store's kind only change how the records get there. A canonical part's only block,
once read, is kept whole (``Arena.keep_whole``): the next epoch of the same files gathers from it.
"""

from __future__ import annotations

import datetime as dt
import shutil
from typing import NamedTuple, Optional

import numpy as np

from loader.errors import LoaderError
from loader.pipeline.job import EpochJob
from loader.pipeline.memory import TAPE_BYTES, Arena
from loader.pipeline.native import free, label_view, next_label, open_record_iter
from loader.pipeline.shuffle_buffer import ShuffleBuffer, size_class
from loader.source.plan import Read, reader_source
from shardgen.format.schema import day_number

CHECK_GROUP_BYTES = 64 << 20  # files checked before a block's first read (a stripe enters every file: at ten
# years, checking the 1,400 files of a first block before its first read took 0.45 s)

__all__ = ["CHECK_GROUP_BYTES", "Filled", "Halted", "Reading", "group_items", "TAPE_BYTES"]


class Halted(Exception):
    """The job was replaced (``reset()``, a state loaded) or the iterator closed: its work stops."""


class Filled(NamedTuple):
    """What the loader hands the producer for visit ``v`` of ``job``: a buffer and the block's item
    codes in emission order; or the ``error`` that stopped the loader there."""

    job: EpochJob
    v: int
    buffer: Optional[ShuffleBuffer]
    emit: Optional[np.ndarray]
    error: Optional[BaseException] = None


def _records_of(shard, lo: int, hi: int, pack: int) -> int:
    """The records samples ``[lo, hi)`` of ``shard`` are expected in: full records of ``pack``
    samples (a stripe is cut at their bounds), one more where the shard's records are not all full."""
    full = shard.samples == shard.records * pack or shard.records == 1
    return int(min(shard.records, -(-hi // pack) - lo // pack + (0 if full else 1)))


def _group(pieces: tuple, sizes: list, cap: int) -> list:
    """``pieces`` in consecutive groups of at most ``cap`` bytes of files (one piece at least)."""
    groups, size = [[]], 0
    for piece in pieces:
        if groups[-1] and size + sizes[piece[0]] > cap:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += sizes[piece[0]]
    return groups


def group_items(pieces: list, counts: list, slot: int, pack: int) -> tuple[np.ndarray, list]:
    """Pieces ``(shard, lo, hi)`` (samples of the shard; ``counts[i]``: the samples of each record
    of piece ``i``'s shard) as records and items: each record a piece touches gets the next slot
    from ``slot``; returns the items' codes (``slot * pack + item``), in piece order, and each
    piece's records ``(shard, r0, r1, records in its file)``. One pass over all pieces (a loop of
    numpy calls per piece held the GIL for 15 ms over a block of 400 shards). Every piece holds
    samples (``lo < hi``), as ``EpochOrder.block`` makes them."""
    if not pieces:
        return np.zeros(0, np.int64), []
    sizes = np.array([len(c) for c in counts], np.int64)
    per_record = np.concatenate(counts).astype(np.int64, copy=False)
    seg = np.concatenate(([0], np.cumsum(sizes)))  # where each piece's shard's records start
    starts = np.cumsum(per_record) - per_record  # each record's first sample, running over the shards
    base = starts[seg[:-1]]  # each piece's shard's first sample
    lo = np.array([p[1] for p in pieces], np.int64) + base
    hi = np.array([p[2] for p in pieces], np.int64) + base
    r0 = np.searchsorted(starts, lo, side="right") - 1  # the record holding the piece's first sample
    r1 = np.searchsorted(starts, hi, side="left")  # the first record past its last
    m = r1 - r0
    total = int(m.sum())
    record = np.arange(total) - np.repeat(np.cumsum(m) - m, m) + np.repeat(r0, m)
    first = starts[record]
    a = np.maximum(np.repeat(lo, m) - first, 0)
    n = np.minimum(np.repeat(hi, m) - first, per_record[record]) - a
    slots = np.arange(slot, slot + total, dtype=np.int64)
    codes = np.repeat(slots * pack + a, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    recs = [(int(k), int(b0 - s), int(b1 - s), int(size))
            for (k, _, _), b0, b1, s, size in zip(pieces, r0, r1, seg[:-1], sizes)]
    return codes, recs


def _cut_reads(recs: list, slot: int, target: int) -> list[Read]:
    """Records ``(shard, lo, hi, records in its file)`` in slot order, cut into reads of ``target``
    records (the last may be shorter); a read joins any pieces (it is a tape: ``reader_source``)."""
    reads, cur, n, first = [], [], 0, slot
    for k, lo, hi, _ in recs:
        while lo < hi:
            take = min(hi - lo, target - n)
            cur.append((k, lo, lo + take))
            n += take
            lo += take
            if n >= target:
                reads.append(Read(tuple(cur), first))
                first, cur, n = first + n, [], 0
    if cur:
        reads.append(Read(tuple(cur), first))
    return reads


class _Block:
    """The buffer of the block being filled, grown (rarely) when it holds more records than estimated."""

    def __init__(self, arena: Arena, estimate: int, nominal: int):
        self.arena, self.estimate, self.nominal = arena, estimate, nominal
        self.buffer: Optional[ShuffleBuffer] = None

    def room(self, records: int) -> ShuffleBuffer:
        buffer = self.buffer
        if buffer is None or buffer.capacity < records:
            bigger = self.arena.shuffle_buffer(size_class(max(records, self.estimate), self.nominal))
            if buffer is not None:
                for name in ("data", "labels", "starts", "day"):
                    getattr(bigger, name)[:buffer.capacity] = getattr(buffer, name)
                self.arena.give_back(buffer)
            self.buffer = buffer = bigger
        return buffer


class Reading:
    """Opens and reads the natives of one job's blocks (see the module docstring)."""

    def __init__(self, job: EpochJob, arena: Arena, cap: Optional[int]):
        self.job, self.arena, self.cap = job, arena, CHECK_GROUP_BYTES if cap is None else cap
        plan, p = job.plan, job.params
        self.files, self.pack = plan.files, p.schema.pack
        self.days = [day_number(dt.date.fromisoformat(s.date)) for s in plan.shards]
        self.sizes = [s.bytes for s in plan.shards]
        per_record = sum(self.sizes) / max(1, plan.records)
        self.tape_records = max(1, int(TAPE_BYTES // max(1.0, per_record)))

    def check(self) -> None:
        if self.job.halt.is_set():
            raise Halted

    def open(self, read: Read):
        """Read ``read``'s files in use (let go by ``_done``) and a native iterator over its tape."""
        p, files = self.job.params, self.files
        files.ensure(read.shards, halt=self.job.halt)
        try:
            source = reader_source(self.job.plan, read)
            try:
                native = open_record_iter(source, record_floats=p.schema.record_floats,
                                          batch_size=min(p.native_batch, read.records), shuffle=False, seed=0,
                                          preprocess_threads=p.preprocess_threads,
                                          prefetch_buffer=1)  # 8: +500 MB of RSS at ten years, no faster
            finally:
                shutil.rmtree(source.index.parent, ignore_errors=True)  # read at open
        except BaseException:
            files.let_go(read.shards)
            raise
        self.job.opened.set()
        return native

    def _done(self, read: Read, native) -> None:
        free(native)  # before its files go
        self.files.let_go(read.shards)

    def drain(self, read: Read, native, block: _Block) -> None:
        """Every record of ``read`` from ``native`` into the block's buffer, in its slots."""
        left, done = read.records, 0
        days = np.repeat(np.array([self.days[k] for k in read.shards], np.float32),
                         [hi - lo for _, lo, hi in read.pieces])
        while left:
            self.check()
            label = next_label(native)
            if label is None:
                raise LoaderError(f"MXNet's reader ended {left} records early (shards {sorted(set(read.shards))})")
            rows = label_view(label)[:left]  # MXNet's memory: copied once, into the block's buffer
            block.room(read.slot + done + len(rows)).put(read.slot + done, rows, days[done:done + len(rows)])
            done += len(rows)
            left -= len(rows)
        while native.iter_next():  # at its end MXNet 1.9.1's iterator holds no batch: freeing it leaks none
            pass

    def _reads(self, reads: list, block: _Block) -> None:
        """Read ``reads`` in turn, the next one opened while one is read."""
        opened: list = []
        try:
            for i, read in enumerate(reads):
                self.check()
                if not opened:
                    opened.append((read, self.open(read)))
                if i + 1 < len(reads):
                    opened.append((reads[i + 1], self.open(reads[i + 1])))
                self.drain(read, opened[0][1], block)
                self._done(*opened.pop(0))
        finally:
            for read, native in opened:
                self._done(read, native)

    def fill(self, v: int) -> Filled:
        """Visit ``v``'s block, read (or the block kept whole from the epoch before: no read)."""
        job = self.job
        visit = job.visits[v]
        block = job.order.block(visit.c, visit.b)
        plan, files = job.plan, self.files
        key = None  # a canonical part's only block: the next epoch of the same plan holds the same records
        if len(job.order.canonical(visit.c)[2]) == 2:
            key = (plan.folder, block.pieces)
            kept = self.arena.whole(key)
            if kept is not None:
                buffer, _, codes = kept
                job.opened.set()
                return Filled(job, v, buffer, codes if block.perm is None else codes[block.perm])
        estimate = sum(_records_of(plan.shards[k], lo, hi, self.pack) for k, lo, hi in block.pieces)
        target = max(1, min(estimate, self.tape_records))
        filling = _Block(self.arena, estimate, job.params.buffer_records)
        codes, slot = [], 0
        try:
            for group in _group(block.pieces, self.sizes, self.cap):
                self.check()
                shards, first = [k for k, _, _ in group], slot
                files.ensure(shards, halt=job.halt)
                try:
                    group_codes, recs = group_items(group, [files.frames[k].counts for k, _, _ in group], slot,
                                                    self.pack)
                    codes.append(group_codes)
                    slot += sum(r1 - r0 for _, r0, r1, _ in recs)
                    self._reads(_cut_reads(recs, first, target), filling)
                finally:
                    files.let_go(shards)
        except BaseException:
            if filling.buffer is not None:
                self.arena.give_back(filling.buffer)
            raise
        codes = np.concatenate(codes) if codes else np.zeros(0, np.int64)
        buffer = filling.buffer if filling.buffer is not None else filling.room(max(1, slot))
        if key is not None:
            self.arena.keep_whole(key, buffer, slot, codes)
        job.opened.set()
        return Filled(job, v, buffer, codes if block.perm is None else codes[block.perm])


"""The feed: ahead of a stream's producer, a thread makes the blocks of its visits readable, in
order. For each block (:mod:`loader.pipeline.order`) it

1. takes the block's shard pieces in groups of at most ``cap`` bytes of files (``store.group_bytes()``:
   a third of a cache's limit, else ``CHECK_GROUP_BYTES``), and for each group has the plan fetch (an object store;
   nothing for a folder), open and check its files (:meth:`PlanFiles.ensure`);
2. maps the group's samples to records: each record gets the next slot of the block's buffer and
   the items of it the block holds (a record at a block's or canonical part's edge is read by
   both sides, each keeping its own items);
3. cuts the group's records into reads (native iterators, see :class:`loader.source.plan.Read`)
   and opens them, at most ``ahead`` not yet taken by the producer;
4. once the block's last read is queued, hands over the block's emission order: its items'
   codes in the order of the block's permutation.

Which record lands in which slot, and so every batch, is fixed by the order alone: ``readers``,
``native_batch``, the cache's size and the store's kind only change how the records get there.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
from typing import Callable, NamedTuple, Optional

import numpy as np

from loader.errors import LoaderError, as_loader_error
from loader.pipeline.memory import TAPE_BYTES, Arena
from loader.pipeline.native import free
from loader.pipeline.order import EpochOrder, Visit
from loader.source.plan import EpochPlan, Read
from shardgen.format.schema import day_number

CHECK_GROUP_BYTES = 64 << 20  # files checked before a block's first read (a stripe enters every file: at ten
# years, checking the 1,400 files of a first block before its first read took 0.45 s)

__all__ = ["CHECK_GROUP_BYTES", "ReadItem", "BlockItem", "Feed", "TAPE_BYTES", "group_items"]



class ReadItem(NamedTuple):
    visit: int
    read: Read
    native: object
    days: np.ndarray  # the day of each record it returns (checked as they come)
    estimate: int  # records its block is expected to hold (the buffer's size)


class BlockItem(NamedTuple):
    visit: int
    records: int
    emit: np.ndarray  # item codes, in the block's order
    key: Optional[tuple] = None  # a canonical part's only block: kept whole for the next epoch (``Arena.whole``)
    codes: Optional[np.ndarray] = None  # its codes in slot order
    buffer: object = None  # the kept buffer that already holds it (nothing to read)


def _records_of(shard, lo: int, hi: int, pack: int) -> int:
    """The records samples ``[lo, hi)`` of ``shard`` are expected in: full records of ``pack``
    samples (a stripe is cut at their bounds), one more where the shard's records are not all full."""
    full = shard.samples == shard.records * pack or shard.records == 1
    return int(min(shard.records, -(-hi // pack) - lo // pack + (0 if full else 1)))


def _group(pieces: tuple, sizes: list, cap: Optional[int]) -> list:
    """``pieces`` in consecutive groups of at most ``cap`` bytes of files (one piece at least)."""
    if cap is None:
        return [list(pieces)]
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


class Feed:
    """Reads (``ReadItem``) and blocks (``BlockItem``) of ``visits``, in order, then None."""

    def __init__(self, plan: EpochPlan, order: EpochOrder, visits: list[Visit], *, pack: int, readers: int,
                 cap: Optional[int], open_native: Callable, ahead: int, start: Optional[threading.Event] = None,
                 arena: Optional[Arena] = None):
        self.plan, self.order, self.visits, self.pack = plan, order, visits, pack
        self._arena = arena  # where a block kept whole for the next epoch is (``Arena.whole``)
        self.readers, self.cap, self.ahead, self._open_native = readers, cap, ahead, open_native
        self._start = start  # set when this feed may begin fetching (the epoch before it has fetched all)
        self.done_fetching = threading.Event()
        self._items: list = []
        self._natives = 0  # reads queued, not taken yet
        self._queued = 0  # items queued so far
        self._cond = threading.Condition()
        self._halt = threading.Event()
        self._error: Optional[BaseException] = None
        self._days = [day_number(dt.date.fromisoformat(s.date)) for s in plan.shards]
        self._thread = threading.Thread(target=self._run, name="shardgen-feed", daemon=True)
        self._thread.start()

    # -- the producer's side ----------------------------------------------------------------------

    def take(self, wait: bool) -> object:
        """The next item (None: the last was taken); ``wait=False``: False if none is ready."""
        with self._cond:
            while not self._items and self._error is None and not self._halt.is_set():
                if not wait:
                    return False
                self._cond.wait(0.1)
            if self._items:
                item = self._items.pop(0)
                if isinstance(item, ReadItem):
                    self._natives -= 1
                    self._cond.notify_all()
                return item
            if self._error is not None:
                raise self._error
            raise LoaderError("the iterator was closed (or reset) while a block was read")

    def wait_first(self) -> None:
        """Until the first read is open (what stops an epoch from starting is raised here)."""
        with self._cond:
            while not self._queued and self._error is None and not self._halt.is_set():
                self._cond.wait(0.1)
            if not self._queued and self._error is not None:
                raise self._error

    def halt(self) -> None:
        """Tell the feed thread to stop (a fetch waiting out an outage returns) and wake a
        ``take()`` waiting for it; ``close()``, in the producer thread, joins it."""
        self._halt.set()
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop; free the natives never taken (before their files go)."""
        self.halt()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.done_fetching.set()
        with self._cond:
            items, self._items = self._items, []
        for item in items:
            if isinstance(item, ReadItem):
                free(item.native)
                self.plan.files.let_go(item.read.shards)
            elif isinstance(item, BlockItem) and item.buffer is not None:
                self._arena.give_back(item.buffer)

    # -- the feed thread --------------------------------------------------------------------------

    def _room_for_a_read(self) -> bool:
        """Wait until fewer than ``ahead`` reads are queued (False: halted). A read is opened only
        once it may queue: ``loader.pipeline.memory`` counts ``ahead`` native reads opened ahead, not
        one more held open while it waits."""
        with self._cond:
            while self._natives >= self.ahead and not self._halt.is_set():
                self._cond.wait(0.1)
            return not self._halt.is_set()

    def _put(self, item: object) -> bool:
        with self._cond:
            while isinstance(item, ReadItem) and self._natives >= self.ahead and not self._halt.is_set():
                self._cond.wait(0.1)
            if self._halt.is_set():
                return False
            self._items.append(item)
            self._queued += 1
            self._natives += isinstance(item, ReadItem)
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        try:
            if self._start is not None:
                while not self._start.wait(0.1):
                    if self._halt.is_set():
                        return
            for v, visit in enumerate(self.visits):
                if not self._block(v, visit):
                    return
            self.done_fetching.set()  # the next epoch's feed may fetch (not after a failure: until close)
            self._put(None)
        except BaseException as exc:  # raised to the producer by take()
            with self._cond:
                self._error = as_loader_error(exc, self.plan)
                self._cond.notify_all()

    def _block(self, v: int, visit: Visit) -> bool:
        block = self.order.block(visit.c, visit.b)
        plan, files = self.plan, self.plan.files
        key = None  # a canonical part's only block: the next epoch of the same plan holds the same records
        if self._arena is not None and len(self.order.canonical(visit.c)[2]) == 2:
            key = (plan.folder, block.pieces)
            kept = self._arena.whole(key)
            if kept is not None:
                buffer, records, codes = kept
                emit = codes if block.perm is None else codes[block.perm]
                if not self._put(BlockItem(v, records, emit, buffer=buffer)):
                    self._arena.give_back(buffer)
                    return False
                return True
        sizes = [s.bytes for s in plan.shards]
        estimate = sum(_records_of(plan.shards[k], lo, hi, self.pack) for k, lo, hi in block.pieces)
        codes, slot = [], 0
        per_record = sum(s.bytes for s in plan.shards) / max(1, plan.records)
        target = max(1, min(math.ceil(estimate / self.readers), int(TAPE_BYTES // max(1.0, per_record))))
        for group in _group(block.pieces, sizes, self.cap if self.cap is not None else CHECK_GROUP_BYTES):
            shards, group_first = [k for k, _, _ in group], slot
            files.ensure(shards, halt=self._halt)
            try:
                group_codes, recs = group_items(group, [files.frames[k].counts for k, _, _ in group], slot, self.pack)
                codes.append(group_codes)
                slot += sum(r1 - r0 for _, r0, r1, _ in recs)
                for read in _cut_reads(recs, group_first, target):
                    files.ensure(read.shards, halt=self._halt)  # counted as used until the read is done
                    try:
                        days = np.repeat(np.array([self._days[k] for k in read.shards], np.float32),
                                         [hi - lo for _, lo, hi in read.pieces])
                        if not self._room_for_a_read():
                            files.let_go(read.shards)
                            return False
                        native = self._open_native(read)
                    except BaseException:
                        files.let_go(read.shards)
                        raise
                    if not self._put(ReadItem(v, read, native, days, estimate)):
                        free(native)
                        files.let_go(read.shards)
                        return False
            finally:
                files.let_go(shards)
        codes = np.concatenate(codes) if codes else np.zeros(0, np.int64)
        emit = codes if block.perm is None else codes[block.perm]
        return self._put(BlockItem(v, slot, emit, key, codes))

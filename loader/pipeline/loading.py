"""The producer's side of the feed (:mod:`loader.pipeline.feed`): the blocks of a stream's visits
loaded into shuffle buffers, ``readers`` native reads at a time, taken in turns.

A block is *ready* once its emission order has come and no read of it is still going; a batch is
only gathered from ready blocks. Between batches the producer loads the next block at the pace
the current one is consumed (:meth:`Blocks.pace`), so a block is there when it is needed without
a burst, and a stream that is ahead (the next epoch's) loads no faster than it hands out.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from loader.errors import LoaderError
from loader.pipeline.feed import BlockItem, Feed, ReadItem
from loader.pipeline.memory import Arena
from loader.pipeline.native import free, label_view, next_label
from loader.pipeline.shuffle_buffer import size_class

__all__ = ["Blocks", "YIELD_S"]

YIELD_S = 0.0005  # how long the next epoch's stream naps while the current one is short of batches


class _Active:
    __slots__ = ("item", "left")

    def __init__(self, item: ReadItem):
        self.item, self.left = item, item.read.records


class Blocks:
    """Shuffle buffers of the visits being read, filled from the feed's reads."""

    def __init__(self, feed: Feed, arena: Arena, *, readers: int, nominal: int, halt: threading.Event,
                 yield_to: Optional[Callable[[], bool]] = None):
        self.feed, self.arena, self.readers, self.nominal = feed, arena, readers, nominal
        self.halt, self.yield_to = halt, yield_to
        self.buffers: dict = {}  # visit -> ShuffleBuffer
        self.loaded: dict = {}  # visit -> records put so far
        self.estimate: dict = {}  # visit -> records its block is expected to hold
        self.emit: dict = {}  # visit -> its block's item codes in order (the block's reads all taken)
        self.whole: dict = {}  # visit -> its BlockItem, to keep once read (a canonical part's only block)
        self.active: list[_Active] = []
        self.ended = False
        self._turn = 0

    def ready(self, v: int) -> bool:
        return v in self.emit and not any(a.item.visit == v for a in self.active)

    def load(self, v: int) -> None:
        """Until visit ``v``'s block is ready (blocking on the feed when nothing else can move),
        reading only reads of ``v`` and the blocks before it. A canonical part's only block, once
        read, is kept whole for the next epoch (``Arena.keep_whole``)."""
        while not self.ready(v):
            if self.halt.is_set():
                raise LoaderError("the iterator was closed (or reset) while a block was read")
            if not self.pump(wait=True, upto=v) and self.ended and not self.ready(v):
                raise LoaderError(f"the feed ended before block {v} of this stream was read")
        item = self.whole.pop(v, None)
        if item is not None and v in self.buffers:
            self.arena.keep_whole(item.key, self.buffers[v], item.records, item.codes)

    def pace(self, v: int, fraction: float) -> None:
        """Load the first block after visit ``v`` not ready yet, up to ``fraction`` of it (the share
        of ``v`` already handed out), from reads that are open (never waits for the feed); never a
        block past ``v + 1`` (what ``loader.pipeline.memory`` counts: two blocks a stream)."""
        w = v + 1
        while not self.halt.is_set() and not self.ready(w):
            if w in self.estimate and self.loaded.get(w, 0) >= fraction * self.estimate[w]:
                return
            if not self.pump(wait=False, upto=w):  # reads of w and before only: never a block past it
                return

    def pump(self, wait: bool, upto: Optional[int] = None) -> bool:
        """One native batch into its buffer, of a read of visit ``upto`` or before (any, for None),
        taking reads from the feed as slots free up; True if something moved: a batch read, or
        ``upto``'s block found ready. ``wait``: block on the feed when nothing else can move."""
        def mine() -> list:
            return [a for a in self.active if upto is None or a.item.visit <= upto]

        while len(self.active) < self.readers and not self.ended:
            item = self.feed.take(wait=wait and not mine())
            if item is False:
                break
            if item is None:
                self.ended = True
            elif isinstance(item, BlockItem):
                self.emit[item.visit] = item.emit
                if item.buffer is not None:  # kept whole from an epoch before: nothing to read
                    self.buffers[item.visit] = item.buffer
                elif item.key is not None:
                    self.whole[item.visit] = item
            else:
                self._activate(item)
            if upto is not None and self.ready(upto):
                return True
        reads = mine()
        if not reads:
            return upto is not None and self.ready(upto)
        a = reads[self._turn % len(reads)]
        self._turn += 1
        if self.yield_to is not None:  # the next epoch's loading waits while this epoch runs short
            while self.yield_to() and not self.halt.is_set():
                time.sleep(YIELD_S)
        label = next_label(a.item.native)
        if label is None:
            raise LoaderError(f"MXNet's reader ended {a.left} records early (shards "
                              f"{sorted(set(a.item.read.shards))} of block {a.item.visit})")
        rows = label_view(label)[:a.left]  # MXNet's memory: copied once, into the block's buffer
        done = a.item.read.records - a.left
        v = a.item.visit
        self._buffer(v, a.item.read.slot + done + len(rows)).put(a.item.read.slot + done, rows,
                                                                 a.item.days[done:done + len(rows)])
        a.left -= len(rows)
        self.loaded[v] = self.loaded.get(v, 0) + len(rows)
        if not a.left:
            self.active.remove(a)
            self._finish(a.item)
        return True

    def _activate(self, item: ReadItem) -> None:
        self.estimate.setdefault(item.visit, item.estimate)
        self.active.append(_Active(item))

    def _buffer(self, v: int, records: int):
        """Visit ``v``'s buffer, holding at least ``records`` slots (grown, rarely, when a block holds
        more records than its estimate)."""
        buffer = self.buffers.get(v)
        if buffer is None or buffer.capacity < records:
            bigger = self.arena.shuffle_buffer(size_class(max(records, self.estimate.get(v, 0)), self.nominal))
            if buffer is not None:
                for name in ("data", "labels", "starts", "day"):
                    getattr(bigger, name)[:buffer.capacity] = getattr(buffer, name)
                self.arena.give_back(buffer)
            self.buffers[v] = buffer = bigger
        return buffer

    def _finish(self, item: ReadItem) -> None:
        native = item.native
        while native.iter_next():  # at its end MXNet 1.9.1's iterator holds no batch: freeing it leaks none
            pass
        free(native)  # before its files go
        self.feed.plan.files.let_go(item.read.shards)

    def release(self, v: int) -> None:
        """Visit ``v`` was handed out: its buffer goes back to the arena."""
        buffer = self.buffers.pop(v, None)
        self.emit.pop(v, None)
        if buffer is not None:
            self.arena.give_back(buffer)

    def close(self) -> None:
        """Free the natives being read (in this thread, before their files go), give buffers back."""
        for a in self.active:
            free(a.item.native)
            self.feed.plan.files.let_go(a.item.read.shards)
        self.active.clear()
        for v in list(self.buffers):
            self.release(v)

"""What a ``ShardIter`` holds in memory: computed from its settings before anything is allocated
(the ``shuffle_buffer`` setting read as records or bytes), and kept by an ``Arena`` from epoch to
epoch instead of allocated anew.

One loader thread fills blocks into one slot, one producer thread gathers batches from them
(:mod:`loader.pipeline.pipeline`):

- shuffle buffers of one block each (kept compact: a run's rows, not its windows): the producer
  holds the block it hands out and, for a batch that spans two, the next; the slot holds one and
  the loader fills one; one more while a block that outgrew its buffer is copied into a larger
  one: 5 in all. When every canonical part is one block (the default wherever the part fits,
  ``settings.buffer_records``) the producer holds one, the slot the next epoch's, and the loader
  waits: 3 in all. A buffer holds the most records a block can (``settings.block_records``: a
  block of the sparsest shards), an eighth more than the average block at least; kept buffers
  count in: the arena lets them go before the total would exceed that;
- MXNet's native iterators: the one being read and the next, opened ahead, each queueing up to
  16 record batches of ``native_batch`` records (``settings.default_native_batch``) in its own
  thread (fixed in MXNet 1.9.1, whatever ``prefetch_buffer``), and each read's tape;
- caller batches: ``prefetch_buffer`` ready ones, plus a few MXNet still holds.

The process's allocator is left as it was found (no ``mallopt``): a process-wide policy is paid by
the trainer's own code. What glibc keeps of the native iterators' freed memory is bounded, not a
leak: each MXNet reader zero-fills 8 MiB input chunks, and once one mapped chunk is freed glibc
serves them from its per-thread arenas and keeps up to twice that (its trim threshold) free at the
top of each arena for the next reader to reuse. The process grows by that cache (74-160 MB on 2
cores, most of it over the first 50-100 epochs, slowly for several hundred more), not a leak:
memory in use stays flat. A process that wants flat RSS from the first
epoch at the price of slower large allocations sets ``MALLOC_MMAP_THRESHOLD_=1048576`` at launch
(docs/internals.md, "Memory").
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import numpy as np

from loader.errors import LoaderError
from loader.pipeline.shuffle_buffer import ShuffleBuffer, buffer_bytes, size_class
from loader.pipeline.zerocopy import Loan, lend
from shardgen.format.schema import Schema

__all__ = ["Arena", "malloc_stats", "TAPE_BYTES", "NATIVE_QUEUE", "MEMORY_SHARE", "BUFFERS", "ONE_BLOCK_BUFFERS",
           "physical_memory", "footprint", "caller_batches_held", "check_footprint", "format_bytes"]

TAPE_BYTES = 16 << 20  # a read's tape at most: opening a native read costs ~3 ms, reading 16 MB ~10 ms
NATIVE_QUEUE = 16  # record batches MXNet 1.9.1's ImageRecordIter queues ahead (kMaxPrefetchBuffer)
KEEP_BUFFERS = 4  # shuffle buffers an arena keeps for later blocks
NATIVES = 2  # native reads alive at once: the one read and the next, opened ahead
BUFFERS = 4 + 1  # blocks alive (the producer's two, the slot's, the loader's) and one outgrowing its buffer
ONE_BLOCK_BUFFERS = 2 + 1  # when an epoch's part is one block: the producer's and the slot's
MEMORY_SHARE = 0.5  # a ShardIter may plan to hold at most this share of physical memory

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_stats() -> Optional[dict]:
    """glibc's ``mallinfo2()``: ``in_use`` (bytes handed out and not given back: what a leak grows,
    while the memory glibc keeps free for reuse does not) and ``mapped_blocks`` (allocations with
    a mapping of their own); None off glibc (2.33 or later)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"in_use": info.uordblks + info.hblkhd, "mapped_blocks": info.hblks}


def physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"  # pragma: no cover


def caller_batches_held(prefetch_buffer: int) -> int:
    """Caller batches an iterator may hold at once: the ready queue, the one the producer
    assembles, and those MXNet still holds. The one count: the memory check's, and the batch
    buffers the ``Arena`` keeps."""
    return prefetch_buffer + 5


def footprint(schema: Schema, *, buffer_records: int, block_records: int, native_batch: int, readers: int,
              prefetch_buffer: int, batch_floats: int, buffers: int = BUFFERS) -> dict:
    """Bytes each part of an iterator may hold at most, and their total. A shuffle buffer holds a
    block: ``buffer_records`` on average, ``block_records`` at most (``settings.block_records``: a
    block of sparse shards, or entering and leaving many shards inside records)."""
    capacity = max(size_class(buffer_records, buffer_records), block_records)
    parts = {
        "shuffle buffers": buffers * buffer_bytes(schema, capacity),
        "native queues": NATIVES * readers * NATIVE_QUEUE * native_batch * 4 * (schema.record_floats + 1),
        "read tapes": NATIVES * readers * min(TAPE_BYTES, block_records * schema.record_bytes),
        "batch buffers": caller_batches_held(prefetch_buffer) * 4 * batch_floats,
    }
    parts["total"] = sum(parts.values())
    return parts


def check_footprint(parts: dict, settings: str, *, share: float = MEMORY_SHARE) -> None:
    """LoaderError if the iterator would plan to hold more than ``share`` of physical memory."""
    total, ram = parts["total"], physical_memory()
    if ram is None or total <= share * ram:
        return
    detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if k != "total")
    raise LoaderError(f"{settings} would hold {format_bytes(total)} ({detail}); this machine has "
                      f"{format_bytes(ram)} and an iterator may take {share:.0%} of it. Lower shuffle_buffer "
                      "(records, or a size such as '256MB'), prefetch_buffer or batch_size")


class Arena:
    """The big buffers of an iterator, reused from epoch to epoch: shuffle buffers (one per stream
    alive, the current and the next epoch's) and batch buffers lent to MXNet without a copy
    (``loader.pipeline.zerocopy``), taken back once MXNet gave them back. Allocating them anew each epoch grew
    the process by megabytes per epoch (the allocator's heap fragments around 4-128 MB blocks), and
    freeing and faulting in a fresh 4 MB array per batch cost the caller's ``next()``."""

    def __init__(self, schema: Schema, batch_floats: int, keep: int, buffers: int = BUFFERS):
        self.schema, self.batch_floats, self.keep, self.buffers = schema, batch_floats, keep, buffers
        self._shuffle: list[ShuffleBuffer] = []
        self._out = self._largest = 0  # records of the buffers handed out; the largest buffer's
        self._batches: list[np.ndarray] = []
        self._loans: dict[int, Loan] = {}  # buffer address -> its loan (kept buffers only)
        self._lock = threading.Lock()
        self._refs: dict[int, int] = {}  # id(buffer) -> holders, for buffers held by more than their stream
        self._whole: Optional[tuple] = None  # (key, buffer, records, codes): a part's one block, read

    def keep_whole(self, key: tuple, buffer: ShuffleBuffer, records: int, codes: np.ndarray) -> None:
        """Keep the block just read, a canonical part's only block: the next epoch of the same files
        holds the same records in the same slots, so it gathers from this buffer instead of reading
        them again (``whole``). The previous one kept is let go."""
        with self._lock:
            self._refs[id(buffer)] = self._refs.get(id(buffer), 1) + 1
            old, self._whole = self._whole, (key, buffer, records, codes)
        if old is not None:
            self.give_back(old[1])

    def whole(self, key: tuple) -> Optional[tuple]:
        """``(buffer, records, codes)`` of the block kept for ``key``, with a hold taken (let go
        by ``give_back``), or None."""
        with self._lock:
            if self._whole is None or self._whole[0] != key:
                return None
            _, buffer, records, codes = self._whole
            self._refs[id(buffer)] += 1
            return buffer, records, codes

    def drop_whole(self, folder: Optional[object] = None) -> None:
        """Let go of the block kept (its files changed; or, for ``folder``, the block of that plan's
        files, as another plan is read)."""
        with self._lock:
            if folder is not None and (self._whole is None or self._whole[0][0] != folder):
                return
            old, self._whole = self._whole, None
        if old is not None:
            self.give_back(old[1])

    def shuffle_buffer(self, capacity: int) -> ShuffleBuffer:
        """The smallest kept buffer of at least ``capacity`` records (``size_class`` keeps the sizes
        few), or a new one."""
        with self._lock:
            self._largest = max(self._largest, capacity)
            fits = [b for b in self._shuffle if b.capacity >= capacity]
            if fits:
                buffer = min(fits, key=lambda b: b.capacity)
                self._shuffle.remove(buffer)
                self._out += buffer.capacity
                return buffer
            self._out += capacity  # a new one: kept ones go while in use and kept exceed the count
            count = self.buffers * self._largest
            while self._shuffle and self._out + sum(b.capacity for b in self._shuffle) > count:
                self._shuffle.pop(0)
        return ShuffleBuffer(self.schema, capacity)

    def new_blocks(self, buffers: Optional[int] = None) -> None:
        """Blocks of another size from now on (a state's; ``buffers`` of them alive at most): kept
        buffers go, the largest is forgotten (buffers still in use are not kept when given back
        unless they fit the new count)."""
        self.drop_whole()
        with self._lock:
            self._shuffle, self._largest = [], 0
            self.buffers = self.buffers if buffers is None else buffers

    def close(self) -> None:
        """The iterator's end: every buffer kept goes (those MXNet holds stay alive with their loans)."""
        self.new_blocks()
        with self._lock:
            self._batches, self._loans = [], {}

    def give_back(self, buffer: ShuffleBuffer) -> None:
        """Keep ``buffer`` for a later block while the buffers in use and kept hold at most
        ``buffers`` of the largest (the footprint's count, see the module docstring)."""
        with self._lock:
            held = self._refs.pop(id(buffer), 1) - 1
            if held > 0:  # kept as a whole block, or read by another stream too
                self._refs[id(buffer)] = held
                return
            self._out -= buffer.capacity
            kept, room = [], self.buffers * self._largest - self._out
            for b in reversed(self._shuffle + [buffer]):
                if len(kept) < KEEP_BUFFERS and b.capacity <= room:
                    kept.append(b)
                    room -= b.capacity
            self._shuffle = kept[::-1]

    def hand_out(self, flat: np.ndarray, views: list) -> list:
        """The caller's arrays: ``views`` ``(start, stop, shape)`` of the batch buffer ``flat``,
        lent to MXNet without a copy (``loader.pipeline.zerocopy``: dropping them runs no Python)."""
        with self._lock:
            loan, arrays = lend(flat, views, self._loans.get(flat.ctypes.data))
            if any(b is flat for b in self._batches):
                if loan is not None:
                    self._loans[flat.ctypes.data] = loan
                else:  # lent by from_numpy: when MXNet gives it back is not known, so it is not kept
                    self._batches = [b for b in self._batches if b is not flat]
        return arrays

    def batch(self) -> np.ndarray:
        """A free batch buffer: one never lent or one MXNet gave back, or a new one. The one
        producer hands out (or drops) each buffer before it asks for another."""
        with self._lock:
            for a in self._batches:
                loan = self._loans.get(a.ctypes.data)
                if loan is None or not loan.out:
                    a.flags.writeable = True  # from_numpy (the rare fallback) leaves it read-only
                    return a
            a = np.empty(self.batch_floats, np.float32)
            if len(self._batches) < self.keep:
                self._batches.append(a)
            return a

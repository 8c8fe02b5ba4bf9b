"""One epoch of one part as a stream of caller batches, produced ahead in a background thread.

The part's records (:mod:`loader.pipeline.parts`: balanced by samples, shared records trimmed) are read by
``readers`` native ``ImageRecordIter``s over disjoint record ranges, each with its own I/O thread;
the producer takes their record batches in a fixed round-robin order into the shuffle buffer
(:mod:`loader.pipeline.shuffle_buffer`), draws caller batches from it and splits them into named NDArrays, up to
``prefetch`` batches ahead. Everything is a function of (plan, seed, epoch, part): the same
batches in the same order every time, and ``skip`` batches can be passed over without being
assembled (resumption). The thread holds no reference to the ``ShardIter`` that owns the stream.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable, Optional

import mxnet as mx
import numpy as np

from loader.errors import LoaderError, mxnet_reason
from loader.pipeline.batches import StreamParams, batch_views, buffer_capacity, fill_batch
from loader.pipeline.memory import Arena
from loader.pipeline.native import copy_into, free, next_label, open_record_iter
from loader.pipeline.parts import PartSplit, SharedRecords, split_part
from loader.pipeline.seeding import epoch_shuffle, segment_order
from loader.pipeline.segments import SegmentFeed, check_room, cut_segments, part_units
from loader.pipeline.shuffle_buffer import ShuffleBuffer
from loader.source.plan import EpochPlan, reader_source

BEHIND_S = 0.002  # how long a stream started behind the caller's next() waits before it starts
YIELD_S = 0.0005  # how long the next epoch's stream naps while the current one is short of batches

__all__ = ["EpochStream", "epoch_batches", "plan_part"]


def plan_part(plan: EpochPlan, p: StreamParams) -> PartSplit:
    """This part's records, trims and readers (in order, one reader: the order must not depend on
    how reads interleave)."""
    return split_part(plan.counts, p.num_parts, p.part_index, p.readers if p.shuffle else 1, plan.can_split)


def epoch_batches(plan: EpochPlan, p: StreamParams, part_samples: list[int]) -> int:
    """Batches every part yields per epoch: ``"pad"``, ``ceil(largest part / batch_size)`` (a batch
    larger than a part: one batch, ``pad = batch_size - samples``, as ``NDArrayIter`` gives);
    ``"discard"``, ``smallest part // batch_size``. LoaderError for an empty part, or no batch at all."""
    smallest, bs = min(part_samples), p.batch_size
    which = part_samples.index(smallest)
    if smallest == 0:
        why = ("fewer than parts" if plan.samples < p.num_parts else "and a part boundary fell in a "
               "record that cannot be told apart from another of its date (same key words and window count), "
               "so it moved to the record's edge (docs/distributed.md, 'Parts'); use fewer parts")
        raise LoaderError(f"part {which} of {p.num_parts} would be empty: generation {plan.generation} "
                          f"has {plan.samples} samples (in {plan.records} records), {why}")
    if p.last_batch == "pad":
        return math.ceil(max(part_samples) / bs)
    if smallest < bs:
        raise LoaderError(f"batch_size {bs} is larger than part {which} of {p.num_parts} ({smallest} of "
                          f"{plan.samples} samples in generation {plan.generation}): last_batch='discard' "
                          "leaves no batch; last_batch='pad' gives one padded batch")
    return smallest // bs


class EpochStream:
    """Batches ``(arrays, valid)`` of one epoch; ``get()`` blocks for the next, ``close()`` stops."""

    def __init__(self, plan: EpochPlan, epoch: int, params: StreamParams, arena: Arena, *, skip: int = 0,
                 behind: bool = False, on_half: Optional[Callable[[EpochStream], None]] = None,
                 yield_to: Optional[Callable[[EpochStream], bool]] = None):
        """``behind``: started from the caller's ``next()``; ``on_half(self)``: called by the producer
        thread once it is half way through the epoch's batches; ``yield_to(self)``: True while
        another stream needs the GIL and the cores first (this one naps before each native read)."""
        self.plan, self.epoch, self.params, self._arena = plan, epoch, params, arena
        self._behind, self._on_half, self._yield_to = behind, on_half, yield_to
        self._producing = True  # the producer thread has batches left to assemble
        self.past_half = False  # the producer thread has been half way (and called on_half)
        self.split = plan_part(plan, params)
        self.part_samples = list(self.split.part_samples)
        self.readers = len(self.split.readers)
        self._units: list = []  # streamed (an object store): the part's shards, read segment by segment
        self._feed: Optional[SegmentFeed] = None
        if plan.source is not None:
            self._units = part_units(plan, self.split.first, self.split.stop)
            self.readers = max(1, min(params.readers if params.shuffle else 1, len(self._units)))
        self.batches = epoch_batches(plan, params, self.part_samples)
        self.samples = self.split.samples
        # Batches ready for the caller. The producer refills only when the buffer falls to half
        # (hysteresis): woken at every take, it would compete for the GIL with the caller's next().
        self._ready: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._low = max(0, params.prefetch_buffer // 2 - 1) if params.prefetch_buffer > 1 else 0
        self._halt = threading.Event()
        self._ended = False  # the producer thread is past its last use of the buffers
        self._skip = skip
        sc = params.schema
        self._x_shape = (params.batch_size, sc.time_steps, sc.num_inputs)
        self._x_size = int(np.prod(self._x_shape))
        self._buffer: Optional[ShuffleBuffer] = None
        self._views = batch_views(params)
        if self._units:
            self._start_feed()  # last: nothing after it may fail and leave the feed running
        self._thread = threading.Thread(target=self._run, name="shardgen-batches", daemon=True)
        self._thread.start()

    # -- consumer side ----------------------------------------------------------------------------

    def get(self) -> tuple[list, int]:
        """The next batch not skipped."""
        while True:
            with self._cond:
                while not self._ready and not self._halt.is_set() and not self._ended:
                    self._cond.wait(0.5)
                if not self._ready:
                    if self._halt.is_set():
                        raise LoaderError("the iterator was closed (or reset) while this next() waited")
                    raise LoaderError(f"the stream of epoch {self.epoch} ended with no batch left for this next() "
                                      f"(generation {self.plan.generation}): the iterator lost count of its batches")
                item = self._ready[0]
                if not isinstance(item, BaseException):  # an error stays: every later get() raises it
                    self._ready.popleft()
                if len(self._ready) <= self._low:
                    self._cond.notify_all()
            if isinstance(item, BaseException):
                raise item
            index, arrays, valid = item
            if index >= self._skip:
                return arrays, valid

    def short(self) -> bool:
        """Its producer is still assembling and the caller's queue is at its low mark or below."""
        return self._producing and len(self._ready) <= self._low

    def skip_to(self, index: int) -> None:
        """Pass over batches before ``index`` (resumption): those not produced yet are never
        assembled, those already queued are dropped by ``get()``."""
        self._skip = max(self._skip, index)

    def close(self, wait: bool = True) -> None:
        """Stop the producer thread; its buffers go back to the arena once it ended. ``wait=False``
        (an epoch read to its end, at ``reset()``): the thread gives them back itself as it ends
        (the native readers' teardown takes ~10 ms), or the caller does now if it already ended."""
        self._halt.set()
        with self._cond:
            self._cond.notify_all()
            ended = self._ended
        if self._thread is threading.current_thread():
            return
        if wait:
            self._thread.join()
            self._give_back()
        elif ended:
            self._give_back()

    def _give_back(self) -> None:
        """The shuffle buffer back to the arena, and the batches never taken (once: either the
        caller or the ending thread)."""
        with self._cond:
            buffer, self._buffer = self._buffer, None
            self._ready.clear()  # batches never taken: their buffers go back to the arena now
        if buffer is not None:
            self._arena.give_back(buffer)

    # -- producer side ----------------------------------------------------------------------------

    def _offer(self, item: object) -> bool:
        """Hand an item over unless told to halt (never blocks a reset() or close())."""
        with self._cond:
            while len(self._ready) >= self.params.prefetch_buffer and not self._halt.is_set():
                self._cond.wait(0.1)
            if self._halt.is_set():
                return False
            self._ready.append(item)
            self._cond.notify_all()
            if len(self._ready) >= self.params.prefetch_buffer:
                # Full: sleep until the caller has taken down to the low mark.
                while len(self._ready) > self._low and not self._halt.is_set():
                    self._cond.wait(0.1)
        return True

    def _open_native(self, source, records: int, seed: int):
        p = self.params
        return open_record_iter(source, record_floats=p.schema.record_floats,
                                batch_size=min(p.native_batch, records), shuffle=p.shuffle, seed=seed,
                                preprocess_threads=p.preprocess_threads, prefetch_buffer=1)

    def _start_feed(self) -> None:
        """A streamed part's segments (``loader.pipeline.segments``) start downloading."""
        p, lanes, plan, budget = self.params, self.readers, self.plan, self.plan.source.budget
        budget.reserve(sum(s.bytes for s, fd in zip(plan.shards, plan.files.fds) if fd >= 0))
        check_room(self._units, lanes, budget.limit, plan.source.location.url, budget.reserved)
        segments = cut_segments(self._units, lanes, budget.for_segments,
                                segment_order(p.seed, self.epoch, p.part_index, p.shuffle))
        seeds, _ = epoch_shuffle(p.seed, self.epoch, p.part_index, len(segments), p.shuffle)
        self._segments = len(segments)
        self._feed = SegmentFeed(self.plan.source, self.plan, segments, self.epoch, lanes,
                                 lambda source, records, k: self._open_native(source, records, seeds[k]),
                                 who=f"stream-{id(self)}")

    def started(self) -> None:
        """Streamed: wait until every lane's first segment is fetched and checked, so what stops
        the epoch from starting (the store out of reach, a shard refused) is raised here, by
        ``ShardIter()`` or ``reset()``, not by the first ``next()``. A folder's stream: at once."""
        if self._feed is not None:
            for lane in range(min(self.readers, self._segments)):
                self._feed.wait(lane)

    def _open_streamed(self) -> list:
        """The lanes of a streamed part, each on its first segment (``loader.pipeline.segments``)."""
        p, lanes, segments = self.params, self.readers, self._segments
        out = []
        try:
            for lane in range(min(lanes, segments)):
                out.append([*self._feed.take(lane), np.empty((p.native_batch, p.schema.record_floats), np.float32),
                            lane])
        except BaseException:
            for lane in out:  # freed now, in this thread, before their segments' files go
                free(lane[0])
            out.clear()
            raise
        return out

    def _next_segment(self, reader: list) -> None:
        """``reader``'s lane read its segment to its end: on to the lane's next one, if any."""
        while reader[0].iter_next():  # at its end it holds no batch: freeing it leaks none
            pass
        free(reader[0])  # before its files go
        reader[0] = None
        self._feed.done(reader[3])
        reader[3] += self.readers
        if reader[3] < self._segments:
            reader[0], reader[1] = self._feed.take(reader[3])

    def _open(self, seeds: list[int]) -> list:
        """The native iterators, opened side by side (each parses the combined index; ctypes
        releases the GIL)."""
        if self._feed is not None:
            return self._open_streamed()
        p, plan = self.params, self.plan
        ranges = self.split.readers
        opened: list = [None] * len(ranges)

        def open_one(r: int, first: int, stop: int) -> None:
            try:
                opened[r] = self._open_native(reader_source(plan, first, stop), stop - first, seeds[r])
            except BaseException as exc:  # raised below, in the producer thread
                opened[r] = exc

        threads = [threading.Thread(target=open_one, args=(r, a, b), name="shardgen-open", daemon=True)
                   for r, (a, b) in enumerate(ranges)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for item in opened:
            if isinstance(item, BaseException):
                for other in opened:
                    if not isinstance(other, BaseException):
                        free(other)  # now, not whenever the traceback goes
                raise item
        floats = p.schema.record_floats  # each reader: [native, records left, its label buffer]
        return [[native, b - a, np.empty((min(p.native_batch, b - a), floats), np.float32)]
                for native, (a, b) in zip(opened, ranges)]

    def _run(self) -> None:
        natives: list = []
        if self._behind:
            # Started from the caller's next() (the next epoch, half way through this one): let go of
            # the GIL first, or start() returns only when this thread lets go of it (up to a switch
            # interval, 5 ms, in the middle of next()).
            time.sleep(BEHIND_S)
        try:
            p = self.params
            seeds, rng = epoch_shuffle(p.seed, self.epoch, p.part_index, len(self.split.readers), p.shuffle)
            natives = self._open(seeds)
            self._produce(natives, rng)
            for native, left, *_ in natives:
                if not left:  # at its end, MXNet 1.9.1's iterator holds no batch: freeing it leaks none
                    while native.iter_next():
                        pass
        except BaseException as exc:  # handed to the caller's next()
            if isinstance(exc, StopIteration):  # an empty native iterator; never the caller's end
                exc = LoaderError(f"MXNet's reader found no records (generation {self.plan.generation})")
            if isinstance(exc, mx.base.MXNetError):
                exc = LoaderError(f"MXNet's reader failed on generation {self.plan.generation} "
                                  f"({len(self.plan.shards)} shards in {self.plan.store}): {mxnet_reason(exc)}")
            self._offer(exc)
        finally:
            self._producing = False
            self.past_half = True  # ended (or failed) before it: nobody else will ask
            for reader in natives:  # frees the native iterators (their threads stop) in this thread
                if reader:
                    free(reader[0])
                reader.clear()
            natives.clear()
            if self._feed is not None:
                self._feed.close()  # and the segments fetched ahead
            with self._cond:
                self._ended = True
                halted = self._halt.is_set()
                self._cond.notify_all()  # a get() waiting for a batch that will never come
            if halted:  # closed without waiting for this thread (else the caller gives back)
                self._give_back()

    def _shared(self) -> Optional[SharedRecords]:
        """The records this part shares with a neighbour (None: none)."""
        trims, plan = self.split.trims, self.plan
        if not trims:
            return None
        return SharedRecords(trims, [plan.day_of(t.record) for t in trims], [plan.keys[t.record] for t in trims],
                             [plan.counts[t.record] for t in trims], self.params.schema.key_words,
                             self.params.schema.pack)

    def _produce(self, natives: list, rng: Optional[np.random.Generator]) -> None:
        p = self.params
        bs = p.batch_size
        self._buffer = buffer = self._arena.shuffle_buffer(buffer_capacity(p))
        shared = self._shared()
        last_real = math.ceil(self.samples / bs) - 1  # batches after it (if any) are all filler
        turn, saved = 0, None
        for index in range(self.batches):
            if self._halt.is_set():
                return
            if index == self.batches // 2:
                if self._on_half is not None:
                    self._on_half(self)
                self.past_half = True
            valid = min(bs, self.samples - index * bs)
            if valid <= 0:
                # Parts differ by one sample, so a shorter part can run out a batch early (docs/distributed.md,
                # "Parts"): it repeats its last real batch, pad = batch - 1.
                if index >= self._skip and not self._offer((index, self._repeat(saved), 1)):
                    return
                continue
            # Fill: shuffling, until the buffer is full; in order, until the batch is there. Streamed,
            # the buffer's fill grows with the batches (2, 4, 8, ... batches' samples): the first ones
            # come from the first segments, not after the whole part has downloaded.
            target = bs * 2 ** min(index + 1, 40) if self._feed is not None else None
            while any(r[1] for r in natives) and (
                    buffer.free_slots >= p.native_batch if p.shuffle else buffer.count < valid) and (
                    target is None or buffer.count < target):
                reader = natives[turn % len(natives)]
                turn += 1
                if not reader[1]:
                    continue
                if self._yield_to is not None:  # the next epoch's fill waits while this epoch runs short
                    while self._yield_to(self) and not self._halt.is_set():
                        time.sleep(YIELD_S)
                label = next_label(reader[0])
                if label is None:
                    raise LoaderError(f"MXNet's reader ended {reader[1]} records early (generation "
                                      f"{self.plan.generation})")
                rows = copy_into(label, reader[2])[:reader[1]]
                reader[1] -= len(rows)
                buffer.add(rows, *(shared.spans(rows) if shared else ()))
                if not reader[1] and self._feed is not None:
                    self._next_segment(reader)
            if buffer.count < valid or (index == last_real and (buffer.count != valid or (
                    shared is not None and not shared.each_seen_once))):
                raise LoaderError(f"part {p.part_index} of {p.num_parts} read {buffer.count} samples for its batch "
                                  f"{index} of {valid} (generation {self.plan.generation}): records changed "
                                  "under the reader?")
            codes = buffer.draw(valid, rng)
            if index < self._skip and not (index == last_real and self.batches - 1 >= self._skip):
                buffer.release(codes)
                continue
            flat = self._arena.batch()
            x = flat[:self._x_size].reshape(self._x_shape)
            arrays = self._arrays(flat, x, *buffer.gather(codes, out=x[:valid])[1:])
            if index == last_real and self.batches - 1 > last_real:
                saved = flat.copy()  # what the filler batches after it repeat
            if index >= self._skip and not self._offer((index, arrays, valid)):
                return

    def _arrays(self, flat: np.ndarray, x: np.ndarray, labels: np.ndarray, days: np.ndarray) -> list:
        """The caller's named arrays: views of ONE buffer lent to MXNet without a copy
        (``loader.pipeline.zerocopy``: given back without Python)."""
        fill_batch(self.params, self._views, flat, x, labels, days)
        return self._arena.hand_out(flat, self._views)

    def _repeat(self, saved: np.ndarray) -> list:
        """A batch that repeats the last real one (docs/distributed.md, "Parts"), in a buffer of its own:
        the caller may have changed the original in place."""
        flat = self._arena.batch()
        flat[:] = saved
        return self._arena.hand_out(flat, self._views)

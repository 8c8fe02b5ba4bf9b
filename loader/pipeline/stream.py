"""One epoch of one part as a stream of caller batches, produced ahead in a background thread.

What the part reads, and in which order, is the epoch's order (:mod:`loader.pipeline.order`):
this part's slice of what the phases before left. A feed thread (:mod:`loader.pipeline.feed`)
makes its blocks readable ahead, native reads load them into shuffle buffers
(:mod:`loader.pipeline.loading`), and the producer gathers each batch from its block(s) in the
block's permuted order, splits it into named NDArrays and queues up to ``prefetch`` batches.
The same batches come every time for the same order, whatever the settings that only shape how
records get there. The thread holds no reference to the ``ShardIter`` that owns the stream.
"""

from __future__ import annotations

import collections
import functools
import math
import shutil
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from loader.errors import LoaderError, as_loader_error
from loader.pipeline.batches import StreamParams, batch_views, fill_batch
from loader.pipeline.feed import Feed
from loader.pipeline.loading import YIELD_S, Blocks
from loader.pipeline.memory import Arena
from loader.pipeline.native import open_record_iter
from loader.pipeline.order import EpochOrder, OrderSpec, Phase, cut, slice_of
from loader.pipeline.parts import split_phase
from loader.source.plan import EpochPlan, Read, reader_source

BEHIND_S = 0.002  # how long a stream started behind the caller's next() waits before it starts

__all__ = ["EpochStream", "order_spec"]


def order_spec(p: StreamParams) -> OrderSpec:
    return OrderSpec(p.seed, p.shuffle, p.canonical_parts, p.block, p.schema.pack if p.schema is not None else 1,
                     p.stripes)


class EpochStream:
    """Batches ``(arrays, valid)`` of one epoch; ``get()`` blocks for the next, ``close()`` stops."""

    def __init__(self, plan: EpochPlan, epoch: int, params: StreamParams, arena: Arena, *,
                 phases: Sequence[Phase] = (), skip: int = 0, cap: Optional[int] = None,
                 gate: Optional[threading.Event] = None, behind: bool = False,
                 on_half: Optional[Callable[[EpochStream], None]] = None,
                 yield_to: Optional[Callable[[EpochStream], bool]] = None):
        """``phases``: what was read of this epoch before (a resumed state); ``skip``: batches of
        this phase already read. ``cap``: bytes of files a feed group may hold (``store.group_bytes()``);
        ``gate``: set once this stream may start fetching. ``behind``: started from the caller's
        ``next()``; ``on_half(self)``: called by the producer thread once it is half way through the
        epoch's batches; ``yield_to(self)``: True while another stream needs the GIL first."""
        self.plan, self.epoch, self.params, self._arena = plan, epoch, params, arena
        self.phases, self._skip = tuple(phases), skip
        self._behind, self._on_half, self._yield_to = behind, on_half, yield_to
        self._producing = True  # the producer thread has batches left to assemble
        self.past_half = False  # the producer thread has been half way (and called on_half)
        self.failed = False  # its producer stopped on an error (the next get() raises it)
        self.order = EpochOrder(plan.sample_counts, order_spec(params), epoch)
        rest, self.part_samples, self.batches = split_phase(params, self.order.total, self.phases, plan.generation)
        self._mine = slice_of(rest, params.num_parts, params.part_index)
        self.samples = self.part_samples[params.part_index]
        self.readers = params.readers
        bs = params.batch_size
        self._last_real = math.ceil(self.samples / bs) - 1  # batches after it (if any) are all filler
        self._from = min(skip, max(self._last_real, 0)) if self.batches else 0  # first batch assembled
        self.visits = list(self.order.visits(cut(self._mine, self._from * bs, self.samples)))
        self._ready: collections.deque = collections.deque()
        self._cond = threading.Condition()
        # Batches ready for the caller. The producer refills only when the queue falls to its low
        # mark (hysteresis): woken at every take, it would compete for the GIL with the caller's next().
        self._low = max(0, params.prefetch_buffer // 2 - 1) if params.prefetch_buffer > 1 else 0
        self._halt = threading.Event()
        self._ended = False  # the producer thread is past its last use of the buffers
        sc = params.schema
        self._x_shape = (bs, sc.time_steps, sc.num_inputs)
        self._x_size = int(np.prod(self._x_shape))
        self._views = batch_views(params)
        self.feed = Feed(plan, self.order, self.visits, pack=sc.pack, readers=self.readers, cap=cap,
                         open_native=self._open_native, ahead=self.readers, start=gate, arena=arena)
        self._blocks = Blocks(self.feed, arena, readers=self.readers, nominal=params.buffer_records, halt=self._halt,
                              yield_to=(lambda: yield_to(self)) if yield_to is not None else None)
        self._thread = threading.Thread(target=self._run, name="shardgen-batches", daemon=True)
        self._thread.start()

    # -- consumer side ----------------------------------------------------------------------------

    def started(self) -> None:
        """Until the first read is open: what stops the epoch from starting (the store out of reach,
        a shard refused) is raised here, by ``ShardIter()`` or ``reset()``, not by the first ``next()``
        (``reset()`` onto a plan whose files were all checked when it was made does not ask: its
        first read opened 21-31 ms into a reset() at 400 shards)."""
        if self.visits:
            self.feed.wait_first()

    def get(self) -> tuple[list, int]:
        """The next batch."""
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
        return item

    @functools.cached_property
    def dates_per_block(self) -> Optional[int]:
        """The fewest shards a block of this stream spans (computed once: ``it.stats`` asks)."""
        pieces = {(v.c, v.b): self.order.block(v.c, v.b).pieces for v in self.visits}
        return min((len({k for k, _, _ in p}) for p in pieces.values()), default=None)

    def short(self) -> bool:
        """Its producer is still assembling and the caller's queue is at its low mark or below."""
        return self._producing and len(self._ready) <= self._low

    def close(self) -> None:
        """Stop the producer thread (and the feed) and join it."""
        self._halt.set()
        self.feed.halt()  # a producer waiting for the feed (the feed waiting out an outage) wakes
        with self._cond:
            self._cond.notify_all()
            self._ready.clear()
        if self._thread is not threading.current_thread():
            self._thread.join()

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

    def _open_native(self, read: Read):
        p = self.params
        source = reader_source(self.plan, read)
        try:
            return open_record_iter(source, record_floats=p.schema.record_floats,
                                    batch_size=min(p.native_batch, read.records), shuffle=False, seed=0,
                                    preprocess_threads=p.preprocess_threads,
                                    prefetch_buffer=1)  # 8: +500 MB of RSS at ten years, no faster
        finally:
            shutil.rmtree(source.index.parent, ignore_errors=True)  # read at open

    def _run(self) -> None:
        if self._behind:
            # Started from the caller's next() (the next epoch, half way through this one): let go of
            # the GIL first, or start() returns only when this thread lets go of it.
            time.sleep(BEHIND_S)
        try:
            self._produce()
        except BaseException as exc:  # handed to the caller's next()
            self.failed = True
            self._offer(as_loader_error(exc, self.plan))
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """THE order a stream stops in, whatever stopped it (its end, an error, ``close()`` from
        ``reset()``, ``ShardIter.close()``, a dropped iterator's finalizer or the exit hook, all of
        which only set ``_halt`` and may join this thread):

        1. the producer stops taking reads (``_halt``; the feed is halted too, so a producer waiting
           for a feed that waits out an outage wakes), or it ran out of batches;
        2. the natives it was reading are freed, in this thread (their I/O threads end), and the
           reads let go of their files (``Blocks.close``);
        3. the feed thread is stopped and joined; the natives it opened that nobody took are freed
           and let go of their files; the next epoch's feed may start fetching (``Feed.close``);
        4. the block buffers go back to the arena (2.), and a ``get()`` still waiting is woken.
        The plan's files themselves are closed by ``Epochs`` once no stream reads them."""
        self._producing = False
        self.past_half = True  # ended (or failed) before it: nobody else will ask
        self._blocks.close()
        self.feed.close()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def _produce(self) -> None:
        p, blocks = self.params, self._blocks
        bs = p.batch_size
        vi, u = 0, (self.visits[0].u0 if self.visits else 0)
        saved = None
        for index in range(self._from, self.batches):
            if self._halt.is_set():
                return
            while self._yield_to is not None and self._yield_to(self) and not self._halt.is_set():
                time.sleep(YIELD_S)  # the next epoch's gathers wait while this epoch's stream runs short
            if index >= self.batches // 2 and not self.past_half:
                self.past_half = True  # (``on_half`` may ask again at the next batch)
                if self._on_half is not None:
                    self._on_half(self)
            valid = min(bs, self.samples - index * bs)
            if valid <= 0:
                # Parts differ by one sample, so a shorter part can run out a batch early (docs/distributed.md,
                # "Parts"): it repeats its last real batch, pad = batch - 1.
                if index >= self._skip and not self._offer((self._repeat(saved), 1)):
                    return
                continue
            pieces, need = [], valid
            while need:
                visit = self.visits[vi]
                blocks.load(vi)
                take = min(need, visit.u1 - u)
                if take <= 0:  # past this part's last sample: counts gone wrong, never a loop without end
                    raise LoaderError(f"epoch {self.epoch}: batch {index} asks for {need} samples past the end "
                                      f"of this part's {self.samples}: the iterator lost count of its batches")
                pieces.append((vi, blocks.emit[vi][u:u + take]))
                u += take
                need -= take
                if u == visit.u1 and vi + 1 < len(self.visits):
                    vi, u = vi + 1, self.visits[vi + 1].u0
            flat = self._arena.batch()
            x = flat[:self._x_size].reshape(self._x_shape)
            labels = np.empty((valid, p.schema.label_floats), np.float32)
            days = np.empty(valid, np.float32)
            at = 0
            for v, codes in pieces:
                n = len(codes)
                _, labels[at:at + n], days[at:at + n] = blocks.buffers[v].gather(codes, out=x[at:at + n])
                at += n
            for v in {v for v, _ in pieces}:
                if v < vi or (v == vi and u == self.visits[v].u1):
                    blocks.release(v)
            if index == self._last_real and self.batches - 1 > self._last_real:
                fill_batch(p, self._views, flat, x, labels, days)
                saved = flat.copy()  # what the filler batches after it repeat
            if index >= self._skip and not self._offer((self._arrays(flat, x, labels, days), valid)):
                return
            visit = self.visits[vi]
            blocks.pace(vi, (u - visit.u0) / max(1, visit.u1 - visit.u0))

    def _arrays(self, flat: np.ndarray, x: np.ndarray, labels: np.ndarray, days: np.ndarray) -> list:
        """The caller's named arrays: views of ONE buffer lent to MXNet without a copy
        (``loader.pipeline.zerocopy``: given back without Python)."""
        fill_batch(self.params, self._views, flat, x, labels, days)
        return self._arena.hand_out(flat, self._views)

    def _repeat(self, saved: np.ndarray) -> list:
        """A batch that repeats the last real one (docs/distributed.md, "Parts"), in a buffer of its own:
        the caller may have changed the original in place. A resume inside the repeated batches
        assembles the last real one again (``_from``): never a batch of NaN for want of it."""
        if saved is None:
            raise LoaderError(f"epoch {self.epoch}: the batch to repeat after the last real one (batch "
                              f"{self._last_real}) was not assembled: the iterator lost count of its batches")
        flat = self._arena.batch()
        flat[:] = saved
        return self._arena.hand_out(flat, self._views)

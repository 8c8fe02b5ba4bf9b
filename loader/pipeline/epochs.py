"""What a ``ShardIter`` holds between epochs, and how one epoch's stream hands over to the next.

Held: the current plan (its open files), the stream reading this epoch, the
stream already filling for the next one, the buffers they share (``Arena``) and the reader
lease. All of it must be let go even if the iterator is dropped without ``close()``, so threads
reference this object, never the iterator, and garbage collection can release it.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from loader.errors import LoaderError
from loader.pipeline import shutdown
from loader.pipeline.batches import StreamParams
from loader.pipeline.memory import Arena
from loader.pipeline.stream import EpochStream
from loader.pipeline.zerocopy import lenders, sweep
from loader.source.plan import EpochPlan, recheck
from shardgen.format.schema import Schema
from shardgen.offthread import OffThread
from shardgen.store.lease import Lease

__all__ = ["Epochs", "join_closing"]

_CLOSING = OffThread("shardgen-close")  # closes of dropped iterators


def join_closing(timeout: float) -> None:
    """Wait for the close threads of dropped iterators (the exit hook: their native threads must be
    gone before MXNet's shutdown)."""
    _CLOSING.join(timeout)


def _closed_during_reset(plan: EpochPlan) -> LoaderError:
    return LoaderError(f"{plan.store}: the iterator was closed (by another thread) during reset()")


class Epochs:
    def __init__(self, lease: Lease, cap: Optional[int] = None, *, release_claim: Callable[[], object] = lambda: None,
                 who: str = ""):
        """``cap``: bytes of shard files a feed group may hold (in a bounded cache, a third of it:
        the group being read, the next one fetched, and the next epoch's first one, which waits
        until this epoch fetched its last). ``release_claim``: the store lets go of what ``who``
        (the iterator) made local, at ``close()`` (``shutdown.STEPS``)."""
        self.lease, self.cap, self.release_claim, self.who = lease, cap, release_claim, who
        self.stream: Optional[EpochStream] = None
        self.ahead: Optional[EpochStream] = None
        self.ending: set = set()  # streams end_current() took out and is stopping: close() waits for them too
        self.plan: Optional[EpochPlan] = None
        self.starting: Optional[EpochStream] = None  # the stream start() waits for (under lock): close() ends it first
        self.arena: Optional[Arena] = None
        self.lock = threading.Lock()
        self.closed = False  # close() ran: no stream starts again (a reset() racing a close() in another thread)
        self.shut = False  # close() ran to its end (an interrupt in it leaves this False)
        self.on_ahead = lambda: None  # called once the next epoch's stream opened
        self.old_plans = OffThread("shardgen-old-plan")  # a plan left at reset() closes off the caller's thread
        lenders(+1)

    def start(self, plan: EpochPlan, epoch: int, params: StreamParams, phases: tuple = (), skip: int = 0,
              wait: bool = True) -> EpochStream:
        """Make ``plan`` current and return the stream reading ``epoch`` of it: the one already
        filling ahead if it reads the same plan and epoch from its start, else a new one. Nothing
        changes if the epoch cannot start (e.g. a part smaller than a batch): the error is raised
        and the plan's files are let go."""
        with self.lock:
            if self.closed:
                if plan.files is not None and (self.plan is None or self.plan.folder != plan.folder):
                    plan.files.close()
                raise _closed_during_reset(plan)
            previous = self.plan
            ahead, self.ahead = self.ahead, None
            if ahead is not None and (ahead.plan.folder != plan.folder or ahead.epoch != epoch or skip or phases
                                      or ahead.params != params or ahead.failed):  # (reset() may not wait to see)
                ahead.close()  # reads files of the old plan: gone before its files are let go
                ahead = None
            stream = None
            try:
                stream = ahead if ahead is not None else EpochStream(
                    plan, epoch, params, self.arena, phases=phases, skip=skip, cap=self.cap, on_half=self._half_way)
                if wait:
                    self.starting = stream
                    try:
                        stream.started()  # its first read is open (from an object store: its first files are here)
                    finally:
                        self.starting = None
            except BaseException:
                if stream is not None:
                    stream.close()
                if plan.files is not None and (previous is None or previous.folder != plan.folder):
                    plan.files.close()
                raise
            self.plan = plan
            if previous is not None and previous.folder != plan.folder:
                self.arena.drop_whole(previous.folder)  # the old plan's (the new stream may have kept its own)
                # No stream reads it any more: its files and folder go in a thread of their own
                # (400 shards: 126 ms of rmtree and closes the caller's reset() waited for).
                self.old_plans.run(previous.files.close)
            self.lease.renew(plan.generation)
            self.stream = stream
            if stream.past_half:  # a short epoch handed out half its batches before it was current
                self._open_ahead(epoch + 1, params, behind=True)
            return stream

    def _open_ahead(self, epoch: int, params: StreamParams, behind: bool) -> None:
        """The one place the next epoch's stream starts (under ``lock``)."""
        if self.ahead is None and self.plan is not None and not self.closed:
            try:
                current = self.stream
                # Files made local as reads need them (a cache): the next epoch fetches once this one
                # has fetched its last (never the same file twice at once, nor more than the cache holds).
                lazy = current is not None and self.plan.files is not None and not self.plan.files.eager
                gate = current.feed.done_fetching if lazy else None
                self.ahead = EpochStream(self.plan, epoch, params, self.arena, cap=self.cap, gate=gate, behind=behind,
                                         on_half=self._half_way, yield_to=self._starving)
            except LoaderError:
                self.ahead = None
                return
            self.on_ahead()

    def _starving(self, stream: EpochStream) -> bool:
        """Whether the next epoch's ``stream`` should let the current one work first: the current
        one is short of batches (at its low mark) while its producer assembles. The next epoch's
        fill (its shuffle buffer, up to the whole epoch) lands in the second half of each epoch;
        at 90% load it took the GIL and the cores from the current stream's refills (3/4 of the
        waits fell in the third quarter of the epoch). Lock-free: a read of two fields."""
        current = self.stream
        return current is not None and current is not stream and current.short()

    def _half_way(self, stream: EpochStream) -> None:
        """``stream``'s producer thread, half way through its batches: if it is the current stream,
        the next epoch's stream starts here, not in the caller's ``next()`` (creating it and starting
        its thread took the caller 0.5-2.5 ms). Never waits for the lock: a ``reset()`` or
        ``close()`` holding it may be joining this very thread."""
        if not self.lock.acquire(blocking=False):
            stream.past_half = False  # asked again at its next batch
            return
        try:
            if self.stream is stream:
                self._open_ahead(stream.epoch + 1, stream.params, behind=False)
        except Exception:  # reset() makes the stream itself, and says what is wrong
            pass
        finally:
            self.lock.release()

    def recheck(self, plan: EpochPlan, schema: Schema, verify: str) -> None:
        """``plan.recheck`` of the current plan's files, which a ``close()`` from another thread
        cannot close meanwhile (an fstat on a closed, or reused, descriptor). A file that changed
        since it was checked (damaged, or rewritten in place) may have been read by the next epoch's
        stream while it changed: that stream goes, the epoch is read again from the files as they are."""
        with self.lock:
            if self.closed:
                raise _closed_during_reset(plan)
            try:
                changed = recheck(plan, schema, verify)
            except BaseException:
                changed = True
                raise
            finally:
                if changed:  # the block kept whole, and the next epoch's stream, may hold what changed
                    self._drop_ahead()
                    self.arena.drop_whole()

    def _drop_ahead(self) -> None:
        """Close the next epoch's stream, if one started (under ``lock``)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.close()

    def end_current(self) -> None:
        """``shutdown.RESET_STEPS`` (``reset()``, ``load_state_dict()``): stop the current stream and
        join its thread, also when it was read to its end: it may still free natives mid-read
        (``last_batch="discard"`` leaves records unread), and its plan's files may be closed right
        after (review: SIGABRT). Until it has stopped, a ``close()`` from another thread waits for it
        too: its native readers may still be opening on the plan's files, which close() lets go of
        (that race crashed MXNet 1 run in 8)."""
        shutdown.run({"stop_streams": self._end_current}, shutdown.RESET_STEPS, who=self.who)

    def _end_current(self) -> None:
        with self.lock:
            stream, self.stream = self.stream, None
            if stream is None:
                return
            self.ending.add(stream)
        try:
            stream.close()
        finally:
            self.ending.discard(stream)

    def close_streams(self) -> None:
        """Stop every stream, those being ended by another thread too (under ``lock``)."""
        for stream in list(self.ending):
            stream.close()
        for name in ("stream", "ahead"):
            stream = getattr(self, name)
            setattr(self, name, None)
            if stream is not None:
                stream.close()

    def close_when_free(self) -> None:
        """``close()``, for the iterator's finalizer. Garbage collection may run it in any thread at
        any allocation, with any of our locks held: this epochs' lock (``_half_way``), an arena's
        (``hand_out``), ``_HELD_LOCK``, a stream's condition. Closing there joins threads that wait
        for that very lock, so it closes from a thread of its own; only at interpreter exit
        (``weakref.finalize`` running what is left, in the main thread, no lock held) in place
        (:class:`shardgen.offthread.OffThread`)."""
        _CLOSING.run(self.close)

    def close(self) -> None:
        """An iterator's end (``close()``, its finalizer, the exit hook): ``shutdown.STEPS``, in
        their order, under ``lock`` (a ``reset()`` in another thread waits, then finds it closed). A stream
        whose first read a ``reset()`` waits for under ``lock`` (its first fetch may wait for room in a
        full cache, up to 10 minutes) is stopped first, so that wait ends now (issue 64)."""
        starting = self.starting
        if starting is not None:
            starting.close()
        with self.lock:
            if self.shut:  # once (the exit hook, then the reader's own close, run it twice)
                return
            if not self.closed:
                lenders(-1)
            self.closed = True  # no stream starts from now on
            shutdown.run({"stop_streams": self.close_streams, "free_arrays": self._free_arrays,
                          "close_files": self._close_files, "release_claim": self.release_claim,
                          "drop_lease": self.lease.release}, who=self.who)
            self.shut = True  # not after an interrupt: the next close() runs every step again

    def _free_arrays(self) -> None:
        if self.arena is not None:
            self.arena.new_blocks()  # the shuffle buffers it kept go now, not when the iterator is collected
        sweep()  # arrays the caller dropped since the producer's last lend: freed, loans given back let go

    def _close_files(self) -> None:
        self.old_plans.join(60)  # plans left at a reset() are closed
        if self.plan is not None:
            self.plan.files.close()
            self.plan = None

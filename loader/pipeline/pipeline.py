"""The reading core of a ``ShardIter``: two threads and two hand-overs.

- The **loader** thread walks jobs (:class:`loader.pipeline.job.EpochJob`: one epoch of one part,
  a value) and fills each job's blocks (:mod:`loader.pipeline.fill`), in order, into one slot: a
  queue of one. Once the current job's blocks are filled it goes on with the next epoch's
  (``EpochJob.successor``), so ``reset()`` finds its first block ready, and closes the files of
  plans no job reads any more (off the caller's thread).
- The **producer** thread takes the blocks from the slot and gathers the caller's batches
  (:mod:`loader.pipeline.gather`) into a queue of ``prefetch_buffer``; ``next()`` takes one.

``start()`` (the iterator's construction, ``reset()``, ``load_state_dict()``) makes a job current:
the next epoch's job when it reads what is asked, else a new one, and every other job is halted
(its block and batches dropped; the threads leave it at their next step). Nothing is polled and
nothing naps: each wait is on one lock's conditions. What is held is let go in one written order
whichever way the iterator ends (:mod:`loader.pipeline.shutdown`); the threads reference this
object, never the iterator, so a dropped iterator is collected and closes it.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

from loader.errors import LoaderError
from loader.pipeline import shutdown
from loader.pipeline.batches import StreamParams
from loader.pipeline.job import EpochJob
from loader.pipeline.threads import Threads
from loader.pipeline.zerocopy import lenders, sweep
from loader.source.plan import EpochPlan, recheck
from shardgen.format.schema import Schema
from shardgen.offthread import OffThread, send_again
from shardgen.store.lease import Lease

__all__ = ["Pipeline", "join_closing"]

_CLOSING = OffThread("shardgen-close")  # closes of dropped iterators


def join_closing(timeout: float) -> None:
    """Wait for the close threads of dropped iterators (the exit hook: their native threads must be
    gone before MXNet's shutdown)."""
    _CLOSING.join(timeout)


def _closed(plan: EpochPlan) -> LoaderError:
    return LoaderError(f"{plan.store}: the iterator was closed (by another thread) during reset()")


class Pipeline(Threads):
    def __init__(self, lease: Lease, cap: Optional[int] = None, *, release_claim: Callable[[], object] = lambda: None,
                 who: str = ""):
        """``cap``: bytes of shard files a block's group of files may hold (``store.group_bytes()``: a
        bounded cache). ``release_claim``: the store lets go of what ``who`` (the iterator) made local,
        at ``close()`` (``shutdown.STEPS``)."""
        super().__init__(cap)
        self.lease, self.release_claim, self.who = lease, release_claim, who
        self.plan: Optional[EpochPlan] = None  # the current job's
        self.shut = False
        self._closing = threading.Lock()
        lenders(+1)

    # -- the caller's side ------------------------------------------------------------------------

    def start(self, plan: EpochPlan, epoch: int, params: StreamParams, phases: tuple = (), skip: int = 0,
              wait: bool = True) -> EpochJob:
        """Make ``epoch`` of ``plan`` after ``phases`` and ``skip`` batches current; ``wait``: until
        its first read is open, so what stops it (a shard refused, the store out of reach) is raised
        here. Nothing changes if it cannot start (a part smaller than a batch): the error is raised
        and a new plan's files are let go."""
        try:
            with self.lock:
                if self.closed:
                    raise _closed(plan)
                ahead = self.ahead
            job = ahead if ahead is not None and ahead.is_for(plan, epoch, params, phases, skip) else \
                EpochJob(plan, epoch, params, phases, skip)  # the order is computed off the lock
            with self.lock:
                if self.closed:
                    raise _closed(plan)
                if job is not self.ahead and self.ahead is not None and self.ahead.is_for(plan, epoch, params,
                                                                                          phases, skip):
                    job = self.ahead  # made by the loader meanwhile
                previous = self.plan
                for old in (self.current, self.ahead):
                    if old is not None and old is not job:
                        old.halt.set()
                        old.opened.set()
                job.renamed(plan)
                self.current, self.ahead, self.plan = job, None, plan
                self._plans[plan.folder] = plan
                self._depth = params.prefetch_buffer
                self._low = max(0, self._depth // 2 - 1) if self._depth > 1 else 0
                stale = self._drop_halted()
                self._wake_all()
        except BaseException:
            self._let_go_new(plan)
            raise
        self._give_back(stale)
        if previous is not None and previous.folder != plan.folder:
            self.arena.drop_whole(previous.folder)  # the old plan's
        self.lease.renew(plan.generation)
        if job.past_half:  # the producer got half way before it was current
            self.on_ahead()
        self._start_threads()
        if wait and job.visits:
            job.opened.wait()
            if job.open_error is not None and not job.halt.is_set():
                raise job.open_error
            if self.closed:
                raise _closed(plan)
        return job

    def _let_go_new(self, plan: EpochPlan) -> None:
        with self.lock:
            mine = plan.folder in self._plans
        if not mine and plan.files is not None:
            plan.files.close()

    def get(self) -> tuple[list, int]:
        """The current job's next batch ``(arrays, valid)`` (the caller checked that it has one left)."""
        with self.lock:
            job = self.current
            while not (self._ready and self._ready[0][0] is job):
                if self.closed or job is None or job.halt.is_set():
                    raise LoaderError("the iterator was closed (or reset) while this next() waited")
                if self._ready or job.produced:
                    raise LoaderError(f"the batches of epoch {job.epoch} ended with none left for this next() "
                                      f"(generation {job.plan.generation}): the iterator lost count of its batches")
                self._caller_cv.wait()
            item = self._ready[0][1]
            if not isinstance(item, BaseException):  # an error stays: every later get() raises it
                self._ready.popleft()
            if len(self._ready) <= self._low:
                self._producer_cv.notify()
        if isinstance(item, BaseException):
            raise item
        return item

    def end_current(self) -> None:
        """``shutdown.RESET_STEPS`` (``reset()``, ``load_state_dict()``): the current job is halted,
        its batches dropped (the next epoch's job, if the loader started it, goes on)."""
        shutdown.run({"stop_streams": self._halt_current}, shutdown.RESET_STEPS, who=self.who)

    def _halt_current(self) -> None:
        with self.lock:
            job = self.current
            if job is None:
                return
            job.halt.set()
            job.opened.set()
            stale = self._drop_halted()
            self._wake_all()
        self._give_back(stale)

    def recheck(self, plan: EpochPlan, schema: Schema, verify: str) -> None:
        """``plan.recheck`` of the current plan's files (under ``lock``: the loader closes none
        meanwhile). A file that changed since it was checked may have been read into the next
        epoch's blocks: that job and the block kept whole go, the epoch is read from the files as they are."""
        with self.lock:
            if self.closed:
                raise _closed(plan)
            changed = True
            try:
                changed = recheck(plan, schema, verify)
            finally:
                stale = []
                if changed and self.ahead is not None:
                    self.ahead.halt.set()
                    self.ahead = None
                    stale = self._drop_halted()
        self._give_back(stale)
        if changed:
            self.arena.drop_whole()

    # -- the end ----------------------------------------------------------------------------------

    def close_when_free(self) -> None:
        """``close()``, for the iterator's finalizer: garbage collection may run it in any thread,
        with any lock held, so it closes from a thread of its own; at interpreter exit in place
        (:class:`shardgen.offthread.OffThread`)."""
        try:
            _CLOSING.run(self.close)
        except KeyboardInterrupt as exc:  # landed before the run: raised after this finalizer, close left for exit
            _CLOSING.left.append(self.close)
            send_again(type(exc))

    def close(self) -> None:
        """An iterator's end (``close()``, its finalizer, the exit hook): ``shutdown.STEPS``, in
        their order. A ``reset()`` waiting in another thread (its first fetch may wait for room in
        a full cache) is woken and finds the iterator closed."""
        with self._closing:
            if self.shut:  # once (the exit hook, then the reader's own close, run it twice)
                return
            with self.lock:
                if not self.closed:
                    lenders(-1)
                self.closed = True  # no job starts from now on
                for job in (self.current, self.ahead):
                    if job is not None:
                        job.halt.set()
                        job.opened.set()
                self._wake_all()
            shutdown.run({"stop_streams": self._join, "free_arrays": self._free_arrays,
                          "close_files": self._close_files, "release_claim": self.release_claim,
                          "drop_lease": self.lease.release}, who=self.who)
            self.shut = True  # not after an interrupt: the next close() runs every step again

    def _join(self) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        with self.lock:
            stale = [self._slot.buffer] if self._slot is not None and self._slot.buffer is not None else []
            self._slot, self._ready = None, collections.deque()
        self._give_back(stale)

    def _free_arrays(self) -> None:
        if self.arena is not None:
            self.arena.close()  # the buffers it kept go now, not when the iterator is collected
        sweep()  # arrays the caller dropped since the producer's last lend: freed, loans given back let go

    def _close_files(self) -> None:
        with self.lock:
            plans, self._plans = list(self._plans.values()), {}
        for plan in plans:
            plan.files.close()
        self.plan = None

"""The two threads of the reading core (:mod:`loader.pipeline.pipeline`) and their hand-overs,
each a wait on a condition of one lock: the **loader** fills the current job's blocks, then the
next epoch's, into the slot (a queue of one); the **producer** takes them and queues the caller's
batches (``prefetch_buffer`` of them). A job halted (replaced, or the iterator closed) is left at
the next step; its block and batches are dropped by whoever halts it (``_drop_halted``)."""

from __future__ import annotations

import collections
import functools
import threading
from typing import Callable, Optional

from loader.errors import LoaderError, as_loader_error
from loader.pipeline.fill import Filled, Halted, Reading
from loader.pipeline.gather import produce
from loader.pipeline.job import EpochJob
from loader.pipeline.memory import Arena

__all__ = ["Threads"]


class Threads:
    def __init__(self, cap: Optional[int]):
        """``cap``: bytes of shard files a block's group of files may hold (``store.group_bytes()``: a
        bounded cache)."""
        self.cap = cap
        self.arena: Optional[Arena] = None
        self.lock = threading.Lock()
        self._loader_cv, self._producer_cv, self._caller_cv = (threading.Condition(self.lock) for _ in range(3))
        self.current: Optional[EpochJob] = None  # the job next() reads
        self.ahead: Optional[EpochJob] = None  # the next epoch's, once the loader filled the current one's blocks
        self._plans: dict = {}  # folder -> a plan whose files are open (closed by the loader once no job reads it)
        self._slot: Optional[Filled] = None  # the queue of one, loader -> producer
        self._ready: collections.deque = collections.deque()  # (job, batch or error), producer -> caller
        self._depth = self._low = 1  # the ready queue's size (prefetch_buffer) and the mark it refills at
        self._threads: list = []
        self.closed = False
        self.on_ahead: Callable[[], object] = lambda: None  # the producer is half way through the current job

    def _start_threads(self) -> None:
        """The two threads, once; each known only once started (a Ctrl-C between the two leaves the
        one started for ``close()`` to join, never one it cannot join)."""
        for run, name in ((self._loader, "shardgen-loader"), (self._producer, "shardgen-batches"))[len(self._threads):]:
            thread = threading.Thread(target=run, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _wake_all(self) -> None:
        for cv in (self._loader_cv, self._producer_cv, self._caller_cv):
            cv.notify_all()

    def _drop_halted(self) -> list:
        """Drop the block and batches of halted jobs (under ``lock``); returns the buffers to give back."""
        stale = []
        if self._slot is not None and self._slot.job.halt.is_set():
            if self._slot.buffer is not None:
                stale.append(self._slot.buffer)
            self._slot = None
        self._ready = collections.deque(item for item in self._ready if not item[0].halt.is_set())
        return stale

    def _give_back(self, buffers: list) -> None:
        for buffer in buffers:
            self.arena.give_back(buffer)

    # -- the loader thread ------------------------------------------------------------------------

    def _loader(self) -> None:
        while True:
            job = self._next_to_load()
            if job is None:
                return
            try:
                reading = Reading(job, self.arena, self.cap)
                for v in range(len(job.visits)):
                    if not self._hand(reading.fill(v)):
                        break
                else:
                    job.loaded = True
            except Halted:
                pass
            except BaseException as exc:  # raised to the caller after the batches before it
                job.error = as_loader_error(exc, job.plan)
                if not job.opened.is_set():  # start() raises it; a later one reaches next() after the batches before it
                    job.open_error = job.error
                self._hand(Filled(job, -1, None, None, job.error))
            finally:
                job.done_fetching.set()
                job.opened.set()

    def _next_to_load(self) -> Optional[EpochJob]:
        """The job to fill next (None: closed): the current one, else the next epoch's once the
        current one is filled. Plans no job reads are closed here, in this thread."""
        while True:
            with self.lock:
                if self.closed:
                    return None
                needed = {j.plan.folder for j in (self.current, self.ahead) if j is not None}
                stale = [self._plans.pop(f) for f in list(self._plans) if f not in needed]
                cur, ahead = self.current, self.ahead
                if not stale:
                    if cur is not None and not cur.loading:
                        cur.loading = True
                        return cur
                    if cur is not None and cur.loaded and ahead is not None and not ahead.loading:
                        ahead.loading = True
                        return ahead
                    if not (cur is not None and cur.loaded and ahead is None and not cur.followed):
                        self._loader_cv.wait()
                        continue
                    cur.followed = True  # its successor is asked for once
            for plan in stale:
                plan.files.close()
            if stale:
                continue
            try:
                nxt = cur.successor()  # computed off the lock
            except LoaderError:
                continue
            with self.lock:
                if self.current is cur and self.ahead is None:
                    self.ahead = nxt
                    self._producer_cv.notify()

    def _hand(self, filled: Filled) -> bool:
        """Put ``filled`` in the slot once it is empty (False: its job was halted; its buffer went back)."""
        with self.lock:
            while self._slot is not None and not filled.job.halt.is_set() and not self.closed:
                self._loader_cv.wait()
            if not (filled.job.halt.is_set() or self.closed):
                self._slot = filled
                self._producer_cv.notify()
                return True
        if filled.buffer is not None:
            self.arena.give_back(filled.buffer)
        return False

    # -- the producer thread ----------------------------------------------------------------------

    def _producer(self) -> None:
        while True:
            job = self._next_to_produce()
            if job is None:
                return
            held: dict = {}
            try:
                produce(job, self.arena, functools.partial(self._take, job), functools.partial(self._offer, job), held,
                        functools.partial(self._half_way, job))
                job.produced = True
            except Halted:
                pass
            except BaseException as exc:  # handed to the caller's next()
                self._offer(job, as_loader_error(exc, job.plan))
                job.produced = True
            finally:
                self._give_back([f.buffer for f in held.values()])
                with self.lock:
                    self._caller_cv.notify_all()

    def _half_way(self, job: EpochJob) -> None:
        """The producer is half way through ``job``: if it is the current one, ``on_ahead`` (a cache
        fetches the newest generation's part, once the loader has fetched this epoch's files); else
        ``start()`` calls it when the job becomes current (a short epoch the producer ran ahead into)."""
        job.past_half = True
        if job is self.current:
            self.on_ahead()

    def _next_to_produce(self) -> Optional[EpochJob]:
        with self.lock:
            while not self.closed:
                cur, ahead = self.current, self.ahead
                if cur is not None and not cur.producing:
                    cur.producing = True
                    return cur
                if ahead is not None and not ahead.producing and cur.produced:
                    ahead.producing = True
                    return ahead
                self._producer_cv.wait()
            return None

    def _take(self, job: EpochJob, v: int) -> Filled:
        with self.lock:
            while self._slot is None or self._slot.job is not job:
                if job.halt.is_set() or self.closed:
                    raise Halted
                self._producer_cv.wait()
            filled, self._slot = self._slot, None
            self._loader_cv.notify()
        if filled.error is not None:
            raise filled.error
        if filled.v != v:
            raise LoaderError(f"epoch {job.epoch}: block {filled.v} came where block {v} was due: the iterator "
                              "lost count of its blocks")
        return filled

    def _offer(self, job: EpochJob, item: object) -> bool:
        """Queue ``item`` for the caller (False: the job was halted). Full, the producer sleeps until
        the caller has taken the queue down to its low mark (woken at every take, it would compete
        for the GIL with the caller's next())."""
        with self.lock:
            while len(self._ready) >= self._depth and not (job.halt.is_set() or self.closed):
                self._producer_cv.wait()
            if job.halt.is_set() or self.closed:
                return False
            self._ready.append((job, item))
            self._caller_cv.notify()
            if len(self._ready) >= self._depth:
                while len(self._ready) > self._low and not (job.halt.is_set() or self.closed):
                    self._producer_cv.wait()
        return True


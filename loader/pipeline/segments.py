"""Reading a part from an object store as it downloads: the part's shards in segments.

A store folder's part is read by ``readers`` native iterators over contiguous record ranges,
each shuffling its whole range, so every file must be there before the first record is read.
From an object store that would wait for the whole part and need a cache as large. Instead:

* the part's shards (``units``: a whole shard, or the records of an edge shard the part owns)
  are put in an order drawn from ``(seed, epoch, part)`` and cut into **segments**. The first
  segments hold one shard each (the first batch waits for ``lanes`` shards, not the part); each
  round of ``lanes`` segments holds ``GROWTH`` times more, up to ``segment_cap`` bytes when there is a ``cache_limit``;
* ``lanes`` native iterators read segment after segment (segment ``k`` goes to lane
  ``k % lanes``), each shuffling within its segment, and the shuffle buffer mixes the lanes;
* a ``SegmentFeed`` thread downloads the segments in that order, checks them, and opens each
  one's native iterator before its lane gets there, at most ``lanes`` segments ahead and within
  the byte ``Budget`` (``cache_limit``, see ``segment_cap``); a segment read to its end is let go
  (its files may be evicted) and frees its bytes for the next.

Everything is a function of (plan, seed, epoch, part, lanes, cache_limit): the same batches
every time, and a resumed epoch passes over its first batches as a folder's does.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from loader.errors import LoaderError
from loader.pipeline.native import free
from loader.sizes import say_size
from loader.source.plan import EpochPlan, make_plan, reader_source

GROWTH = 4  # each round's segments hold this many times the last's shards (opening a native costs 15-70 ms)

__all__ = ["Unit", "Budget", "StreamSource", "part_units", "segment_cap", "check_room", "cut_segments", "SegmentFeed"]


@dataclass(frozen=True)
class Unit:
    """Records ``[lo, hi)`` of shard ``shard`` (an index into ``plan.shards``), whose file takes
    ``nbytes`` in the cache."""

    shard: int
    lo: int
    hi: int
    nbytes: int


class Budget:
    """Bytes of segments a reader holds in the cache (fetched, not read to their end yet), at most
    ``limit`` (None: no bound). The next epoch's feed waits until this epoch's has fetched its last
    segment, so the epoch being read is never starved by the one after it."""

    def __init__(self, limit: Optional[int]):
        self.limit = limit
        self.reserved = 0  # the plan's own files (the shards its part's bounds fall inside), outside segments
        self.held = 0
        self.fetching: collections.Counter = collections.Counter()  # epoch -> feeds still fetching (never 0)
        self.cond = threading.Condition()

    def _blocked(self, nbytes: int, epoch: int) -> bool:
        return any(e < epoch for e in self.fetching) or (
            self.limit is not None and self.held and self.held + nbytes > self.for_segments)

    @property
    def for_segments(self) -> Optional[int]:
        """What the segments may hold: ``limit`` less the plan's own files."""
        return None if self.limit is None else self.limit - self.reserved

    def reserve(self, plan_bytes: int) -> None:
        """A plan holds ``plan_bytes`` of files in the cache beside its segments (the largest such
        plan so far is kept out of what segments may hold)."""
        with self.cond:
            self.reserved = max(self.reserved, plan_bytes)

    def acquire(self, nbytes: int, epoch: int, halted: threading.Event) -> bool:
        """Count ``nbytes`` in, waiting until they fit; False if ``halted`` first."""
        with self.cond:
            while not halted.is_set() and self._blocked(nbytes, epoch):
                self.cond.wait(0.1)
            if halted.is_set():
                return False
            self.held += nbytes
            return True

    def try_acquire(self, nbytes: int, epoch: int) -> bool:
        """Count ``nbytes`` in if they fit now."""
        with self.cond:
            if self._blocked(nbytes, epoch):
                return False
            self.held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()

    def started(self, epoch: int, delta: int) -> None:
        with self.cond:
            self.fetching[epoch] += delta
            if self.fetching[epoch] <= 0:
                del self.fetching[epoch]
            self.cond.notify_all()


@dataclass(frozen=True)
class StreamSource:
    """What a streamed plan's segments are made from: where the files come from, how they are
    checked, and the reader's byte budget."""

    location: Any
    manifest: Any
    verify: str
    budget: Budget


def part_units(plan: EpochPlan, first: int, stop: int) -> list[Unit]:
    """The part's records ``[first, stop)`` (the plan's numbering, see ``make_plan``) by shard."""
    if first >= stop:
        return []
    sf = plan.shard_first
    units = []
    for k in range(plan.shard_of(first), plan.shard_of(stop - 1) + 1):
        s = plan.shards[k]
        if plan.files.fds[k] < 0:  # not read yet: one pseudo-record, the whole shard
            units.append(Unit(k, 0, s.records, s.bytes))
            continue
        lo, hi = max(first, sf[k]) - sf[k], min(stop, sf[k + 1]) - sf[k]
        units.append(Unit(k, int(lo), int(hi), s.bytes))  # the cache holds the whole file
    return units


def segment_cap(limit: Optional[int], lanes: int) -> Optional[int]:
    """Bytes a segment may hold under ``cache_limit``. A feed holds at most ``3 * lanes - 1``
    segments: one being read per lane, one fetched per other lane that has not got to it yet, and
    ``lanes`` fetched ahead. So the next one always fits: the feed never waits for room that only
    the lane waiting for it could free."""
    return None if limit is None else limit // (3 * lanes)


def check_room(units: list, lanes: int, limit: Optional[int], where: str, reserved: int = 0) -> None:
    """LoaderError unless ``limit`` can stream ``units`` beside ``reserved`` bytes of the plan's own
    files: every shard within ``segment_cap``."""
    if limit is None or not units:
        return
    largest = max(u.nbytes for u in units)
    if largest > segment_cap(limit - reserved, lanes):
        need = 3 * lanes * largest + reserved
        beside = f", beside the {say_size(reserved)} of the shards its bounds fall inside" if reserved else ""
        raise LoaderError(f"{where}: cache_limit {say_size(limit)} is too small to stream this part: it must hold "
                          f"{3 * lanes} of its largest shard ({say_size(largest)}) at once ({lanes} reader(s) x 3: "
                          f"one read, one waiting, one fetched ahead){beside}; raise cache_limit to at least "
                          f"{say_size(need)}, or pass readers=1")


def cut_segments(units: list[Unit], lanes: int, limit: Optional[int], rng: Optional[np.random.Generator]
                 ) -> list[list[Unit]]:
    """The units in reading order (shuffled by ``rng``, else as stored) cut into segments: round
    ``r`` (``lanes`` segments) of ``GROWTH**r`` units each, at most ``segment_cap`` bytes."""
    order = [units[i] for i in rng.permutation(len(units))] if rng is not None else list(units)
    cap = segment_cap(limit, lanes)
    segments, at, r = [], 0, 0
    while at < len(order):
        want = GROWTH ** r
        for _ in range(lanes):
            if at >= len(order):
                break
            seg, size = [], 0
            while at < len(order) and len(seg) < want and (cap is None or not seg or size + order[at].nbytes <= cap):
                seg.append(order[at])
                size += order[at].nbytes
                at += 1
            segments.append(seg)
        r += 1
    return segments


class SegmentFeed:
    """Downloads, checks and opens the segments of one epoch in order, ahead of the lanes: the
    downloads of later segments run as far ahead as the budget allows (``FETCHERS`` segments at a
    time), the checking and opening at most ``lanes`` segments ahead of the lanes."""

    FETCHERS = 2  # segments downloading at once (each with up to objcache.DOWNLOAD_THREADS files)

    def __init__(self, source: StreamSource, plan: EpochPlan, segments: list, epoch: int, lanes: int,
                 open_native, who: str):
        self.source, self.plan, self.segments, self.epoch = source, plan, segments, epoch
        self.ahead = 2 * lanes if source.budget.limit is None else lanes
        self._open_native, self._who = open_native, who
        self._ready: dict = {}  # k -> (sub plan, native, records)
        self._taken = 0  # segments handed to a lane
        self._halt = threading.Event()
        self._cond = threading.Condition()
        self._held: dict = {}  # k -> [sub plan or None, bytes]: its bytes counted in the budget, not let go yet
        self._error: Optional[BaseException] = None  # what stopped the feed
        source.budget.started(epoch, +1)
        self._fetching = True
        self._pool = ThreadPoolExecutor(self.FETCHERS, thread_name_prefix="shardgen-segment-fetch")
        self._makers = ThreadPoolExecutor(lanes, thread_name_prefix="shardgen-segment-open")
        self._thread = threading.Thread(target=self._run, name="shardgen-segments", daemon=True)
        self._thread.start()

    def _done_fetching(self) -> None:
        with self._cond:
            if not self._fetching:
                return
            self._fetching = False
        self.source.budget.started(self.epoch, -1)

    def _fetch(self, k: int) -> None:
        shards = [self.plan.shards[u.shard] for u in self.segments[k]]
        self.source.location.fetch(shards, who=f"{self._who}-s{k}", schema=self.source.manifest.schema)

    def _submit(self, downloads: dict, k: int, *, wait: bool) -> bool:
        """Segment ``k``'s downloads into the pool once its bytes fit the budget (``wait``: until they
        do; else False at once if they do not)."""
        nbytes = sum(u.nbytes for u in self.segments[k])
        budget = self.source.budget
        if not (budget.acquire(nbytes, self.epoch, self._halt) if wait else budget.try_acquire(nbytes, self.epoch)):
            return False
        with self._cond:
            self._held[k] = [None, nbytes]
        downloads[k] = self._pool.submit(self._fetch, k)
        return True

    def _run(self) -> None:
        downloads: dict = {}
        try:
            n = len(self.segments)
            for k, seg in enumerate(self.segments):
                if k not in downloads and not self._submit(downloads, k, wait=True):
                    return  # halted
                nxt = max(downloads) + 1
                # Later segments download ahead once the lanes have their first (the first batch first).
                while nxt < n and nxt - k <= 2 * self.FETCHERS and self._taken and self._submit(downloads, nxt,
                                                                                                 wait=False):
                    nxt += 1
                if nxt == n:
                    self._done_fetching()  # the next epoch's feed may start downloading
                with self._cond:
                    while k >= self._taken + self.ahead and not self._halt.is_set() and self._error is None:
                        self._cond.wait(0.1)
                if self._halt.is_set() or self._error is not None:
                    return
                self._makers.submit(self._make_when_fetched, k, seg, downloads.pop(k))
        except BaseException as exc:  # raised to the lane that asks for a segment it did not make
            self._fail(exc)
        finally:
            stop = self._halt.is_set() or self._error is not None  # else the segments submitted are all made
            self._makers.shutdown(wait=True, cancel_futures=stop)
            self._pool.shutdown(wait=True, cancel_futures=True)  # downloads started end; the others never start
            self._done_fetching()

    def _fail(self, exc: BaseException) -> None:
        # No traceback kept: its frames would keep a native iterator alive (freed later, by the GC in
        # another thread, after its segment's files were let go: MXNet then reads removed paths).
        with self._cond:
            if self._error is None:
                self._error = exc.with_traceback(None)
            self._cond.notify_all()

    def _make_when_fetched(self, k: int, seg: list, download) -> None:
        """Segment ``k`` checked and opened once its files are here (``lanes`` of these side by side:
        opening a native iterator takes 15-70 ms, mostly outside the GIL)."""
        try:
            download.result()  # its error, if any
            if self._halt.is_set():
                return
            sub = self._make(k, seg)
            with self._cond:
                held = self._held.get(k)
                if held is not None and not self._halt.is_set():
                    held[0] = sub[0]
                    self._ready[k] = sub
                    self._cond.notify_all()
                    return
            free(sub[1])  # closed meanwhile: the native freed here, then its files
            sub[0].files.close()
            self.source.location.release(f"{self._who}-s{k}")
        except BaseException as exc:
            self._fail(exc)

    def _make(self, k: int, seg: list) -> tuple:
        """Segment ``k``'s plan (its shards fetched and checked; the unit a part starts inside
        first, the unit it ends inside last, so its records are one range) and native iterator."""
        src, plan = self.source, self.plan
        seg = sorted(seg, key=lambda u: (u.lo == 0, u.hi < plan.shards[u.shard].records))
        shards = tuple(plan.shards[u.shard] for u in seg)
        sub = make_plan(src.location, src.manifest, shards, verify=src.verify, fetcher=f"{self._who}-s{k}")
        try:
            first = seg[0].lo
            stop = int(sub.shard_first[-2]) + seg[-1].hi
            native = self._open_native(reader_source(sub, first, stop), stop - first, k)
        except BaseException:  # (no native was made)
            sub.files.close()
            src.location.release(f"{self._who}-s{k}")
            raise
        return sub, native, stop - first

    def wait(self, k: int) -> None:
        """Until segment ``k`` is ready; the error that stopped the feed before it, if one did."""
        with self._cond:
            while k not in self._ready and k >= self._taken and not self._halt.is_set() and self._error is None:
                self._cond.wait(0.1)
            if k not in self._ready and k >= self._taken and self._error is not None:
                raise self._error

    def take(self, k: int) -> tuple:
        """Segment ``k``'s ``(native iterator, records)``, once the feed has it."""
        with self._cond:
            while k not in self._ready and not self._halt.is_set() and self._error is None:
                self._cond.wait(0.1)
            item = self._ready.pop(k, None)
            if item is None:
                if self._error is not None:
                    raise self._error
                raise LoaderError("the iterator was closed (or reset) while a segment downloaded")
            self._taken = max(self._taken, k + 1)
            self._cond.notify_all()
        return item[1], item[2]

    def done(self, k: int) -> None:
        """Segment ``k`` was read to its end (or is given up): its files may go, its bytes are free."""
        with self._cond:
            held = self._held.pop(k, None)
        if held is not None:
            if held[0] is not None:
                held[0].files.close()
            self.source.location.release(f"{self._who}-s{k}")
            self.source.budget.release(held[1])

    def close(self) -> None:
        """Stop fetching; let go of every segment held (natives not taken are freed here)."""
        self._halt.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._cond:
            ready, self._ready = self._ready, {}
            held = list(self._held)
        for item in ready.values():  # natives never taken: freed now (their threads stop), before their files
            free(item[1])
        ready.clear()
        for k in held:
            self.done(k)
        self._done_fetching()

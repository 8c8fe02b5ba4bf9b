"""A limited object cache, seen by its iterator (issue 64, contracts 6 and 11).

6. **A wait ends when the iterator does.** A fetch that waits for room in a full ``cache_limit``
   (the room held by files another reader of the cache uses) waits until they are let go, or until
   the iterator is closed or reset: ``close()`` (from any thread) and ``reset()`` return within
   seconds, not the cache's patience (``ROOM_WAIT_S``, 10 minutes).
11. **A limit too small is refused at construction**, saying the least that works: it must hold
   three of the largest shard beside the manifest (twice: the next one is written beside it) and the
   snapshots the cache keeps. The least it names reads epochs.

Bounds are generous (seconds where the real answer takes milliseconds); each was run beside two
CPU hogs. Runs on the ``fake://`` store kind (no server): what is tested is the cache's room.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from conftest import batch_ids, make_store
from test_s3_loader import upload_store

from loader import LoaderError, ShardIter
from shardgen.errors import ShardgenError
from shardgen.store import open_store, room
from shardgen.store.cached import CachedStore
from shardgen.store.manifest import Manifest

pytestmark = pytest.mark.parametrize("s3", ["fake"], indirect=True)
COUNTS = {f"2024-02-{d:02d}": 30 + d % 7 for d in range(1, 25)}  # 24 dates, 5-6 kB shards
BOUND_S = 20  # what close() or reset() may take at most here (they take milliseconds)


def _remote(s3, tmp_path, generations: int = 1):
    local = tmp_path / "local"
    make_store(local, COUNTS)
    for g in range(1, generations):
        make_store(local, {f"2024-03-{g:02d}": 30}, base_id=10_000 * g)
    return local, upload_store(s3, local)


def _least(url, cache, **kw) -> int:
    """The least cache_limit, as the refusal of one of three of the largest shard says it."""
    big = max(s.bytes for s in open_store(url).require_manifest().shards)
    with pytest.raises(LoaderError, match="raise cache_limit to at least") as refused:
        ShardIter(url, 8, cache_dir=cache, cache_limit=3 * big, **kw)
    return int(re.search(r"at least ([\d,]+) bytes", str(refused.value)).group(1).replace(",", ""))


def test_a_limit_without_room_for_the_manifest_beside_three_shards_is_refused_at_construction(s3, tmp_path):
    local, url = _remote(s3, tmp_path)
    manifest = Manifest.load(local / "manifest.json")
    big = max(s.bytes for s in manifest.shards)
    least = _least(url, tmp_path / "probe")
    assert least >= 3 * big + 2 * (local / "manifest.json").stat().st_size, \
        f"a limit of {least} leaves no room for the manifest twice beside three shards of {big}"
    with pytest.raises(LoaderError, match=f"cache_limit .* is too small .* at least {least:,} bytes"):
        ShardIter(url, 8, cache_dir=tmp_path / "less", cache_limit=least - 1)
    with ShardIter(url, 8, cache_dir=tmp_path / "c", cache_limit=least, shuffle_buffer=16) as it:
        for _ in range(2):
            assert sorted(i for b in it for i in batch_ids(b)) == list(range(manifest.samples))
            it.reset()


def test_a_pinned_generations_snapshot_counts_in_the_least_limit(s3, tmp_path):
    """A reader pinned to generation 1 keeps its snapshot in the cache (not manifest.json): the least
    limit holds it beside three shards, and room for the manifest (twice) that a load_state_dict()
    fetches, its snapshot's size standing in for it."""
    local, url = _remote(s3, tmp_path, generations=2)
    big = max(s.bytes for s in Manifest.load(local / "generations" / "1.json").shards)
    least = _least(url, tmp_path / "probe", generation=1)
    snapshot = (local / "generations" / "1.json").stat().st_size
    assert least >= 3 * big + snapshot + 2 * snapshot, \
        f"a limit of {least} leaves no room for the snapshot kept and the manifest a resume fetches (about its size)"
    with pytest.raises(LoaderError, match=f"at least {least:,} bytes"):
        ShardIter(url, 8, cache_dir=tmp_path / "less", cache_limit=least - 1, generation=1)


class _Waits:
    """Counts the fetches waiting for room right now (a spy: the room's own code runs)."""

    def __init__(self, monkeypatch):
        self.now, self.lock, real = 0, threading.Lock(), room.Room.make_room

        def make_room(room_, missing, files, halt):
            with self.lock:
                self.now += 1
            try:
                return real(room_, missing, files, halt)
            finally:
                with self.lock:
                    self.now -= 1

        monkeypatch.setattr(room.Room, "make_room", make_room)

    def seen(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.now:
                time.sleep(0.3)  # still waiting a moment later: a wait, not a fetch passing through
                if self.now:
                    return True
            time.sleep(0.02)
        return False


def _full(s3, tmp_path, monkeypatch, third: bool = True):
    """An iterator at the least limit whose cache holds another reader's files (the two largest
    shards, never let go). ``third``: once its first block is read, before the loader goes on, the
    other reader takes what room is left, file after file until one would wait: the loader's next
    fetch of a file it does not hold waits for room."""
    from loader.pipeline import fill

    _, url = _remote(s3, tmp_path)
    limit = _least(url, tmp_path / "probe")
    waits = _Waits(monkeypatch)
    monkeypatch.setattr(room, "ROOM_WAIT_S", 600.0)
    cache = CachedStore.of(open_store(url), tmp_path / "c", limit)  # the one the iterator will read through
    manifest = open_store(url).require_manifest()
    largest = sorted(manifest.shards, key=lambda s: -s.bytes)
    cache.make_local(largest[:2], who="another-reader", schema=manifest.schema)
    gate, real_fill = threading.Event(), fill.Reading.fill

    def gated(self, v):
        if third and (v or self.job.epoch):
            gate.wait(BOUND_S)
        return real_fill(self, v)

    monkeypatch.setattr(fill.Reading, "fill", gated)
    it = ShardIter(url, 8, cache_dir=tmp_path / "c", cache_limit=limit, shuffle_buffer=40,
                   prefetch_buffer=2)
    if third:
        for shard in largest[2:]:
            halt = threading.Timer(1.0, lambda: None)
            halt.start()  # (its ``finished`` event is set after a second: a wait for room ends then)
            try:
                cache.make_local([shard], who=f"another-reader-{shard.date}", schema=manifest.schema,
                                 halt=halt.finished)
            except ShardgenError:
                break  # no room left
            finally:
                halt.cancel()
    gate.set()
    return it, cache, waits


def _bounded(fn, what: str, monkeypatch) -> tuple:
    """``fn()`` in a thread: what it raised (None) and its seconds; fails past ``BOUND_S`` (then the
    cache's patience is cut to 0 so the wait ends and the test can clean up)."""
    outcome: list = []
    t = threading.Thread(target=lambda: outcome.append(_call(fn)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(BOUND_S)
    if t.is_alive():
        monkeypatch.setattr(room, "ROOM_WAIT_S", 0.0)
        t.join(60)
        pytest.fail(f"{what} still waited after {BOUND_S} s (a fetch waiting for room in a full cache)")
    return outcome[0], time.monotonic() - t0


def _call(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        return exc
    return None


def test_close_from_another_thread_ends_a_fetch_that_waits_for_room(s3, tmp_path, monkeypatch):
    it, cache, waits = _full(s3, tmp_path, monkeypatch)
    try:
        assert waits.seen(BOUND_S), "no fetch waited for room (the test's set-up)"
        exc, _ = _bounded(it.close, "close() from another thread", monkeypatch)
        assert exc is None, exc
        with pytest.raises(LoaderError, match="closed"):
            it.next()
    finally:
        it.close()
        cache.let_go("another-reader")


def test_close_from_another_thread_ends_a_reset_whose_epoch_waits_for_room(s3, tmp_path, monkeypatch):
    """reset() starts the next epoch, whose first fetch waits for room; close() from another thread
    ends that wait (and the reset() with a LoaderError, or the next next())."""
    it, cache, waits = _full(s3, tmp_path, monkeypatch)
    try:
        done: list = []
        resetting = threading.Thread(target=lambda: done.append(_call(it.reset)), daemon=True)
        resetting.start()
        assert waits.seen(BOUND_S), "no fetch waited for room (the test's set-up)"
        exc, _ = _bounded(it.close, "close() from another thread during reset()", monkeypatch)
        assert exc is None, exc
        resetting.join(BOUND_S)
        assert not resetting.is_alive(), "reset() went on waiting for room after close()"
        assert done[0] is None or isinstance(done[0], LoaderError), done
        with pytest.raises(LoaderError, match="closed"):
            it.next()
    finally:
        it.close()
        cache.let_go("another-reader")


def test_close_from_another_thread_waits_for_the_stream_a_reset_is_ending(s3, tmp_path, monkeypatch):
    """reset() in one thread is ending the epoch's stream (whose fetch waited for room) when close()
    comes from another: close() returns only once that stream has stopped, so no thread of the
    iterator is left reading (its native readers would open files close() let go of: a crash)."""
    for trial in range(3):
        before = set(threading.enumerate())
        it, cache, waits = _full(s3, tmp_path / f"t{trial}", monkeypatch)
        try:
            assert waits.seen(BOUND_S), "no fetch waited for room (the test's set-up)"
            resetting = threading.Thread(target=_call, args=(it.reset,), daemon=True)
            resetting.start()
            time.sleep(0.005)  # reset() has taken the stream out and is stopping it
            exc, _ = _bounded(it.close, "close() from another thread during reset()", monkeypatch)
            left = sorted(t.name for t in set(threading.enumerate()) - before
                          if t is not resetting and t.name != "shardgen-lease" and t.is_alive())
            assert exc is None and not left, f"trial {trial}: close() returned with {left} still running ({exc})"
            resetting.join(BOUND_S)
        finally:
            it.close()
            cache.let_go("another-reader")


def test_a_pinned_reader_at_its_least_limit_resumes_and_reads_on(s3, tmp_path, monkeypatch):
    """A pinned reader's least limit counts its snapshot, not manifest.json, which a load_state_dict()
    fetches (to check the state's shards against the store's): the state loads and its epoch and the
    next one are read whole, or the load is refused at once, saying the least limit; never a
    fetch that fails (or waits for room) mid-epoch."""
    monkeypatch.setattr(room, "ROOM_WAIT_S", 5.0)  # a wait for room that cannot end fails in seconds
    local, url = _remote(s3, tmp_path, generations=2)
    least = _least(url, tmp_path / "probe", generation=1)
    total = Manifest.load(local / "generations" / "1.json").samples
    with ShardIter(url, 8, cache_dir=tmp_path / "c", cache_limit=least, generation=1, shuffle_buffer=16) as it:
        first = [i for _, b in zip(range(3), it) for i in batch_ids(b)]
        state = it.state_dict()
        try:
            it.load_state_dict(state)
        except LoaderError as exc:
            assert re.search(r"cache_limit .* is too small .* at least [\d,]+ bytes", str(exc)), exc
            assert sorted(first + [i for b in it for i in batch_ids(b)]) == list(range(total))
            return
        assert sorted(first + [i for b in it for i in batch_ids(b)]) == list(range(total))
        it.reset()
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(total))


def test_close_from_another_thread_ends_a_reset_whose_first_fetch_waits_for_room(s3, tmp_path, monkeypatch):
    """The other reader takes the whole room the moment reset() lets this epoch's files go, so the
    next epoch's first fetch (which reset() waits for) waits for room: close() from another thread
    ends it within seconds."""
    it, cache, waits = _full(s3, tmp_path, monkeypatch, third=False)
    manifest = open_store(it.manifest_path.rsplit("/", 1)[0]).require_manifest()
    third = sorted(manifest.shards, key=lambda s: -s.bytes)[2:3]
    try:
        holder = threading.Thread(target=cache.make_local, args=(third,), daemon=True,
                                  kwargs=dict(who="third-reader", schema=manifest.schema, halt=threading.Event()))
        holder.start()  # waits until reset() lets the epoch's files go
        resetting = threading.Thread(target=_call, args=(it.reset,), daemon=True)
        resetting.start()
        holder.join(BOUND_S)
        assert waits.seen(BOUND_S), "no fetch waited for room (the test's set-up)"
        exc, _ = _bounded(it.close, "close() from another thread during reset()", monkeypatch)
        assert exc is None, exc
        resetting.join(BOUND_S)
        assert not resetting.is_alive(), "reset() went on waiting for room after close()"
    finally:
        it.close()
        cache.let_go("another-reader")
        cache.let_go("third-reader")

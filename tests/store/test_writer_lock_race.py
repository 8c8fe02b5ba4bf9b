"""Two writers on an object store (issue 64 contract 7): at most one holds the writer lock.

Object stores without conditional writes make taking ``.writer.lock`` a race that the lock wins by
reading its own write back after a pause. These tests race two acquires and stall a holder where a
stall hurts: a read of the lock whose answer arrives late (the judgement it carries is old by then),
a write that lands late, and a whole holder process stopped (SIGSTOP) past the TTL. The store is
``fake://`` (tests/fake_objects.py): its objects are files, a stall is an Event the test sets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_objects import ROOT_ENV, FakeObjects, FakeServer

from shardgen.errors import LockError
from shardgen.store.writer_lock import SETTLE_S, WRITER_LOCK, WriterLock

TTL_S = 4.0  # heartbeats every 0.67 s; a holder that confirmed its lock over 2 s ago gives it up
BOUND_S = 30  # no step of these tests takes this long, even beside two CPU hogs


class StallingObjects(FakeObjects):
    """A fake object store where the test stalls one request of one thread: ``stall("get", thread)``
    makes that thread's next read of the lock take its answer (the bytes as they are now) and wait
    for ``resume`` before it returns; ``stall("put", thread)`` holds that thread's next write of the
    lock until ``resume``, then lands it."""

    def __init__(self, url: str):
        super().__init__(url)
        self.stalls: dict[tuple[str, str], threading.Event] = {}
        self.stalled = threading.Event()  # a request is being held
        self.barrier: threading.Barrier | None = None  # the first reads of the racing threads meet here
        self.met: set[str] = set()

    def stall(self, verb: str, thread: str) -> threading.Event:
        resume = self.stalls[(verb, thread)] = threading.Event()
        return resume

    def _held(self, verb: str) -> threading.Event | None:
        return self.stalls.pop((verb, threading.current_thread().name), None)

    def get_with_info(self, name: str):
        found = super().get_with_info(name)
        if name == WRITER_LOCK:
            me = threading.current_thread().name
            if self.barrier is not None and me.startswith("racer-") and me not in self.met:
                self.met.add(me)
                self.barrier.wait(BOUND_S)
            resume = self._held("get")
            if resume is not None:
                self.stalled.set()
                assert resume.wait(BOUND_S)
        return found

    def put(self, name: str, data: bytes, *, verify: bool = True) -> None:
        if name == WRITER_LOCK:
            resume = self._held("put")
            if resume is not None:
                self.stalled.set()
                assert resume.wait(BOUND_S)
        super().put(name, data, verify=verify)


@pytest.fixture
def objects(tmp_path, monkeypatch):
    FakeServer(tmp_path / "objects")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "objects"))
    return StallingObjects("fake://data/store")


def token_on_the_store(objects) -> str:
    return json.loads(objects.get(WRITER_LOCK))["token"]


def in_thread(fn, name: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at what it raised
            out["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


def acquire_stalled_while_another_takes_it(objects, verb: str) -> tuple[WriterLock, WriterLock, dict]:
    """A ("build") acquires in a thread whose ``verb`` ("get" or "put") of the lock is held until B
    ("watch") has taken the lock in the main thread; then A goes on to its end. (A, B, what A's acquire gave)."""
    a, b = WriterLock(objects, what="build"), WriterLock(objects, what="watch")
    resume = objects.stall(verb, "writer-a")
    ta, ra = in_thread(a.acquire, "writer-a")
    assert objects.stalled.wait(BOUND_S)
    try:
        b.acquire()
    finally:
        resume.set()
    ta.join(BOUND_S)
    assert not ta.is_alive()
    return a, b, ra


def take_when_stale(lock: WriterLock) -> WriterLock:
    """``lock`` acquired once the holder's lock is older than ``lock``'s TTL by the store's clock."""
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            return lock.acquire()
        except LockError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_two_writers_racing_for_a_free_lock_one_takes_it(objects):
    """Both read the lock (absent) before either writes it: the read-back decides, exactly one
    holds it, and the other is refused naming the race. Two locks of one process on one host: only
    the token tells them apart."""
    objects.barrier = threading.Barrier(2)
    a, b = WriterLock(objects, what="build"), WriterLock(objects, what="gc")
    ta, ra = in_thread(a.acquire, "racer-a")
    tb, rb = in_thread(b.acquire, "racer-b")
    ta.join(BOUND_S), tb.join(BOUND_S)
    try:
        won = [lock for lock, r in ((a, ra), (b, rb)) if "value" in r]
        refused = [r["error"] for r in (ra, rb) if "error" in r]
        assert len(won) == 1 and len(refused) == 1, (ra, rb)
        assert isinstance(refused[0], LockError) and "at the same time as us" in str(refused[0])
        assert token_on_the_store(objects) == won[0].token
        won[0].check()
    finally:
        a.release(), b.release()


def test_an_acquire_whose_read_of_the_lock_stalled_does_not_take_it_from_the_writer_that_took_it_meanwhile(objects):
    """A reads the lock (free), and the answer reaches it only after B has taken the lock and read
    its own back: A's judgement is old, A must read again and be refused, and B keeps the lock."""
    a, b, ra = acquire_stalled_while_another_takes_it(objects, "get")
    try:
        assert isinstance(ra.get("error"), LockError), ra
        assert token_on_the_store(objects) == b.token
        b.check()
    finally:
        a.release(), b.release()


def test_an_acquire_whose_write_landed_late_is_refused(objects):
    """A judged the lock free and wrote it, but its write landed only after B had taken the lock
    and read its own back (a write held in flight). A's read-back finds its own token: A must not
    take that as the lock, since B read its own before; at most one of them holds it."""
    a, b, ra = acquire_stalled_while_another_takes_it(objects, "put")
    try:
        assert isinstance(ra.get("error"), LockError), ra
        assert "too late" in str(ra["error"])
    finally:
        a.release(), b.release()


def test_a_lone_writer_whose_write_of_the_lock_is_slow_but_within_the_pause_takes_it(objects):
    """A write that returns half a pause after the read began still lands before any other writer's
    read-back (``LATE_S``): a writer alone on a loaded machine takes the lock (the whole suite beside two CPU
    hogs saw a build refused when the bound was half the pause)."""
    a = WriterLock(objects, what="build")
    resume = objects.stall("put", "writer-a")
    timer = threading.Timer(0.5 * SETTLE_S, resume.set)
    timer.start()
    ta, ra = in_thread(a.acquire, "writer-a")
    ta.join(BOUND_S)
    try:
        assert ra.get("value") is a, ra
        assert token_on_the_store(objects) == a.token
        a.check()
    finally:
        timer.cancel()
        a.release()


def test_a_holder_whose_heartbeat_stalled_past_the_ttl_does_not_write_its_lock_over_its_successors(objects):
    """A's heartbeat read its lock (its own) and the answer arrived only after A's lock went stale
    and B took it over: A must not write its lock back over B's. A knows it lost the lock; B holds it."""
    a = WriterLock(objects, what="build", ttl_s=TTL_S).acquire()
    b = WriterLock(objects, what="watch", ttl_s=TTL_S)  # takes over a lock with no heartbeat for TTL_S
    try:
        objects.stalled.clear()
        resume = objects.stall("get", "shardgen-writer-lock")  # A's heartbeat thread (B has none yet)
        assert objects.stalled.wait(BOUND_S)
        take_when_stale(b)
        resume.set()
        deadline = time.monotonic() + BOUND_S
        while a.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.lost is not None, "the stalled holder still believes it holds the lock"
        with pytest.raises(LockError):
            a.check()
        time.sleep(TTL_S / 2)  # three of A's heartbeat periods: it writes nothing more
        assert token_on_the_store(objects) == b.token
        b.check()
    finally:
        a.release(), b.release()


def test_a_holder_that_finds_another_writers_lock_writes_nothing_more(objects):
    """Another writer's lock over ours (a writer taken for the holder by a race, or an operator):
    the heartbeat finds it within a period or two, counts the lock lost and never writes ours back."""
    a = WriterLock(objects, what="build", ttl_s=TTL_S).acquire()
    try:
        other = json.dumps({"token": "elsewhere-1-00000000", "host": "elsewhere", "pid": 1, "what": "watch"})
        for _ in range(50):  # the heartbeat's first refresh, at once after acquire(), may land over it: again
            objects.put(WRITER_LOCK, other.encode())
            time.sleep(0.2)
            if objects.get(WRITER_LOCK) == other.encode():
                break
        deadline = time.monotonic() + BOUND_S
        while a.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.lost is not None and "another writer" in a.lost
        time.sleep(TTL_S / 2)  # three heartbeat periods
        assert token_on_the_store(objects) == "elsewhere-1-00000000"
    finally:
        a.release()
    assert token_on_the_store(objects) == "elsewhere-1-00000000"  # release deletes only its own


HOLDER = """
import sys, time
from shardgen.errors import LockError
from shardgen.store import open_store

lock = open_store(sys.argv[1]).writer_lock("build", ttl_s=float(sys.argv[2])).acquire()
print("held", lock.token, flush=True)
while True:
    try:
        lock.check()
    except LockError as exc:
        print("lost", exc, flush=True)
        break
    time.sleep(0.05)
lock.release()
"""


def test_a_holder_process_stopped_past_the_ttl_gives_the_lock_up_when_it_continues(objects, tmp_path):
    """A real holder process (heartbeat thread, and a main loop that checks the lock as a writer
    does before each publish) is stopped with SIGSTOP; past the TTL B takes the lock over. On
    SIGCONT the holder says it lost the lock and exits, and the lock stays B's."""
    env = {**os.environ, **FakeServer(tmp_path / "objects").env(),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "fake://data/store", str(TTL_S)], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    b = WriterLock(FakeObjects("fake://data/store"), what="watch", ttl_s=TTL_S)
    try:
        said = holder.stdout.readline().split()
        assert said[0] == "held", said
        os.kill(holder.pid, signal.SIGSTOP)
        take_when_stale(b)
        os.kill(holder.pid, signal.SIGCONT)
        out, _ = holder.communicate(timeout=BOUND_S)
        assert holder.returncode == 0 and out.startswith("lost"), out
        # Without conditional writes one interleaving cannot be prevented: the holder stopped between its
        # heartbeat's read and its write, whose bytes land over b's on SIGCONT (and its release then deletes
        # them). b must then know it lost the lock: never two writers that both pass check().
        if objects.get(WRITER_LOCK) is not None and token_on_the_store(objects) == b.token:
            b.check()
        else:
            with pytest.raises(LockError):
                b.check()
    finally:
        b.release()
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


def test_the_pause_is_long_enough_for_these_tests():
    assert SETTLE_S >= 0.5

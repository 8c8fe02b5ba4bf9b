"""The writer locks: who may publish into a store, for how long.

On an object store (``S3Store.writer_lock``), ``build``, ``watch`` and ``gc`` hold the store's
``WriterLock`` (``.writer.lock``, an object naming its owner, refreshed every ``ttl/6``; older than
the TTL by the store's clock it is stale and taken over). Object stores without conditional writes
cannot make taking it atomic: two writers starting within the same second could both take it.
Each writer reads the lock back after a pause and again before every publish, and stops when it
finds another owner. A judgement is only as fresh as the read it rests on: a writer whose read of
the lock took past half the pause (a stalled request or process) reads again before it writes,
and one whose write landed that late takes nothing. A holder that confirmed its lock no later than
half the TTL ago refreshes it; past that (its process or heartbeat stalled: SIGSTOP, swap, a hung
request) a successor may own it by now, so it writes nothing more and counts itself lost.

On a store folder (``FolderStore.writer_lock``) the same writers hold ``FolderWriterLock``: a kernel
``flock`` on ``<store>/.writer.lock`` for the writer's lifetime (released by the kernel when it
dies, so there is nothing stale to take over), the holder's what/host/pid written in it. A second
writer is refused at once with a LockError naming the holder. Each publish also holds the manifest
lock (``.manifest.lock``) for its few milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Protocol

from shardgen.errors import LockError
from shardgen.fsutil import HOST_TOKEN
from shardgen.store.lock import StoreLock
from shardgen.store.naming import CLOCK_NAME, LEASE_DIR
from shardgen.store.objstore import ObjectStore, ObjectStoreError

__all__ = ["WRITER_LOCK", "WriterLockLike", "WriterLock", "FolderWriterLock"]

log = logging.getLogger(__name__)
WRITER_LOCK = ".writer.lock"
SETTLE_S = 1.0  # a new lock is read back after this: the later of two racing writers wins
READS = 5  # reads of the lock a writer makes before it gives up on a store too slow to judge by
# A writer that finds the lock free at time t and whose own write lands before t + SETTLE_S is seen by any
# other writer's read-back (that one wrote after t and reads back SETTLE_S after its write): a write returning
# later than LATE_S after the read began may have landed over a lock already read back. The margin covers the
# other writer's pause ending early; half the pause refused builds on a loaded machine with no other writer.
LATE_S = 0.8 * SETTLE_S


class WriterLockLike(Protocol):
    """What a store's ``writer_lock`` returns (``WriterLock`` or ``FolderWriterLock``)."""

    what: str

    @property
    def lost(self) -> Optional[str]: ...

    def acquire(self) -> WriterLockLike: ...

    def check(self) -> None: ...

    def release(self) -> None: ...

    def __enter__(self) -> WriterLockLike: ...

    def __exit__(self, *exc: object) -> None: ...


class FolderWriterLock(StoreLock):
    """The one writer of a store folder (see the module docstring): ``flock`` on ``.writer.lock``."""

    lost: Optional[str] = None  # a kernel lock is held until released or the holder dies

    def __init__(self, folder: Path, *, what: str):
        super().__init__(Path(folder) / WRITER_LOCK, timeout=0, what=what)
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "what": what}

    def note(self) -> str:
        return json.dumps(self.info) + "\n"

    def refusal(self) -> str:
        for _ in range(20):  # the holder writes who it is just after it took the lock: a moment to read it
            try:
                holder = json.loads(self.holder())
                break
            except ValueError:
                holder = {}
                time.sleep(0.025)
        holder = holder if isinstance(holder, dict) else {}
        return (f"{self.path}: {self.what} refused: the store has another writer ({holder.get('what', 'unknown')} "
                f"on {holder.get('host', '?')}, pid {holder.get('pid', '?')}); one writer per store: wait for it "
                "to finish, or stop it")

    def check(self) -> None:
        """Held until released (the kernel keeps it)."""

    def acquire(self) -> FolderWriterLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)  # a new store's folder, as staging makes it
        super().acquire()
        return self

    def __enter__(self) -> FolderWriterLock:
        return self.acquire()


class WriterLock:
    """The one writer of a store on an object store (see the module docstring)."""

    def __init__(self, objects: ObjectStore, *, what: str, ttl_s: float = 60.0):
        self.objects, self.what, self.ttl_s = objects, what, float(ttl_s)
        self.token = f"{HOST_TOKEN}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "what": what}
        self._stop = threading.Event()
        self._lost: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._confirmed = 0.0  # time.monotonic() before the last write of our lock known to be ours

    def _holder(self) -> tuple[Optional[dict], Optional[float]]:
        found = self.objects.get_with_info(WRITER_LOCK)
        if found is None:
            return None, None
        data, info = found
        try:
            holder = json.loads(data) if data else {}
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), info.mtime

    def _judge(self) -> float:
        """When (``time.monotonic()``) the read that found the lock free or stale began; LockError
        while another writer holds it. A read slower than half the pause is made again."""
        for _ in range(READS):
            began = time.monotonic()
            holder, mtime = self._holder()
            if holder is not None and holder.get("token") != self.token:
                age = self.objects.clock(f"{LEASE_DIR}/{CLOCK_NAME}") - mtime
                if age <= self.ttl_s:
                    raise LockError(self._refusal(holder, age))
                if time.monotonic() - began <= SETTLE_S / 2:
                    log.warning("%s: taking over a stale writer lock of %s pid %s (no heartbeat for %.0fs)",
                                self.objects.where(WRITER_LOCK), holder.get("host"), holder.get("pid"), age)
            if time.monotonic() - began <= SETTLE_S / 2:
                return began
        raise LockError(f"{self.objects.where(WRITER_LOCK)}: {self.what} refused: {READS} reads of the lock each "
                        f"took over {SETTLE_S / 2:g}s, too slow to take it safely")

    def acquire(self) -> WriterLock:
        began = self._judge()
        self.objects.put(WRITER_LOCK, json.dumps(self.info).encode())
        if time.monotonic() - began > LATE_S:  # it may have landed over a writer that read its own back
            raise LockError(f"{self.objects.where(WRITER_LOCK)}: {self.what} refused: reading and writing the lock "
                            f"took over {LATE_S:g}s, too late to know that no other writer took it meanwhile")
        time.sleep(SETTLE_S)
        holder, _ = self._holder()
        if holder is None or holder.get("token") != self.token:
            raise LockError(self._refusal(holder or {}, None) + " (it took the lock at the same time as us)")
        self._confirmed = began
        self._thread = threading.Thread(target=self._beat, name="shardgen-writer-lock", daemon=True)
        self._thread.start()
        return self

    def _refusal(self, holder: dict, age: Optional[float]) -> str:
        beat = f", heartbeat {age:.0f}s ago" if age is not None else ""
        return (f"{self.objects.where(WRITER_LOCK)}: {self.what} refused: the store has another writer "
                f"({holder.get('what', 'unknown')} on {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
                f"{beat}); one writer per store")

    def _stalled(self) -> Optional[str]:
        """Why our lock may be a successor's by now: not confirmed for over half the TTL."""
        since = time.monotonic() - self._confirmed
        if since <= self.ttl_s / 2:
            return None
        return (f"{self.objects.where(WRITER_LOCK)}: {self.what} lost the writer lock: not refreshed for {since:.1f}s "
                f"(over half its TTL of {self.ttl_s:g}s: stalled), another writer may hold it now")

    def _beat(self) -> None:
        period = 0.0  # the first refresh at once: the read-back's pause aged the lock by SETTLE_S
        while not self._stop.wait(period):
            period = self.ttl_s / 6
            try:
                began = time.monotonic()
                holder, _ = self._holder()
                stalled = self._stalled()  # after the read too: the read itself may have stalled
                if stalled is not None or holder is None or holder.get("token") != self.token:
                    self._lost = stalled or self._refusal(holder or {}, None)
                    log.error("%s: lost the writer lock; this process publishes nothing more",
                              self.objects.where(WRITER_LOCK))
                    return
                self.objects.put(WRITER_LOCK, json.dumps(self.info).encode(), verify=False)
                self._confirmed = began
            except ObjectStoreError as exc:
                log.warning("%s: cannot refresh the writer lock (%s)", self.objects.where(WRITER_LOCK), exc)

    @property
    def lost(self) -> Optional[str]:
        """Why this writer lost the lock (None while it holds it, as far as it knows)."""
        return self._lost

    def check(self) -> None:
        """LockError unless we still hold the lock (read from the store)."""
        if self._lost is None:
            holder, _ = self._holder()
            if holder is None or holder.get("token") != self.token:
                self._lost = self._refusal(holder or {}, None)
            else:
                self._lost = self._stalled()
        if self._lost is not None:
            raise LockError(self._lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with contextlib.suppress(ObjectStoreError):
            holder, _ = self._holder()
            if holder is not None and holder.get("token") == self.token:
                self.objects.delete(WRITER_LOCK)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

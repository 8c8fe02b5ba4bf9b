"""A store on an object store (``[store] dir = "s3://bucket/prefix"``): the store side.

The object names are the store's file names (:mod:`shardgen.store.naming`), so a store folder copied to
a bucket is a store, and back. Shards are written in a local staging folder (the config's
``store.staging``), uploaded by the worker that made them (``.rec``, ``.idx``, then the sidecar,
each checked after upload), and removed locally. The coordinating process publishes: the
generation snapshot first, then ``manifest.json``, both checked after upload, so a reader never
sees a manifest naming an object that is not whole.

One writer: ``build``, ``watch`` and ``gc`` hold the store's writer lock (``.writer.lock``, an
object naming its owner, refreshed every ``ttl/6``; older than the TTL by the store's clock it is
stale and taken over). Object stores without conditional writes cannot make taking it atomic:
two writers starting within the same second could both take it. Each writer reads the lock back
after a pause and again before every publish, and stops when it finds another owner.

Leases (``leases/*.json``) and the store clock (``leases/.clock``) work as on a filesystem, with
the object's Last-Modified as its heartbeat, judged by the store's clock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from shardgen.clock import utc_datetime, utc_now
from shardgen.errors import LockError, ManifestError, ShardError
from shardgen.format.schema import Schema
from shardgen.fsutil import HOST_TOKEN
from shardgen.store.gc import entry_files, kept_snapshots, sweep
from shardgen.store.lease import judge_lease
from shardgen.store.manifest import Manifest, ShardEntry, Sidecar
from shardgen.store.naming import CLOCK_NAME, LEASE_DIR, MANIFEST_NAME, SNAPSHOT_DIR, WATCH_STATE, name_version
from shardgen.store.objstore import ObjectStore, ObjectStoreError
from shardgen.store.publish import apply_entries, check_schema, log_retired

__all__ = ["WRITER_LOCK", "WriterLock", "load_manifest", "open_manifest", "publish", "upload_shard",
           "complete_shard", "next_version", "live_lease_generations", "collect", "verify_store", "snapshot_numbers",
           "load_generation", "status", "put_state", "get_state"]

log = logging.getLogger(__name__)
WRITER_LOCK = ".writer.lock"
SETTLE_S = 1.0  # a new lock is read back after this: the later of two racing writers wins


def _snapshot_name(n: int) -> str:
    return f"{SNAPSHOT_DIR}/{int(n)}.json"


def load_manifest(remote: ObjectStore, name: str = MANIFEST_NAME) -> Optional[Manifest]:
    data = remote.get(name)
    return None if data is None else Manifest.parse(data, remote.where(name))


def _no_manifest(remote: ObjectStore) -> ManifestError:
    return ManifestError(f"{remote.where(MANIFEST_NAME)}: no manifest (run `shardgen build` first)")


def load_generation(remote: ObjectStore, generation: int) -> Manifest:
    """Generation ``generation`` exactly (its snapshot, or the manifest if it is that one)."""
    found = load_manifest(remote, _snapshot_name(generation))
    if found is None:
        found = load_manifest(remote)
        if found is None:
            raise _no_manifest(remote)
        if found.generation != generation:
            raise ManifestError(f"{remote.where(_snapshot_name(generation))}: generation {generation} is gone "
                                f"(its snapshot was garbage-collected); the newest is {found.generation}")
    if found.generation != generation:
        raise ManifestError(f"{remote.where(_snapshot_name(generation))}: holds generation {found.generation}, "
                            f"expected {generation}")
    return found


def open_manifest(remote: ObjectStore, schema: Schema, window: int) -> Manifest:
    found = load_manifest(remote)
    if found is None:
        return Manifest(schema=schema, window=window)
    return check_schema(found, schema, remote.where(MANIFEST_NAME))


def snapshot_numbers(remote: ObjectStore) -> list[int]:
    numbers = []
    for name in remote.list(SNAPSHOT_DIR + "/"):
        stem = name[len(SNAPSHOT_DIR) + 1:]
        if stem.endswith(".json") and stem[:-5].isdigit():
            numbers.append(int(stem[:-5]))
    return sorted(numbers)


def _save(remote: ObjectStore, manifest: Manifest, lock: WriterLock) -> Manifest:
    """Publish ``manifest`` as the next generation: snapshot, then ``manifest.json`` last."""
    number = max([manifest.generation, *snapshot_numbers(remote)]) + 1
    new = replace(manifest, generation=number, updated=utc_now())
    text = new.dumps()
    lock.check()
    remote.put(_snapshot_name(number), text)
    lock.check()
    remote.put(MANIFEST_NAME, text)
    return new


def publish(remote: ObjectStore, lock: WriterLock, schema: Schema, window: int,
            entries: Iterable[ShardEntry]) -> Optional[Manifest]:
    """``shardgen.store.publish.publish`` on an object store (the writer lock held)."""
    old = open_manifest(remote, schema, window)
    new = apply_entries(old, entries, window, generation=max([old.generation, *snapshot_numbers(remote)]) + 1)
    if new is None:
        return None
    saved = _save(remote, new, lock)
    log_retired(saved)
    return saved


# -- shards ---------------------------------------------------------------------------------------

def upload_shard(remote: ObjectStore, staging: Path, sidecar: Sidecar, sidecar_name: str) -> None:
    """Upload a shard written in ``staging`` (``.rec``, ``.idx``, then the sidecar: its presence
    marks the shard complete, as on disk), then remove the local files."""
    staging = Path(staging)
    names = [sidecar.rec, sidecar.idx] if sidecar.records else []
    for name in names:
        remote.upload(name, staging / name)
    remote.upload(sidecar_name, staging / sidecar_name)
    for name in [*names, sidecar_name]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging / name)


def complete_shard(remote: ObjectStore, date: dt.date, fingerprint: str) -> Optional[Sidecar]:
    """The date's sidecar if a complete shard (or empty marker) of this schema is in the store."""
    name = f"{date.isoformat()}.json"
    data = remote.get(name)
    if data is None:
        return None
    try:
        sidecar = Sidecar.parse(data, remote.where(name))
    except ShardError as exc:
        log.info("%s: %s; rebuilding", date, exc)
        return None
    if sidecar.fingerprint != fingerprint:
        return None
    if sidecar.records == 0:
        return sidecar
    for obj, size in ((sidecar.rec, sidecar.bytes), (sidecar.idx, sidecar.idx_bytes)):
        info = remote.head(obj)
        if info is None or info.size != size:
            log.info("%s: shard in the store not usable (%s %s); rebuilding", date, obj,
                     "is missing" if info is None else f"has {info.size} bytes, expected {size}")
            return None
    return sidecar


def next_version(remote: ObjectStore, date: dt.date) -> int:
    """A version of ``date``'s files that no object, manifest entry or retired entry uses."""
    day = date.isoformat()
    names = list(remote.list(day + "."))
    with contextlib.suppress(ManifestError):
        m = load_manifest(remote)
        if m is not None:
            names += [e.rec for e in (*m.shards, *m.retired) if e.date == day]
    return max((name_version(n) for n in names), default=0) + 1


# -- the writer lock --------------------------------------------------------------------------------

class WriterLock:
    """The one writer of a store on an object store (see the module docstring)."""

    def __init__(self, remote: ObjectStore, *, what: str, ttl_s: float = 60.0):
        self.remote, self.what, self.ttl_s = remote, what, float(ttl_s)
        self.token = f"{HOST_TOKEN}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "what": what}
        self._stop = threading.Event()
        self._lost: Optional[str] = None
        self._thread: Optional[threading.Thread] = None

    def _holder(self) -> tuple[Optional[dict], Optional[float]]:
        found = self.remote.get_with_info(WRITER_LOCK)
        if found is None:
            return None, None
        data, info = found
        try:
            holder = json.loads(data) if data else {}
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), info.mtime

    def acquire(self) -> WriterLock:
        holder, mtime = self._holder()
        if holder is not None and holder.get("token") != self.token:
            age = self.remote.clock(f"{LEASE_DIR}/{CLOCK_NAME}") - mtime
            if age <= self.ttl_s:
                raise LockError(self._refusal(holder, age))
            log.warning("%s: taking over a stale writer lock of %s pid %s (no heartbeat for %.0fs)",
                        self.remote.where(WRITER_LOCK), holder.get("host"), holder.get("pid"), age)
        self.remote.put(WRITER_LOCK, json.dumps(self.info).encode())
        time.sleep(SETTLE_S)
        holder, _ = self._holder()
        if holder is None or holder.get("token") != self.token:
            raise LockError(self._refusal(holder or {}, None) + " (it took the lock at the same time as us)")
        self._thread = threading.Thread(target=self._beat, name="shardgen-writer-lock", daemon=True)
        self._thread.start()
        return self

    def _refusal(self, holder: dict, age: Optional[float]) -> str:
        beat = f", heartbeat {age:.0f}s ago" if age is not None else ""
        return (f"{self.remote.where(WRITER_LOCK)}: {self.what} refused: the store has another writer "
                f"({holder.get('what', 'unknown')} on {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
                f"{beat}); one writer per store")

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 6):
            try:
                holder, _ = self._holder()
                if holder is None or holder.get("token") != self.token:
                    self._lost = self._refusal(holder or {}, None)
                    log.error("%s: lost the writer lock; this process publishes nothing more",
                              self.remote.where(WRITER_LOCK))
                    return
                self.remote.put(WRITER_LOCK, json.dumps(self.info).encode(), verify=False)
            except ObjectStoreError as exc:
                log.warning("%s: cannot refresh the writer lock (%s)", self.remote.where(WRITER_LOCK), exc)

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
                self.remote.delete(WRITER_LOCK)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- leases and garbage collection ------------------------------------------------------------------

def live_lease_generations(remote: ObjectStore, ttl_s: float, *, remove_dead: bool = True) -> list[int]:
    """Generations named by live leases (heartbeat within ``ttl_s`` by the store's clock)."""
    now = remote.clock(f"{LEASE_DIR}/{CLOCK_NAME}")
    live = []
    for name, info in remote.list(LEASE_DIR + "/").items():
        if not name.endswith(".json"):
            continue
        text = remote.get(name)
        if text is None:  # released meanwhile
            continue
        generation, dead = judge_lease(remote.where(name), now - info.mtime, text, ttl_s)
        if generation is not None:
            live.append(generation)
        elif dead and remove_dead:
            remote.delete(name)
    return live


def collect(remote: ObjectStore, lock: WriterLock, *, grace_s: float, lease_ttl_s: float,
            now: Optional[dt.datetime] = None) -> list[str]:
    """``shardgen.store.gc.collect`` on an object store (the writer lock held)."""
    manifest = load_manifest(remote)
    if manifest is None:
        return []
    now = now or utc_datetime()
    live = live_lease_generations(remote, lease_ttl_s)
    load = functools.lru_cache(None)(lambda n: load_generation(remote, n))
    kept, old_snapshots = kept_snapshots(snapshot_numbers(remote), manifest, live, grace_s, now, load)
    gone, kept_entries = sweep(manifest, kept, live, grace_s, now, load)
    if gone:  # the manifest stops listing them before they go: no reader is sent to a deleted object
        _save(remote, replace(manifest, retired=tuple(kept_entries)), lock)
    for entry in gone:
        lock.check()
        for name in entry_files(entry):
            remote.delete(name)
        log.info("deleted retired shard %s (%s)", entry.date, entry.rec)
    for n in old_snapshots:
        remote.delete(_snapshot_name(n))
        log.info("removed snapshot of generation %d", n)
    return [entry.date for entry in gone]


# -- verify, status, watcher state ------------------------------------------------------------------

def verify_store(remote: ObjectStore) -> tuple[Manifest, list[tuple[str, str]]]:
    """``shardgen verify`` on an object store: every published shard is downloaded into a
    temporary folder and checked there as on disk."""
    from shardgen.store.verify import verify_store as verify_folder

    manifest = load_manifest(remote)
    if manifest is None:
        raise _no_manifest(remote)
    with tempfile.TemporaryDirectory(prefix="shardgen-verify-") as tmp:
        folder = Path(tmp)
        (folder / MANIFEST_NAME).write_bytes(manifest.dumps())
        (folder / SNAPSHOT_DIR).mkdir()
        problems: list[tuple[str, str]] = []
        names = set()
        for n in snapshot_numbers(remote):
            data = remote.get(_snapshot_name(n))
            if data is not None:
                (folder / _snapshot_name(n)).write_bytes(data)
                with contextlib.suppress(ManifestError):
                    names |= Manifest.parse(data, remote.where(_snapshot_name(n))).files()
        names |= manifest.files()
        for name in sorted(names):
            try:
                remote.download(name, folder / name)
            except ObjectStoreError as exc:  # missing: verify_folder names the date too
                problems.append(("-", str(exc)))
        _, found = verify_folder(folder)
        for date, problem in found:
            problems.append((date, problem.replace(str(folder), remote.url)))
    return manifest, problems


def status(remote: ObjectStore) -> dict:
    """``shardgen.store.status.status`` of a store on an object store."""
    from shardgen.store.status import summary

    data = remote.get(MANIFEST_NAME)
    if data is None:
        raise _no_manifest(remote)
    manifest = Manifest.parse(data, remote.where(MANIFEST_NAME))
    return summary(manifest, remote.where(MANIFEST_NAME), json.loads(data).get("format"), snapshot_numbers(remote))


def put_state(remote: ObjectStore, data: bytes) -> None:
    remote.put(WATCH_STATE, data, verify=False)


def get_state(remote: ObjectStore) -> Optional[bytes]:
    return remote.get(WATCH_STATE)

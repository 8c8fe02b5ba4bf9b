"""The store interface: the same operations over a store folder (``FolderStore``) and over an
S3 bucket/prefix (``S3Store``), chosen once from a location by :func:`shardgen.store.open_store`.

An implementation gives the primitives: reading, writing and deleting one file by its name in the
store (:mod:`shardgen.store.naming`), listing what is there, the locks, lease heartbeats, the store's
clock, and moving a finished shard from the local staging folder into the store. This class builds
the rest on them once: the manifest and its generation snapshots, the sidecar checks, the version
of a rewrite, the watcher's state. What ``build``, ``watch``, ``gc``, ``verify`` and ``status`` do
is written once against this interface (``publish``, ``gc``, ``verify``, ``status``, ``produce``,
``watch``): no caller asks which kind of store it has.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import re
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import ContextManager, Iterable, Optional

from shardgen.clock import utc_now
from shardgen.errors import ConfigError, ManifestError
from shardgen.format.schema import Schema, schema_changes
from shardgen.store.lease_file import Heartbeat
from shardgen.store.lock import StoreLock
from shardgen.store.manifest import Manifest
from shardgen.store.naming import (
    MANIFEST_NAME,
    WATCH_LOCK,
    WATCH_STATE,
    name_version,
    sidecar_name,
    snapshot_name,
)
from shardgen.store.reading import ReadInPlace
from shardgen.store.sidecar import Sidecar
from shardgen.store.writer_lock import WriterLockLike

__all__ = ["Store", "check_schema"]

log = logging.getLogger(__name__)
_SHARD_FILE = re.compile(r"^(?P<stem>\d{4}-\d{2}-\d{2}(?:\.v\d+)?)\.(?:rec|idx)$")  # naming.shard_paths


def check_schema(manifest: Manifest, schema: Schema, where: str) -> Manifest:
    """``manifest`` if it holds ``schema``; ConfigError otherwise."""
    if manifest.schema.fingerprint != schema.fingerprint:
        changes = "; ".join(schema_changes(manifest.schema, schema))
        old, keep = manifest.schema.layout, ""
        if old.kind == schema.layout.kind == "runs" and replace(manifest.schema, layout=schema.layout) == schema:
            keep = (f", or set store.pack = {old.pack} and store.run_rows = {old.run_rows} under [store] to go on "
                    "writing this one (layout 'runs' packs 512 windows a record by default since 2026-12, 64 before)")
        raise ConfigError(
            f"{where}: the store holds another schema than the config gives ({changes}; fingerprint "
            f"{manifest.schema.fingerprint} -> {schema.fingerprint}); use a new store.dir for a new schema{keep}")
    return manifest


class Store(ReadInPlace, ABC):
    """A store: shard files, ``manifest.json``, snapshots, leases and locks, by their names.

    ``staging`` is the local folder this process writes shard files in before ``put_shard`` (a
    store folder: the store itself)."""

    staging: Path

    # -- primitives ------------------------------------------------------------------------------

    @abstractmethod
    def where(self, name: str = "") -> str:
        """The store, or its file ``name``, as messages name it (a path or a URL)."""

    @abstractmethod
    def read(self, name: str) -> Optional[bytes]:
        """The bytes of ``name``, or None if there is no such file."""

    @abstractmethod
    def read_with_mtime(self, name: str) -> Optional[tuple[bytes, float]]:
        """The bytes of ``name`` and when it was last written by the store's clock (its mtime, an
        object's Last-Modified), or None if there is no such file."""

    @abstractmethod
    def write(self, name: str, data: bytes, *, durable: bool = True) -> None:
        """Replace ``name`` whole (never half written); ``durable=False``: no fsync, no check after upload."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` (gone already is fine)."""

    @abstractmethod
    def size(self, name: str) -> Optional[int]:
        """The size of ``name`` in bytes, or None if it is not there."""

    @abstractmethod
    def snapshot_generations(self) -> list[int]:
        """The generations whose snapshot is in the store, ascending."""

    @abstractmethod
    def date_file_names(self, date: dt.date) -> list[str]:
        """The names of the files of every version of a date's shard."""

    @abstractmethod
    def dated_sidecars(self) -> list[tuple[dt.date, str, tuple]]:
        """``(date, name, version)`` of every version-1 sidecar in the store, by date; ``version``
        (where, mtime, size) changes when the file does."""

    @abstractmethod
    def check(self) -> None:
        """Raise a clear error unless the store can be reached."""

    @abstractmethod
    def writer_lock(self, what: str, *, ttl_s: float = 60.0) -> WriterLockLike:
        """The lock a writer (``what``: build, watch, gc, publish) holds while it writes the store."""

    @abstractmethod
    def publishing(self) -> ContextManager:
        """Held while one new generation is read, changed and published."""

    @abstractmethod
    def clock(self) -> float:
        """"Now" by the store's own clock (lease ages are measured with it)."""

    @abstractmethod
    def live_generations(self, ttl_s: float, *, now: Optional[float] = None, remove_dead: bool = True) -> list[int]:
        """Generations named by live reader leases (``now`` by the store's clock); dead leases are removed."""

    @abstractmethod
    def lease_names(self) -> list[str]:
        """The names (in ``LEASE_DIR``) of the reader leases in the store."""

    @abstractmethod
    def heartbeat(self, name: str) -> Heartbeat:
        """How the reader lease ``name`` is written and kept fresh in this store."""

    @abstractmethod
    def stage(self) -> Path:
        """The local folder a worker writes a shard's files in (created if need be)."""

    @abstractmethod
    def put_shard(self, sidecar: Sidecar, name: str) -> Sidecar:
        """Move a shard written in ``stage()`` (sidecar ``name``) into the store, the sidecar last, never
        over a file there; returns the sidecar published (another version's, if this one's was taken)."""

    @abstractmethod
    def discard_staged(self, date: dt.date) -> None:
        """Remove local copies of a date's shard that a killed run left in staging."""

    @abstractmethod
    def local_files(self, names: Iterable[str]) -> ContextManager[Path]:
        """A local folder holding the files ``names`` as the store has them (one missing in the
        store is missing there); paths in messages under it are replaced by ``where()``."""

    # -- the manifest and its snapshots ----------------------------------------------------------

    def manifest_bytes(self, name: str = MANIFEST_NAME) -> Optional[bytes]:
        """The bytes of a manifest or snapshot, or None; ManifestError if it cannot be read."""
        try:
            return self.read(name)
        except OSError as exc:
            raise ManifestError(f"{self.where(name)}: cannot read ({exc.strerror})") from None

    def load_manifest(self, name: str = MANIFEST_NAME) -> Optional[Manifest]:
        """The manifest (or the snapshot ``name``), or None if there is none."""
        data = self.manifest_bytes(name)
        return None if data is None else Manifest.parse(data, self.where(name))

    def no_manifest(self) -> ManifestError:
        return ManifestError(f"{self.where(MANIFEST_NAME)}: no manifest (run `shardgen build` first)")

    def require_manifest(self) -> Manifest:
        """The manifest; ManifestError if there is none."""
        found = self.load_manifest()
        if found is None:
            raise self.no_manifest()
        return found

    def open_manifest(self, schema: Schema, window: int) -> Manifest:
        """The manifest, or an empty generation-0 one; ConfigError if the schema differs."""
        found = self.load_manifest()
        if found is None:
            return Manifest(schema=schema, window=window)
        return check_schema(found, schema, self.where(MANIFEST_NAME))

    def load_generation(self, generation: int) -> Manifest:
        """Generation ``generation`` exactly: its snapshot, or the manifest if it is that one (a
        ``shardgen/1`` store has no snapshots). ManifestError when it is gone."""
        where = self.where(snapshot_name(generation))
        found = self.load_manifest(snapshot_name(generation))
        if found is None:
            found = self.require_manifest()
            if found.generation != generation:
                raise ManifestError(
                    f"{where}: generation {generation} is gone (its snapshot was garbage-collected, or the "
                    f"store predates snapshots); the newest is {found.generation}")
        if found.generation != generation:
            raise ManifestError(f"{where}: holds generation {found.generation}, expected {generation}")
        return found

    def next_generation(self, manifest: Manifest) -> int:
        """The number the next publish of ``manifest`` gets: never one a snapshot already used."""
        return max([manifest.generation, *self.snapshot_generations()]) + 1

    def save(self, manifest: Manifest, lock: WriterLockLike) -> Manifest:
        """Publish ``manifest`` as the next generation: its snapshot first, then ``manifest.json``,
        each whole; returns what was written. The caller holds ``publishing()`` and ``lock``."""
        number = self.next_generation(manifest)
        new = replace(manifest, generation=number, updated=utc_now())
        text = new.dumps()
        lock.check()
        self.write(snapshot_name(number), text)
        lock.check()
        self.write(MANIFEST_NAME, text)
        return new

    # -- shards ----------------------------------------------------------------------------------

    def read_sidecar(self, name: str) -> Optional[Sidecar]:
        """The sidecar ``name``, or None if there is none; ShardError if it is malformed."""
        data = self.read(name)
        return None if data is None else Sidecar.parse(data, self.where(name))

    def sidecar_problem(self, sidecar: Sidecar, fingerprint: str) -> Optional[str]:
        """Why a shard described by its sidecar is not usable, or None if sizes and schema match."""
        if sidecar.fingerprint != fingerprint:
            return f"schema fingerprint {sidecar.fingerprint}, expected {fingerprint}"
        for name, size in ((sidecar.rec, sidecar.bytes), (sidecar.idx, sidecar.idx_bytes)):
            actual = self.size(name)
            if actual is None:
                return f"{name} is missing"
            if actual != size:
                return f"{name} has {actual} bytes, expected {size}"
        return None

    def complete_shard(self, date: dt.date, fingerprint: str) -> Optional[Sidecar]:
        """The date's sidecar if a complete shard (or empty marker) of this schema is in the store."""
        sidecar = self.read_sidecar(sidecar_name(date))
        if sidecar is None:
            return None
        if sidecar.records == 0:
            return sidecar if sidecar.fingerprint == fingerprint else None
        problem = self.sidecar_problem(sidecar, fingerprint)
        if problem:
            log.info("%s: shard in the store not usable (%s); rebuilding", date, problem)
            return None
        return sidecar

    def discard_incomplete(self, manifest: Manifest, *, min_age_s: float) -> list[str]:
        """Remove the shard files (``.rec``, ``.idx``) in staging that have no sidecar, that the
        manifest does not list, and that were last written at least ``min_age_s`` ago (by this
        host's clock): what a killed run left half written. Younger ones may be another producer's
        shard whose sidecar is still to come (the watcher adopts those). The holder of the writer
        lock calls it before its workers start. Returns their names."""
        listed = {n for e in (*manifest.shards, *manifest.retired) for n in (e.rec, e.idx)}
        removed, now = [], time.time()
        for path in sorted(Path(self.staging).glob("????-??-??*.*")):
            m = _SHARD_FILE.match(path.name)
            if not m or path.name in listed or path.with_name(m["stem"] + ".json").exists():
                continue
            try:
                if now - path.stat().st_mtime < min_age_s:
                    continue
            except FileNotFoundError:
                continue
            path.unlink(missing_ok=True)
            removed.append(path.name)
        return removed

    def next_version(self, date: dt.date) -> int:
        """A version of ``date``'s shard files that no file in the store, manifest entry or retired
        entry uses: a rewrite never touches a published file."""
        day, names = date.isoformat(), self.date_file_names(date)
        with contextlib.suppress(ManifestError):
            m = self.load_manifest()
            if m is not None:
                names += [e.rec for e in (*m.shards, *m.retired) if e.date == day]
        return max((name_version(n) for n in names), default=0) + 1

    # -- the watcher -----------------------------------------------------------------------------

    def watch_lock(self) -> StoreLock:
        """The lock the one watcher of this staging folder holds for its lifetime (``flock``)."""
        return StoreLock(self.staging / WATCH_LOCK, timeout=0, what="watch")

    def get_state(self) -> Optional[bytes]:
        """The bytes of the watcher's state file, or None."""
        return self.read(WATCH_STATE)

    def put_state(self, data: bytes) -> None:
        self.write(WATCH_STATE, data, durable=False)

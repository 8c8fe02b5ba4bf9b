"""A store on an S3-compatible object store (``s3://bucket/prefix``), over ``objstore.ObjectStore``.

The object names are the store's file names (:mod:`shardgen.store.naming`), so a store folder copied
to a bucket is a store, and back. Shards are written in a local staging folder (the config's
``store.staging``), uploaded by the worker that made them (``.rec``, ``.idx``, then the sidecar,
each checked after upload), and removed locally. The coordinating process publishes: the
generation snapshot first, then ``manifest.json``, both checked after upload, so a reader never
sees a manifest naming an object that is not whole. One writer at a time holds the store's
``WriterLock`` (:mod:`shardgen.store.writer_lock`), checked again before every publish.

Leases (``leases/*.json``) and the store clock (``leases/.clock``) work as on a filesystem, with
the object's Last-Modified as its heartbeat, judged by the store's clock.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import ContextManager, Iterable, Iterator, Optional

from shardgen.fsutil import atomic_write, make_dirs, remove_empty_dirs
from shardgen.store.base import Store
from shardgen.store.lease_file import ObjectHeartbeat, judge_lease
from shardgen.store.naming import CLOCK_NAME, LEASE_DIR, SNAPSHOT_DIR, shard_paths
from shardgen.store.objstore import ObjectMismatch, ObjectStore
from shardgen.store.objurl import default_staging
from shardgen.store.sidecar import Sidecar
from shardgen.store.writer_lock import WriterLock

__all__ = ["S3Store"]

log = logging.getLogger(__name__)

_MADE: list = []  # staging folders this process created: removed when it exits, if they are empty


class S3Store(Store):
    """The store ``url`` (``s3://bucket/prefix``), or the one an ``ObjectStore`` holds; shard files
    are written in ``staging`` (default: ``./.shardgen-staging/<bucket>/<prefix>``) before upload."""

    in_place = False  # read through its cache (``shardgen.store.cached``)

    def __init__(self, url, *, staging: Optional[Path] = None):
        self.objects = ObjectStore(url) if isinstance(url, str) else url  # or another kind's client
        self.url = self.objects.url
        default = default_staging(self.objects.bucket, self.objects.prefix)
        self.staging = Path(staging if staging is not None else default).absolute()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, staging={str(self.staging)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, S3Store) and (other.url, other.staging) == (self.url, self.staging)

    def __hash__(self) -> int:
        return hash((self.url, self.staging))

    def where(self, name: str = "") -> str:
        return self.objects.where(name)

    def read(self, name: str) -> Optional[bytes]:
        return self.objects.get(name)

    def read_with_mtime(self, name: str) -> Optional[tuple[bytes, float]]:
        found = self.objects.get_with_info(name)
        return None if found is None else (found[0], found[1].mtime)

    def write(self, name: str, data: bytes, *, durable: bool = True) -> None:
        self.objects.put(name, data, verify=durable)

    def delete(self, name: str) -> None:
        self.objects.delete(name)

    def size(self, name: str) -> Optional[int]:
        info = self.objects.head(name)
        return None if info is None else info.size

    def snapshot_generations(self) -> list[int]:
        numbers = []
        for name in self.objects.list(SNAPSHOT_DIR + "/"):
            stem = name[len(SNAPSHOT_DIR) + 1:]
            if stem.endswith(".json") and stem[:-5].isdigit():
                numbers.append(int(stem[:-5]))
        return sorted(numbers)

    def date_file_names(self, date: dt.date) -> list[str]:
        return list(self.objects.list(date.isoformat() + "."))

    def dated_sidecars(self) -> list[tuple[dt.date, str, tuple]]:
        found = {}
        for name, info in self.objects.list().items():
            if "/" not in name and name.endswith(".json") and len(name) == len("2024-01-02.json"):
                with contextlib.suppress(ValueError):
                    found[dt.date.fromisoformat(name[:10])] = (name, (self.where(name), info.mtime, info.size))
        return [(date, *found[date]) for date in sorted(found)]

    def check(self) -> None:
        self.objects.check()

    def writer_lock(self, what: str, *, ttl_s: float = 60.0) -> WriterLock:
        return WriterLock(self.objects, what=what, ttl_s=ttl_s)

    def publishing(self) -> ContextManager:
        """Nothing more to hold: the writer lock is checked before every write of a publish."""
        return contextlib.nullcontext()

    def clock(self) -> float:
        return self.objects.clock(f"{LEASE_DIR}/{CLOCK_NAME}")

    def live_generations(self, ttl_s: float, *, now: Optional[float] = None, remove_dead: bool = True) -> list[int]:
        now = self.clock() if now is None else now
        live = []
        for name, info in self.objects.list(LEASE_DIR + "/").items():
            if not name.endswith(".json"):
                continue
            text = self.objects.get(name)
            if text is None:  # released meanwhile
                continue
            generation, dead = judge_lease(self.where(name), now - info.mtime, text, ttl_s)
            if generation is not None:
                live.append(generation)
            elif dead and remove_dead:
                self.objects.delete(name)
        return live

    def lease_names(self) -> list[str]:
        return [name[len(LEASE_DIR) + 1:] for name in self.objects.list(LEASE_DIR + "/") if name.endswith(".json")]

    def heartbeat(self, name: str) -> ObjectHeartbeat:
        return ObjectHeartbeat(self.objects, name)

    def stage(self) -> Path:
        made = make_dirs(self.staging)
        if made and not _MADE:  # the first folder made: removed at exit if empty (nothing is registered at import)
            atexit.register(remove_empty_dirs, _MADE)
        _MADE.extend(made)
        return self.staging

    def put_shard(self, sidecar: Sidecar, name: str) -> Sidecar:
        """Upload a shard written in staging (``.rec``, ``.idx``, then the sidecar: its presence
        marks the shard complete, as on disk), then remove the local files; returns the sidecar
        published. Never over an object there: where a name of this version is taken (another
        writer's, or a killed build's worker that outlived it), the shard moves to the next free
        version first (a HEAD per name: without conditional writes, only a writer that does not
        hold the writer lock can still race it)."""
        names = [sidecar.rec, sidecar.idx] if sidecar.records else []
        if any(self.objects.head(each) is not None for each in [*names, name]):
            sidecar, name = self._next_free(sidecar, name)
            names = [sidecar.rec, sidecar.idx] if sidecar.records else []
        for each in [*names, name]:
            self.objects.upload(each, self.staging / each)
        for each in [*names, name]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.staging / each)
        return sidecar

    def _next_free(self, sidecar: Sidecar, name: str) -> tuple[Sidecar, str]:
        """The staged shard renamed to the next version no object, manifest or retired entry uses."""
        date = dt.date.fromisoformat(sidecar.date)
        version = self.next_version(date)
        paths = shard_paths(self.staging, date, version)
        moved = sidecar
        if sidecar.records:
            moved = dataclasses.replace(sidecar, rec=paths["rec"].name, idx=paths["idx"].name)
            os.replace(self.staging / sidecar.rec, paths["rec"])
            os.replace(self.staging / sidecar.idx, paths["idx"])
        atomic_write(paths["json"], json.dumps(moved.to_json(), sort_keys=True).encode())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.staging / name)
        log.warning("%s: %s is in the store already (another writer's); publishing the shard as version %d",
                    sidecar.date, self.where(name), version)
        return moved, paths["json"].name

    def discard_staged(self, date: dt.date) -> None:
        for path in shard_paths(self.staging, date).values():
            path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def local_files(self, names: Iterable[str]) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="shardgen-objects-") as tmp:
            for name in names:
                with contextlib.suppress(ObjectMismatch):  # no such object: missing here too
                    self.objects.download(name, Path(tmp) / name)
            yield Path(tmp)

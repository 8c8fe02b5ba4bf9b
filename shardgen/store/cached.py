"""An object store read through a local cache (``CachedStore``): what a ``ShardIter`` on
``s3://bucket/prefix`` reads, the one place the loader's downloads happen.

Shards are downloaded into a local cache folder that mirrors the store
(``<cache_dir>/objects/<bucket>/<prefix>/``: the same file names) as reads need them, and read
natively from there, exactly as a store folder is, every shard checked before MXNet reads it. So:

* the manifest is fetched whenever a reader asks for the newest one (construction, ``reset()``), a
  generation's snapshot once (snapshots never change);
* every download goes to a temp file, is checked against the manifest's size and sha256, and
  only then renamed into place: a file in the cache is whole and verified. Bytes that differ
  are fetched once more, then refused, naming the date;
* mid-epoch (a reader's fetch with ``halt``), a store that cannot be reached is waited for, up to
  ``SHARDGEN_OUTAGE_WAIT_S`` (default 10 minutes; :mod:`shardgen.store.outage`); at ``reset()`` the
  error is raised, and the loader reads the generation it holds again;
* once an epoch fetched its own shards, a newer generation's are fetched in the background
  (``fetch_ahead``), unless under a ``cache_limit``;
* several processes may share one cache folder without a ``cache_limit`` (say, the ``dist_sync``
  workers of a host): a per-file ``flock`` makes one of them download each file while the others
  wait for it. What a ``cache_limit`` bounds, and how: :mod:`shardgen.store.room`.

Why not fsspec's ``filecache``: it checks no hash, and its cache index is not safe to share
between processes. The cache here is a folder of plain files, named as in the store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Optional

from shardgen.format.check import needs_index
from shardgen.fsutil import atomic_write, clean_temp_files
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import MANIFEST_NAME, SNAPSHOT_DIR, snapshot_name
from shardgen.store.objstore import ObjectStoreError
from shardgen.store.outage import outage_wait_s, wait_out
from shardgen.store.room import LOCKS, NoRoom, Room
from shardgen.store.s3 import S3Store

__all__ = ["CachedStore", "DOWNLOAD_THREADS", "outage_wait_s"]

log = logging.getLogger(__name__)
DOWNLOAD_THREADS = 8
OBJECTS = "objects"  # <cache_dir>/objects/<bucket>/<prefix>: the caches of object stores
_CACHES: dict[Path, CachedStore] = {}  # one per cache folder in a process: the iterators of a store share it
_CACHES_LOCK = threading.Lock()


def _source(store: S3Store) -> tuple:
    """What a cache folder's files come from: the store's kind, URL and endpoint."""
    return type(store.objects), store.objects.url, store.objects.endpoint


class CachedStore(S3Store):
    """The store on an object store that ``store`` is, read through the cache folder ``folder``
    under ``limit`` bytes (None: the disk's room). ``CachedStore.of`` shares one per folder."""

    in_place = False

    @classmethod
    def of(cls, store: S3Store, cache_dir: Path, limit: Optional[int]) -> CachedStore:
        """The cached store of ``store`` under ``<cache_dir>/objects``: one per folder in a process,
        so one ``Room`` counts and evicts its files. Another store (kind, URL or endpoint) or another
        limit on a folder an iterator still reads is NoRoom: two rooms on one folder evicted each
        other's files, and a second store's reads were served from the first's."""
        if isinstance(store, CachedStore) and limit in (None, store.cache_limit):
            return store  # a reader's store, handed on (``for_kvstore``)
        folder = (Path(cache_dir) / OBJECTS / store.objects.bucket / store.objects.prefix).resolve()
        with _CACHES_LOCK:
            found = _CACHES.get(folder)
            if found is not None and (found.source, found.cache_limit) == (_source(store), limit):
                return found
            if found is not None and found.room.streamers:
                raise NoRoom(f"{folder}: an iterator of this process reads this cache folder as {found.url} "
                             f"({found.objects.endpoint}) under cache_limit={found.cache_limit}; one cache folder "
                             f"holds one store under one limit: give this one (cache_limit={limit}) its own cache_dir")
            found = _CACHES[folder] = cls(store, folder, limit)
        return found

    def __init__(self, store: S3Store, folder: Path, limit: Optional[int]):
        super().__init__(store.objects, staging=store.staging)
        outage_wait_s()  # a bad SHARDGEN_OUTAGE_WAIT_S is said now, not during an outage
        self.folder = Path(folder)
        self.source = _source(store)
        self.room = Room(self.folder, limit, self.url)  # it owns the limit
        self.downloads = 0  # files this process downloaded (not found in the cache)
        self.downloaded_bytes = 0  # and their bytes
        self._ahead: Optional[threading.Thread] = None
        self._ensure_folder()
        self.room.claim_folder()
        clean_temp_files(self.folder)  # downloads of killed processes of this host
        self.objects.check()

    def __repr__(self) -> str:
        return f"CachedStore({self.url!r}, {str(self.folder)!r}, limit={self.cache_limit})"

    @property
    def local_dir(self) -> Path:
        return self.folder

    @property
    def cache_limit(self) -> Optional[int]:
        return self.room.limit

    # -- manifests ----------------------------------------------------------------------------------

    def newest_manifest_file(self) -> Path:
        """The store's newest manifest in the cache (checked before it replaces the old one)."""
        data = self.read(MANIFEST_NAME)
        if data is None:
            raise self.no_manifest()
        Manifest.parse(data, self.where(MANIFEST_NAME))
        self._ensure_folder()
        atomic_write(self.room.manifest_path, data, fsync=False)
        return self.room.manifest_path

    def manifest_bytes(self, name: str = MANIFEST_NAME) -> Optional[bytes]:
        """A snapshot from the cache if it holds it (snapshots never change), else from the store (kept)."""
        if name == MANIFEST_NAME:
            return super().manifest_bytes(name)
        with contextlib.suppress(OSError):
            return (self.folder / name).read_bytes()
        data = super().manifest_bytes(name)
        if data is not None:
            (self.folder / SNAPSHOT_DIR).mkdir(exist_ok=True)
            atomic_write(self.folder / name, data, fsync=False)
        return data

    # -- shards ------------------------------------------------------------------------------------

    def make_local(self, shards: Iterable[ShardEntry], *, who: str, schema=None,
                   halt: Optional[threading.Event] = None) -> None:
        """Every file of ``shards`` in the cache, checked. With the ``schema``, a shard comes without
        its ``.idx`` unless reading it needs one (``needs_index``: records of
        differing sizes). ``halt``: mid-epoch, an outage is waited out (and a full
        cache waits for room) until it is set."""
        shards = list(shards)
        wait_out(lambda: self._fetch_once(shards, who, schema, halt), halt, self.url)

    def _fetch_once(self, shards: list, who: str, schema, halt: Optional[threading.Event]) -> None:
        t0 = time.perf_counter()
        self._ensure_folder()
        files = {}
        for s in shards:
            files[s.rec] = (s, "rec")
            if schema is None or needs_index(s, schema) or (self.folder / s.idx).exists():
                files[s.idx] = (s, "idx")
        self.room.want(who, files)
        missing = [n for n in files if not self._cached(n, files[n])]
        if missing:
            self.room.make_room(missing, files, halt)  # counted in flight until each file is in place
            try:
                self._download_all(missing, files, self._unread if who == "ahead" else None)
            finally:
                self.room.landed(missing)
            log.info("%s: %d files downloaded in %.1fs", self.url, len(missing), time.perf_counter() - t0)

    def _download_all(self, missing: list, files: dict, should_stop: Optional[Callable[[], bool]]) -> None:
        def one(name: str) -> None:
            try:
                if should_stop is None or not should_stop():
                    self._download(name, *files[name], should_stop=should_stop)
            finally:
                self.room.landed([name])

        with ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(missing)), thread_name_prefix="shardgen-fetch") as pool:
            downloads = [pool.submit(one, n) for n in missing]
            try:
                for done in downloads:
                    done.result()  # the first download's error, if any
            except BaseException:
                for later in downloads:  # not started: never (each would retry a store that is gone)
                    later.cancel()
                raise

    def _ensure_folder(self) -> None:
        try:
            (self.folder / LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NoRoom(f"{self.folder}: cannot create the object cache ({exc.strerror}); pass cache_dir= "
                         "a writable folder") from None

    def let_go(self, who: str) -> None:
        self.room.release(who)

    def _unread(self) -> bool:
        """No iterator reads this cache (the last one let go): the downloads ahead stop."""
        return not self.room.streamers

    def _cached(self, name: str, what: tuple) -> bool:
        """Whether ``name`` is in the cache as this shard needs it: downloaded for the shard of this
        sha256 (its marker; a store rebuilt under the same URL, or another endpoint's bucket of the
        same name, has other hashes: downloaded again, its ``.idx`` too), a ``.rec`` of its size."""
        shard, kind = what
        try:
            size = (self.folder / name).stat().st_size
            fresh = self._marker(name).read_text() == shard.sha256
        except OSError:
            return False
        return fresh and (size == shard.bytes if kind == "rec" else size > 0)

    def _marker(self, name: str) -> Path:
        return self.folder / LOCKS / (name + ".sha256")

    def forget_local(self, shard: ShardEntry) -> str:
        """A cached copy found damaged on disk goes, its ``.idx`` too (markers first): the next fetch
        downloads them."""
        for name in (shard.rec, shard.idx):
            with self.room.file_lock(name):
                for path in (self._marker(name), self.folder / name):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
        return (f"the cached copy was removed: the next reset() downloads it again (or a new ShardIter does; "
                f"`shardgen verify` on {self.url} checks the store's own)")

    def _download(self, name: str, shard: ShardEntry, kind: str,
                  should_stop: Optional[Callable[[], bool]] = None) -> None:
        with self.room.file_lock(name):
            if self._cached(name, (shard, kind)):
                return  # another process fetched it while we waited
            self.downloads += 1
            try:
                with contextlib.suppress(FileNotFoundError):
                    self._marker(name).unlink()
                if kind == "rec":
                    self.objects.download(name, self.folder / name, size=shard.bytes, sha256=shard.sha256,
                                          what=f"shard {shard.date}", should_stop=should_stop)
                else:
                    self.objects.download(name, self.folder / name, what=f"index of {shard.date}",
                                          should_stop=should_stop)
                atomic_write(self._marker(name), shard.sha256.encode(), fsync=False)  # the shard it is of
                with self.room.lock:
                    self.downloaded_bytes += (self.folder / name).stat().st_size
            except ObjectStoreError as exc:  # its kind kept: unreachable, reset() reads the generation it holds
                raise type(exc)(f"{shard.date}: {exc}") from None
            except OSError as exc:
                raise NoRoom(f"{shard.date}: cannot write {self.folder / name} ({exc.strerror})") from None

    # -- the room, and ahead of the next epoch ------------------------------------------------------

    def claim(self, who: str) -> None:
        self.room.claim(who)

    def check_room(self, shards: list) -> None:
        self.room.check_room(shards)

    def group_bytes(self) -> Optional[int]:
        return self.room.group_bytes()

    def pin(self, name: str, delta: int) -> None:
        self.room.pin(name, delta)

    def fetch_part(self, shards: Iterable[ShardEntry], *, who: str, schema=None) -> None:
        """A cache that holds the whole part (no ``cache_limit``) fetches a new generation's part now."""
        if self.cache_limit is None:
            try:
                self.make_local(shards, who=who, schema=schema)
            finally:
                self.let_go(who)

    def fetch_ahead(self, select: Callable, after: Optional[threading.Event] = None) -> None:
        """In the background, once ``after`` is set: the newest generation's shards (``select(manifest)``
        picks them), if they fit and there is no ``cache_limit``; nothing is said if it fails
        (``reset()`` will fetch and say why)."""
        if self.cache_limit is not None or (self._ahead is not None and self._ahead.is_alive()):
            return

        def run():
            try:
                if after is not None:
                    after.wait()
                manifest = self.load_manifest()
                if manifest is None:
                    return
                self.manifest_bytes(snapshot_name(manifest.generation))  # the cache can serve it offline
                busy = self.room.in_use()
                new = [s for s in select(manifest) if s.rec not in busy]
                if new:
                    self.make_local(new, who="ahead", schema=manifest.schema)  # no .idx the reading won't need
            except Exception as exc:  # noqa: BLE001 - a background hint only
                log.info("%s: fetching the next generation ahead failed (%s)", self.url, exc)
            finally:
                self.let_go("ahead")

        ahead = threading.Thread(target=run, name="shardgen-fetch-ahead", daemon=True)
        ahead.start()  # then known: a thread that finds it (close(), a test) may join it at once
        self._ahead = ahead

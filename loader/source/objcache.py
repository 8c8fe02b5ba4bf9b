"""Reading a store on an object store: ``ShardIter("s3://bucket/prefix/manifest.json", cache_dir=...)``.

Shards are downloaded into a local cache folder that mirrors the store
(``<cache>/objects/<bucket>/<prefix>/``: the same file names) as the feed needs them, and read
natively from there, exactly as a store folder is, every shard checked before MXNet reads it. So:

* the manifest (and a pinned or agreed generation's snapshot) is fetched whenever the iterator
  reads one (construction, ``reset()``). When the store cannot be reached at ``reset()``, the
  generation already held is read again (:mod:`loader.source.generations`); once an epoch has
  fetched its own shards, a newer generation's are fetched in the background;
* every download goes to a temp file, is checked against the manifest's size and sha256, and
  only then renamed into place: a file in the cache is whole and verified. Bytes that differ
  are fetched once more, then refused with a LoaderError naming the date;
* several processes may share one cache folder without a ``cache_limit`` (say, the ``dist_sync``
  workers of a host): a per-file ``flock`` makes one of them download each file while the others
  wait for it. What a ``cache_limit`` bounds, and how: :mod:`loader.source.room`.

Why not fsspec's ``filecache``: it checks no hash, and its cache index is not safe to share
between processes. The cache here is a folder of plain files, named as in the store.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional

from loader.errors import LoaderError, StoreUnreachableError
from loader.source.room import LOCKS as _LOCKS
from loader.source.room import Room
from shardgen.format.check import needs_index
from shardgen.format.schema import Schema
from shardgen.fsutil import atomic_write, clean_temp_files
from shardgen.store import S3Store
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import MANIFEST_NAME, SNAPSHOT_DIR
from shardgen.store.objstore import ObjectStoreError, store_errors_as
from shardgen.store.objurl import StoreUnreachable

__all__ = ["ObjectCache", "DOWNLOAD_THREADS"]

log = logging.getLogger(__name__)
DOWNLOAD_THREADS = 8


OUTAGE_WAIT_S = 600.0  # default budget for waiting out a store outage mid-epoch (SHARDGEN_OUTAGE_WAIT_S)
OUTAGE_RETRY_S = 5.0  # between two tries while waiting


def outage_wait_s() -> float:
    """Seconds a mid-epoch fetch waits for a store that cannot be reached: ``SHARDGEN_OUTAGE_WAIT_S``
    (0: fail at once, after the AWS retries), else 10 minutes."""
    text = os.environ.get("SHARDGEN_OUTAGE_WAIT_S", "")
    try:
        value = float(text) if text.strip() else OUTAGE_WAIT_S
    except ValueError:
        value = -1.0
    if not 0 <= value <= 7 * 86400:  # nan, inf and negatives too
        raise LoaderError(f"SHARDGEN_OUTAGE_WAIT_S must be a number of seconds in [0, 604800] (a week), got "
                          f"{text!r}")
    return value


class ObjectCache(Room):
    """One store on an object store, mirrored into ``folder``."""

    def __init__(self, store: S3Store, folder: Path, limit: Optional[int]):
        self.store = store
        self.remote = store.objects
        self.folder, self.limit = Path(folder), limit
        self.wanted: dict[str, set] = {}  # who -> names its epochs use (never evicted)
        self.downloads = 0  # files this process downloaded (not found in the cache)
        self.downloaded_bytes = 0  # and their bytes
        self._ahead: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._room = threading.Lock()  # one fetch at a time makes room (and counts its bytes in)
        self._inflight: dict = {}  # name -> bytes of a download under way (not counted on disk yet)
        self.streamers: set = set()  # iterators streaming into this cache (``claim``)
        self.pinned: collections.Counter = collections.Counter()  # name -> open descriptors (never evicted)
        self._freed = threading.Condition(self._lock)  # something was released or unpinned
        self._ensure_folder()
        self._claim_folder()
        for path in clean_temp_files(self.folder):  # downloads of killed processes of this host
            log.info("removed %s left by a dead process", path.name)
        with store_errors_as(LoaderError):
            self.remote.check()

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST_NAME

    # -- manifests ----------------------------------------------------------------------------------

    def pull_manifest(self) -> None:
        """The store's newest manifest into the mirror (checked before it replaces the old one);
        StoreUnreachableError when the store cannot be reached."""
        with store_errors_as(LoaderError, StoreUnreachableError):
            data = self.remote.get(MANIFEST_NAME)
        if data is None:
            raise LoaderError(f"{self.remote.where(MANIFEST_NAME)}: no manifest (run `shardgen build` first)")
        Manifest.parse(data, self.remote.where(MANIFEST_NAME))  # ManifestError: the loader says it
        self._ensure_folder()
        atomic_write(self.manifest_path, data, fsync=False)

    def pull_snapshot(self, generation: int) -> bool:
        """Generation ``generation``'s snapshot into the mirror, unless it is there already (no
        request then); False if the store has none."""
        name = f"{SNAPSHOT_DIR}/{int(generation)}.json"
        if (self.folder / name).is_file():  # snapshots are immutable
            return True
        with store_errors_as(LoaderError, StoreUnreachableError):
            data = self.remote.get(name)
        if data is None:
            return False
        (self.folder / SNAPSHOT_DIR).mkdir(exist_ok=True)
        atomic_write(self.folder / name, data, fsync=False)
        return True

    # -- shards ------------------------------------------------------------------------------------

    def fetch(self, shards: Iterable[ShardEntry], *, who: str = "", schema: Optional[Schema] = None,
              halt: Optional[threading.Event] = None) -> float:
        """Every file of ``shards`` in the cache, checked; seconds spent. ``who`` names the user
        whose files are kept from eviction from now on (an iterator). With the ``schema``, a shard
        comes without its ``.idx`` unless reading it needs one (``needs_index``; ``fetch_index``
        gets it later if the check asks for it after all)."""
        t0, waited_since = time.perf_counter(), None
        shards = list(shards)
        while True:
            try:
                self._fetch_once(shards, who, schema, halt)
                break
            except StoreUnreachableError as exc:
                # Mid-epoch (a feed's fetch: ``halt``), an outage is waited out within a budget; at
                # reset() (no ``halt``) the generation held is read again instead (``Reader.reset``).
                if halt is None:
                    raise
                budget, now = outage_wait_s(), time.monotonic()
                if budget == 0:
                    raise
                if waited_since is None:
                    waited_since = now
                    log.warning("%s; waiting up to %.0f s for the store (SHARDGEN_OUTAGE_WAIT_S) before the epoch "
                                "fails; it goes on where it was", exc, budget)
                elif now - waited_since >= budget:
                    raise StoreUnreachableError(f"{exc}; still after waiting {now - waited_since:.0f} s "
                                                f"(SHARDGEN_OUTAGE_WAIT_S={budget:g})") from None
                if halt.wait(min(OUTAGE_RETRY_S, budget - (now - waited_since))):
                    raise
        if waited_since is not None:
            log.warning("%s: reachable again after %.0f s", self.remote.url, time.monotonic() - waited_since)
        return time.perf_counter() - t0

    def _fetch_once(self, shards: list, who: str, schema: Optional[Schema], halt: Optional[threading.Event]) -> None:
        t0 = time.perf_counter()
        self._ensure_folder()
        files = {}
        for s in shards:
            files[s.rec] = (s, "rec")
            if schema is None or needs_index(s, schema) or (self.folder / s.idx).exists():
                files[s.idx] = (s, "idx")
        with self._lock:
            self.wanted[who] = set(files)
        missing = [n for n in files if not self._cached(n, files[n])]
        if missing:
            self._make_room(missing, files, halt)  # counted in _inflight until each file is in place
            try:
                self._download_all(missing, files)
            finally:
                with self._room:
                    for n in missing:
                        self._inflight.pop(n, None)
            log.info("%s: %d files downloaded in %.1fs", self.remote.url, len(missing), time.perf_counter() - t0)

    def _download_all(self, missing: list, files: dict) -> None:
        def one(name: str) -> None:
            try:
                self._download(name, *files[name])
            finally:
                with self._room:  # in place (counted on disk from now on), or failed
                    self._inflight.pop(name, None)

        with ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(missing)), thread_name_prefix="shardgen-fetch") as pool:
            downloads = [pool.submit(one, n) for n in missing]
            try:
                for done in downloads:
                    done.result()  # the first download's error, if any
            except BaseException:
                for later in downloads:  # not started: never (each would retry a store that is gone)
                    later.cancel()
                raise

    def fetch_index(self, shard: ShardEntry) -> None:
        """The ``.idx`` of one shard (see ``fetch``)."""
        with self._lock:
            self.wanted.setdefault(f"index-{shard.idx}", set()).add(shard.idx)
        try:
            if not self._cached(shard.idx, (shard, "idx")):
                self._download(shard.idx, shard, "idx")
        finally:
            self.release(f"index-{shard.idx}")

    def _ensure_folder(self) -> None:
        try:
            (self.folder / _LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LoaderError(f"{self.folder}: cannot create the object cache ({exc.strerror}); pass cache_dir= "
                              "a writable folder") from None

    def release(self, who: str) -> None:
        with self._lock:
            self.wanted.pop(who, None)
            self.streamers.discard(who)
            self._freed.notify_all()

    def _cached(self, name: str, what: tuple) -> bool:
        """Whether ``name`` is in the cache as this shard needs it: for a ``.rec``, the size and
        the sha256 it was verified against at download (a store rebuilt under the same URL, or
        another endpoint's bucket of the same name, has other hashes: downloaded again)."""
        shard, kind = what
        try:
            size = (self.folder / name).stat().st_size
            if kind == "rec":
                return size == shard.bytes and self._marker(name).read_text() == shard.sha256
        except OSError:
            return False
        return size > 0

    def _marker(self, name: str) -> Path:
        return self.folder / _LOCKS / (name + ".sha256")

    def drop(self, shard: ShardEntry) -> None:
        """A cached copy found damaged on disk goes (its marker first): the next fetch downloads it."""
        with self._file_lock(shard.rec):
            for path in (self._marker(shard.rec), self.folder / shard.rec):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _download(self, name: str, shard: ShardEntry, kind: str) -> None:
        with self._file_lock(name):
            if self._cached(name, (shard, kind)):
                return  # another process fetched it while we waited
            self.downloads += 1
            try:
                if kind == "rec":
                    with contextlib.suppress(FileNotFoundError):
                        self._marker(name).unlink()
                    self.remote.download(name, self.folder / name, size=shard.bytes, sha256=shard.sha256,
                                         what=f"shard {shard.date}")
                    atomic_write(self._marker(name), shard.sha256.encode(), fsync=False)
                else:
                    self.remote.download(name, self.folder / name, what=f"index of {shard.date}")
                with self._lock:
                    self.downloaded_bytes += (self.folder / name).stat().st_size
            except StoreUnreachable as exc:  # reset() may go on with the generation it holds
                raise StoreUnreachableError(f"{shard.date}: {exc}") from None
            except ObjectStoreError as exc:
                raise LoaderError(f"{shard.date}: {exc}") from None
            except OSError as exc:
                raise LoaderError(f"{shard.date}: cannot write {self.folder / name} ({exc.strerror})") from None

    @contextlib.contextmanager
    def _file_lock(self, name: str, *, wait: bool = True):
        fd = os.open(self.folder / _LOCKS / (name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    yield False
                    return
                raise
            yield True
        finally:
            os.close(fd)

    # -- ahead of the next epoch ------------------------------------------------------------------

    def fetch_ahead(self, select, after: Optional[threading.Event] = None) -> None:
        """In the background, once ``after`` is set: the newest generation's shards (``select(manifest)``
        picks them), if they fit; nothing is said if it fails (``reset()`` will fetch and say why)."""
        if self._ahead is not None and self._ahead.is_alive():
            return

        def run():
            try:
                if after is not None:
                    after.wait()
                data = self.remote.get(MANIFEST_NAME)
                if data is None:
                    return
                manifest = Manifest.parse(data, self.remote.where(MANIFEST_NAME))
                self.pull_snapshot(manifest.generation)  # with its shards, the cache can serve it offline
                shards = select(manifest)
                with self._lock:
                    busy = set().union(*self.wanted.values()) if self.wanted else set()
                new = [s for s in shards if s.rec not in busy]
                if new and (self.limit is None or sum(s.bytes for s in shards) <= self.limit):
                    self.fetch(new, who="ahead", schema=manifest.schema)  # no .idx the reading won't need
            except Exception as exc:  # noqa: BLE001 - a background hint only
                log.info("%s: fetching the next generation ahead failed (%s)", self.remote.url, exc)
            finally:
                self.release("ahead")

        self._ahead = threading.Thread(target=run, name="shardgen-fetch-ahead", daemon=True)
        self._ahead.start()

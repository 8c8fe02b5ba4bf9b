"""Reading a store on an object store: ``ShardIter("s3://bucket/prefix/manifest.json", cache_dir=...)``.

What an epoch reads is first downloaded into a local cache folder that mirrors the store
(``<cache>/objects/<bucket>/<prefix>/``: the same file names), and then read natively from
there, exactly as a store folder is, every shard checked before MXNet reads it. So:

* the manifest (and a pinned or agreed generation's snapshot) is fetched whenever the iterator
  reads one (construction, ``reset()``). When the store cannot be reached at ``reset()``, the
  generation already held is read again (:mod:`loader.source.generations`);
* an epoch's shards are downloaded before it starts, in parallel, only those not cached yet
  (the next epoch fetches only what is new). Half way through an epoch, a newer generation's
  snapshot and new shards are fetched in the background, so ``reset()`` finds them cached;
* every download goes to a temp file, is checked against the manifest's size and sha256, and
  only then renamed into place: a file in the cache is whole and verified. Bytes that differ
  are fetched once more, then refused with a LoaderError naming the date;
* several processes may share one cache folder (say, the ``dist_sync`` workers of a host): a
  per-file ``flock`` makes one of them download each file while the others wait for it;
* ``cache_limit`` (bytes, or a string such as ``"20GB"``): files no epoch of this process needs
  are evicted, least recently used first, to make room; an epoch whose shards alone exceed the
  limit, or the free disk space, is refused with an error that says how much it needs. The disk
  is never filled.

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
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional

from loader.errors import LoaderError, StoreUnreachableError
from loader.sizes import say_size
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
_LOCKS = ".locks"
_RESERVE = 64 << 20  # never leave the disk with less than this free
IDX_BYTES = 24  # an .idx line ("key<TAB>offset<NL>") is at most this long (counted before it is fetched)
ROOM_WAIT_S = 600.0  # a download waiting this long for files in use to be let go says the cache is full
_CLAIMS: dict = {}  # cache folder -> (fd, flock mode) this process holds on its .locks/limit
_CLAIMS_LOCK = threading.Lock()


def _some_dates(shards: Iterable[ShardEntry]) -> str:
    """The dates of ``shards`` for a message: the first three, then "..."."""
    dates = sorted({s.date for s in shards})
    return ", ".join(dates[:3]) + (", ..." if len(dates) > 3 else "")


class ObjectCache:
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

    def _claim_folder(self) -> None:
        """Under ``cache_limit`` the cache is this process's alone (its evictions assume no other
        process fetched ahead into it): an exclusive ``flock`` on ``.locks/limit``, else a shared
        one, which another process with a limit cannot then take. Held by this process from then on."""
        want = fcntl.LOCK_SH if self.limit is None else fcntl.LOCK_EX
        with _CLAIMS_LOCK:
            fd, held = _CLAIMS.get(self.folder, (None, None))
            if fd is None:
                fd = os.open(self.folder / _LOCKS / "limit", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if held != fcntl.LOCK_EX and held != want:
                try:
                    fcntl.flock(fd, want | fcntl.LOCK_NB)
                except OSError:
                    if held is None:
                        os.close(fd)
                    raise LoaderError(f"{self.folder}: another process reads this cache"
                                      f"{' under cache_limit' if self.limit is None else ''}; a cache under "
                                      "cache_limit is one reader's alone (its evictions would remove files another "
                                      "fetched ahead): give each process its own cache_dir (e.g. --cache-dir "
                                      "/nvme/cache-{rank})") from None
                held = want
            _CLAIMS[self.folder] = (fd, held)

    def claim(self, who: str) -> None:
        """``who`` (an iterator) streams into this cache: under ``cache_limit``, alone in this process."""
        with self._lock:
            others = self.streamers - {who}
            if self.limit is not None and others:
                raise LoaderError(f"{self.folder}: another ShardIter of this process streams into this cache under "
                                  "cache_limit; a cache under cache_limit is one reader's alone: give each its own "
                                  "cache_dir")
            self.streamers.add(who)

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

    def pin(self, name: str, delta: int) -> None:
        """A descriptor on ``name`` opened (+1) or closed (-1): an open file's bytes stay on disk
        whatever its name, so it is never evicted (nor counted as evictable) while open."""
        with self._lock:
            self.pinned[name] += delta
            if self.pinned[name] <= 0:
                del self.pinned[name]
                self._freed.notify_all()

    def fetch(self, shards: Iterable[ShardEntry], *, who: str = "", schema: Optional[Schema] = None,
              halt: Optional[threading.Event] = None) -> float:
        """Every file of ``shards`` in the cache, checked; seconds spent. ``who`` names the user
        whose files are kept from eviction from now on (an iterator). With the ``schema``, a shard
        comes without its ``.idx`` unless reading it needs one (``needs_index``; ``fetch_index``
        gets it later if the check asks for it after all)."""
        t0 = time.perf_counter()
        self._ensure_folder()
        shards = list(shards)
        files = {}
        for s in shards:
            files[s.rec] = (s, "rec")
            if schema is None or needs_index(s, schema) or (self.folder / s.idx).exists():
                files[s.idx] = (s, "idx")
        with self._lock:
            self.wanted[who] = set(files)
        missing = [n for n in files if not self._cached(n, files[n])]
        self._check_limit(shards)
        if missing:
            self._make_room(missing, files, halt)  # counted in _inflight until each file is in place
            try:
                self._download_all(missing, files)
            finally:
                with self._room:
                    for n in missing:
                        self._inflight.pop(n, None)
            log.info("%s: %d files downloaded in %.1fs", self.remote.url, len(missing), time.perf_counter() - t0)
        return time.perf_counter() - t0

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

    def _check_limit(self, shards: list) -> None:
        need = sum(s.bytes for s in shards)
        if self.limit is not None and need > self.limit:
            raise LoaderError(f"{self.remote.url}: {_some_dates(shards)}: {len(shards)} shard(s) need "
                              f"{say_size(need)} in the cache at once, but cache_limit is {say_size(self.limit)}; "
                              f"raise cache_limit to at least {say_size(need)}")

    def _make_room(self, missing: list, files: dict, halt: Optional[threading.Event]) -> None:
        """Evict what no epoch of ours uses until the new files fit beside the downloads already
        under way (``_inflight``: each counted until it is in place, then on disk, never both);
        refuse to fill the disk. With ``halt``, a cache full of files in use waits for them to be
        let go (the reads ahead of this one free them) until ``halt`` is set."""
        sizes = {n: files[n][0].bytes if files[n][1] == "rec" else IDX_BYTES * files[n][0].records for n in missing}
        incoming = sum(sizes.values())
        waited = time.monotonic()
        while True:
            with self._room:
                if self._make_room_now(incoming, missing, files, last=halt is None):
                    self._inflight.update(sizes)
                    return
            with self._lock:
                if halt.is_set():
                    raise LoaderError("the iterator was closed (or reset) while a download waited for room")
                held = set().union(*self.wanted.values(), self.pinned) - set(files)
                if not held or time.monotonic() - waited > ROOM_WAIT_S:
                    halt = None  # nothing in use will be let go (or not for long): the next try says what is full
                    continue
                self._freed.wait(0.05)

    def _make_room_now(self, incoming: int, missing: list, files: dict, last: bool) -> bool:
        if self.limit is not None:
            left = self._evict(self._cache_bytes() + sum(self._inflight.values()) + incoming - self.limit)
            if left > 0 and not last:
                return False
            if left > 0:
                raise LoaderError(f"{self.folder}: cache_limit {say_size(self.limit)} is full of files other "
                                  f"processes are using; {say_size(left)} more is needed for this epoch")
        free = shutil.disk_usage(self.folder).free
        if incoming + _RESERVE > free:
            raise LoaderError(f"{self.folder}: downloading {_some_dates(files[n][0] for n in missing)} "
                              f"needs {say_size(incoming)} more, but the "
                              f"disk has {say_size(free)} free (keeping {say_size(_RESERVE)}); free space, set "
                              "cache_limit, or pass another cache_dir")
        return True

    def _cache_bytes(self) -> int:
        """Bytes of the files in place (a download under way is counted in ``_inflight`` instead)
        and ``meta_bytes``: what the cache writes is all under ``cache_limit``."""
        return sum(p.stat().st_size for p in self._entries() if p.name not in self._inflight) + self.meta_bytes()

    def meta_bytes(self) -> int:
        """Room for the manifest twice and then some (the next one is written beside it before it
        replaces it, and may list a shard more) and the snapshots."""
        meta = 0
        with contextlib.suppress(OSError):
            meta += 2 * self.manifest_path.stat().st_size + self.manifest_path.stat().st_size // 8
        with contextlib.suppress(OSError):
            meta += sum(p.stat().st_size for p in (self.folder / SNAPSHOT_DIR).iterdir())
        return meta

    def check_room(self, shards: list) -> None:
        """LoaderError unless ``cache_limit`` holds 3 of the largest of ``shards`` beside ``meta_bytes``
        (a feed group is a third of the room: one being read, one fetched ahead, one for the next epoch)."""
        if self.limit is None or not shards:
            return
        big = max(shards, key=lambda s: s.bytes)
        meta = self.meta_bytes()
        if 3 * big.bytes + meta > self.limit:
            need = 3 * big.bytes + meta
            raise LoaderError(f"{self.remote.url}: cache_limit {say_size(self.limit)} is too small to stream this part: "
                              f"it must hold 3 of its largest shard ({big.date}, {say_size(big.bytes)}) at once (one "
                              f"being read, one fetched ahead, one for the next epoch) beside the manifest and "
                              f"snapshots ({say_size(meta)}); raise cache_limit to at least {say_size(need)}")

    def group_bytes(self) -> Optional[int]:
        """Bytes of shard files a feed group may hold: a third of what the limit leaves."""
        return None if self.limit is None else max(1, (self.limit - self.meta_bytes()) // 3)

    def _entries(self) -> list:
        out = []
        for p in self.folder.iterdir():
            if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST_NAME:  # (counted in _cache_bytes)
                out.append(p)
        return out

    def _evict(self, excess: int) -> int:
        """Evict until ``excess`` bytes are freed; what could not be freed."""
        if excess <= 0:
            return 0
        with self._lock:
            keep = set().union(*self.wanted.values(), self.pinned)
        candidates = []
        for p in self._entries():
            with contextlib.suppress(OSError):
                if p.name not in keep:
                    st = p.stat()
                    candidates.append((max(st.st_atime, st.st_mtime), p, st.st_size))
        for _, path, size in sorted(candidates, key=lambda c: c[0]):
            if excess <= 0:
                break
            with self._file_lock(path.name, wait=False) as mine:
                if not mine:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # a process reading it holds it open: its epoch goes on
                    excess -= size
                    log.info("evicted %s from the object cache", path.name)
        return max(0, excess)

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

"""What a ``cache_limit`` bounds in an object store's cache (:mod:`shardgen.store.cached`), in one
accounting: the files in place, the downloads under way (each counted in flight until it is in
place, then on disk, never both) and room for the manifest and snapshots. Files no read uses are
evicted, least recently used first, to make room; a file held open (``pin``) is never evicted, as
its bytes stay on disk whatever its name. A fetch that finds the cache full of files in use waits
until the reads ahead of it let them go; one that could never fit is refused, saying what is
needed. A cache under a limit is one reader's alone (an ``flock``, and a claim in this process).
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
from pathlib import Path
from typing import Optional

from shardgen.errors import ShardgenError
from shardgen.store.naming import MANIFEST_NAME, SNAPSHOT_DIR

__all__ = ["Room", "LOCKS", "NoRoom", "say_size"]

log = logging.getLogger(__name__)
LOCKS = ".locks"
_RESERVE = 64 << 20  # never leave the disk with less than this free
IDX_BYTES = 24  # an .idx line ("key<TAB>offset<NL>") is at most this long (counted before it is fetched)
ROOM_WAIT_S = 600.0  # a download waiting this long for files in use to be let go says the cache is full
_CLAIMS: dict = {}  # cache folder -> (fd, flock mode) this process holds on its .locks/limit
_CLAIMS_LOCK = threading.Lock()


class NoRoom(ShardgenError):
    """The cache (or its disk) cannot hold what a read needs; the message says how much is missing."""


def say_size(n: int) -> str:
    """``n`` bytes for a message: "1,234.5 MB", "12.3 kB", "517 bytes"."""
    if n >= 10**6:
        return f"{n / 1e6:,.1f} MB"
    return f"{n / 1e3:,.1f} kB" if n >= 10**3 else f"{n} bytes"


def _some_dates(shards) -> str:
    """The dates of ``shards`` for a message: the first three, then "..."."""
    dates = sorted({s.date for s in shards})
    return ", ".join(dates[:3]) + (", ..." if len(dates) > 3 else "")


class Room:
    """The room of the cache ``folder`` under ``limit`` bytes (None: the disk's): who wants which
    files (never evicted), the files held open, the downloads under way."""

    def __init__(self, folder: Path, limit: Optional[int], url: str):
        self.folder, self.limit, self.url = folder, limit, url
        self.wanted: dict[str, set] = {}  # who -> names its reads use (never evicted)
        self.pinned: collections.Counter = collections.Counter()  # name -> open descriptors (never evicted)
        self.streamers: set = set()  # iterators streaming into this cache (``claim``)
        self._inflight: dict = {}  # name -> bytes of a download under way (not counted on disk yet)
        self.lock = threading.Lock()
        self._room = threading.Lock()  # one fetch at a time makes room (and counts its bytes in)
        self._freed = threading.Condition(self.lock)  # something was released or unpinned

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST_NAME

    def want(self, who: str, names) -> None:
        with self.lock:
            self.wanted[who] = set(names)

    def in_use(self) -> set:
        """Names some reader wants or holds open."""
        with self.lock:
            return set().union(*self.wanted.values(), self.pinned)

    def release(self, who: str) -> None:
        with self.lock:
            self.wanted.pop(who, None)
            self.streamers.discard(who)
            self._freed.notify_all()

    def landed(self, names) -> None:
        """Downloads in place (counted on disk from now on), or failed."""
        with self._room:
            for n in names:
                self._inflight.pop(n, None)

    def claim_folder(self) -> None:
        """Under ``cache_limit`` the cache is this process's alone (its evictions assume no other
        process fetched ahead into it): an exclusive ``flock`` on ``.locks/limit``, else a shared
        one, which another process with a limit cannot then take. Held by this process from then on."""
        want = fcntl.LOCK_SH if self.limit is None else fcntl.LOCK_EX
        with _CLAIMS_LOCK:
            fd, held = _CLAIMS.get(self.folder, (None, None))
            if fd is None:
                fd = os.open(self.folder / LOCKS / "limit", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if held != fcntl.LOCK_EX and held != want:
                try:
                    fcntl.flock(fd, want | fcntl.LOCK_NB)
                except OSError:
                    if held is None:
                        os.close(fd)
                    raise NoRoom(f"{self.folder}: another process reads this cache"
                                      f"{' under cache_limit' if self.limit is None else ''}; a cache under "
                                      "cache_limit is one reader's alone (its evictions would remove files another "
                                      "fetched ahead): give each process its own cache_dir (e.g. --cache-dir "
                                      "/nvme/cache-{rank})") from None
                held = want
            _CLAIMS[self.folder] = (fd, held)

    def claim(self, who: str) -> None:
        """``who`` (an iterator) streams into this cache: under ``cache_limit``, alone in this process."""
        with self.lock:
            others = self.streamers - {who}
            if self.limit is not None and others:
                raise NoRoom(f"{self.folder}: another ShardIter of this process streams into this cache under "
                                  "cache_limit; a cache under cache_limit is one reader's alone: give each its own "
                                  "cache_dir")
            self.streamers.add(who)

    def pin(self, name: str, delta: int) -> None:
        """A descriptor on ``name`` opened (+1) or closed (-1): an open file's bytes stay on disk
        whatever its name, so it is never evicted (nor counted as evictable) while open."""
        with self.lock:
            self.pinned[name] += delta
            if self.pinned[name] <= 0:
                del self.pinned[name]
                self._freed.notify_all()

    def make_room(self, missing: list, files: dict, halt: Optional[threading.Event]) -> None:
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
            with self.lock:
                if halt.is_set():
                    raise NoRoom("the iterator was closed (or reset) while a download waited for room")
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
                raise NoRoom(f"{self.folder}: cache_limit {say_size(self.limit)} is full of files other "
                                  f"processes are using; {say_size(left)} more is needed for this epoch")
        free = shutil.disk_usage(self.folder).free
        if incoming + _RESERVE > free:
            raise NoRoom(f"{self.folder}: downloading {_some_dates(files[n][0] for n in missing)} "
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
        replaces it, and may list a shard more) and the snapshots. Before the manifest is in the
        cache (a reader pinned to a generation reads its snapshot; a ``load_state_dict()`` fetches the
        manifest later), the largest snapshot stands in for it: the room is counted at construction,
        not found missing mid-epoch (issue 64)."""
        snapshots = []
        with contextlib.suppress(OSError):
            snapshots = [p.stat().st_size for p in (self.folder / SNAPSHOT_DIR).iterdir()]
        try:
            manifest = self.manifest_path.stat().st_size
        except OSError:
            manifest = max(snapshots, default=0)
        return 2 * manifest + manifest // 8 + sum(snapshots)

    def check_room(self, shards: list) -> None:
        """LoaderError unless ``cache_limit`` holds 3 of the largest of ``shards`` beside ``meta_bytes``
        (a feed group is a third of the room: one being read, one fetched ahead, one for the next epoch)."""
        if self.limit is None or not shards:
            return
        big = max(shards, key=lambda s: s.bytes)
        meta = self.meta_bytes()
        if 3 * big.bytes + meta > self.limit:
            need = 3 * big.bytes + meta
            raise NoRoom(f"{self.url}: cache_limit {say_size(self.limit)} is too small to stream this "
                              f"part: it must hold 3 of its largest shard ({big.date}, {say_size(big.bytes)}) at once "
                              f"(one being read, one fetched ahead, one for the next epoch) beside the manifest and "
                              f"snapshots ({say_size(meta)}); raise cache_limit to at least {need:,} bytes "
                              f"({say_size(need)})")

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
        with self.lock:
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
            with self.file_lock(path.name, wait=False) as mine:
                if not mine:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # a process reading it holds it open: its epoch goes on
                    excess -= size
                    log.info("evicted %s from the object cache", path.name)
        return max(0, excess)

    @contextlib.contextmanager
    def file_lock(self, name: str, *, wait: bool = True):
        """This host's lock on file ``name`` of the cache (one downloads it, or evicts it, at a time):
        yields False if ``wait`` is off and another holds it."""
        fd = os.open(self.folder / LOCKS / (name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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

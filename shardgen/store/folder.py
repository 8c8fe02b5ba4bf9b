"""A store in a local (or shared, NFS-like) folder.

Every file is written to a temp name in the same folder, fsynced and renamed (a shard file
linked to its name, never replacing a file there). One writer at a time holds the store's writer
lock (``flock`` on ``.writer.lock``, :class:`~shardgen.store.writer_lock.FolderWriterLock`); each
publish also holds the manifest lock (``flock`` on ``.manifest.lock``) while it reads, changes and
writes the manifest. Shards are written in place (the folder is its own staging area), so there is
nothing to upload. Lease heartbeats are mtimes, judged by the file server's
clock (``leases/.clock``, touched by gc).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import ContextManager, Iterable, Optional

from shardgen.fsutil import atomic_write, file_version
from shardgen.store.base import Store
from shardgen.store.lease_file import FileHeartbeat, judge_lease, lease_folder
from shardgen.store.lock import StoreLock
from shardgen.store.naming import (
    CLOCK_NAME,
    LEASE_DIR,
    MANIFEST_LOCK,
    date_file_names,
    dated_sidecars,
    snapshot_generations,
)
from shardgen.store.sidecar import Sidecar
from shardgen.store.writer_lock import FolderWriterLock

__all__ = ["FolderStore"]

log = logging.getLogger(__name__)


class _NotAFile(OSError):
    """A name in the world-writable ``leases/`` that is no regular file (a FIFO, a device, a symlink)."""


def _read_lease(path: Path) -> tuple[float, bytes]:
    """``(mtime, bytes)`` of the lease file ``path``, never blocking and never following a symlink:
    ``leases/`` is writable by every user (a FIFO there would hang gc holding the writer lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotAFile("a symlink") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotAFile(f"mode {stat.filemode(st.st_mode)}")
        return st.st_mtime, fh.read()


def _touch(clock: Path) -> float:
    """Touch the store clock ``clock`` and return its mtime, never following a symlink (anyone may
    plant one in ``leases/``): what is there and no regular file is removed (the folder's owner
    may) and a new file made with ``O_EXCL``."""
    for _ in range(3):
        try:
            st = os.lstat(clock)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            log.warning("%s: not a regular file (%s); replacing it", clock, stat.filemode(st.st_mode))
            clock.unlink(missing_ok=True)
            st = None
        try:
            if st is None:
                os.close(os.open(clock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
            else:
                os.utime(clock, follow_symlinks=False)  # None: the file server sets its own "now"
            st = os.lstat(clock)
        except (FileExistsError, FileNotFoundError):
            continue  # another gc (or someone else) got there between the look and the write
        if stat.S_ISREG(st.st_mode):
            return st.st_mtime
    raise OSError(errno.EEXIST, "cannot make a regular clock file", str(clock))


class FolderStore(Store):
    """The store folder ``folder``."""

    def __init__(self, folder: Path):
        self.dir = Path(folder)
        self.staging = self.dir

    def __repr__(self) -> str:
        return f"FolderStore({str(self.dir)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FolderStore) and other.dir == self.dir

    def __hash__(self) -> int:
        return hash(self.dir)

    @property
    def local_dir(self) -> Path:
        return self.dir

    def path(self, name: str) -> Path:
        return self.dir / name

    def where(self, name: str = "") -> str:
        return str(self.dir / name) if name else str(self.dir)

    def read(self, name: str) -> Optional[bytes]:
        try:
            return self.path(name).read_bytes()
        except FileNotFoundError:
            return None

    def read_with_mtime(self, name: str) -> Optional[tuple[bytes, float]]:
        try:
            with open(self.path(name), "rb") as fh:
                return fh.read(), os.fstat(fh.fileno()).st_mtime
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes, *, durable: bool = True) -> None:
        path = self.path(name)
        if path.parent != self.dir:
            path.parent.mkdir(exist_ok=True)
        atomic_write(path, data, fsync=durable)

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def size(self, name: str) -> Optional[int]:
        try:
            return self.path(name).stat().st_size
        except OSError:
            return None

    def snapshot_generations(self) -> list[int]:
        return snapshot_generations(self.dir)

    def date_file_names(self, date: dt.date) -> list[str]:
        return date_file_names(self.dir, date)

    def dated_sidecars(self) -> list[tuple[dt.date, str, tuple]]:
        found = [(date, path.name, file_version(path)) for date, path in dated_sidecars(self.dir)]
        return [f for f in found if f[2] is not None]  # gone since it was listed

    def check(self) -> None:
        """A folder needs no check: what fails says so when it is used."""

    def writer_lock(self, what: str, *, ttl_s: float = 60.0) -> FolderWriterLock:
        """The store's one writer (``build``, ``watch``, ``gc``, ``publish``) for its lifetime; a second
        is refused at once, naming the holder (``ttl_s`` is not needed: the kernel frees a dead one's)."""
        return FolderWriterLock(self.dir, what=what)

    def publishing(self) -> StoreLock:
        return StoreLock(self.dir / MANIFEST_LOCK, what="manifest")

    def clock(self) -> float:
        """"Now" by the store filesystem's clock: the mtime of a file we just touched there
        (falls back to this host's clock, with a warning, if the store is read-only)."""
        clock = self.dir / LEASE_DIR / CLOCK_NAME
        try:
            lease_folder(clock.parent)
            return _touch(clock)
        except OSError as exc:
            log.warning("%s: cannot touch the store clock (%s); judging lease ages by this host's clock", clock, exc)
            return time.time()

    def live_generations(self, ttl_s: float, *, now: Optional[float] = None, remove_dead: bool = True) -> list[int]:
        folder = self.dir / LEASE_DIR
        live: list[int] = []
        if not folder.is_dir():
            return live
        now = self.clock() if now is None else now
        for path in folder.glob("*.json"):
            age, text = None, None
            try:
                mtime, text = _read_lease(path)
                age = now - mtime
            except FileNotFoundError:
                continue
            except _NotAFile as exc:
                log.warning("%s: not a regular file (%s); ignoring it", path, exc)
                continue
            except OSError:
                pass
            generation, dead = judge_lease(str(path), age, text, ttl_s)
            if generation is not None:
                live.append(generation)
            elif dead and remove_dead:
                path.unlink(missing_ok=True)
        return live

    def lease_names(self) -> list[str]:
        return [p.name for p in (self.dir / LEASE_DIR).glob("*.json")]

    def heartbeat(self, name: str) -> FileHeartbeat:
        return FileHeartbeat(self.path(name))

    def stage(self) -> Path:
        """The store folder, made if needed, with its ``leases/`` folder writable by every reader
        (``lease_file.LEASE_DIR_MODE``): a reader running as another user can write its lease."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # a read-only store: what writes into it says so
            lease_folder(self.dir / LEASE_DIR)
        return self.dir

    def put_shard(self, sidecar: Sidecar, name: str) -> Sidecar:
        """Written in place already (linked to names no file had): nothing to move."""
        return sidecar

    def discard_staged(self, date: dt.date) -> None:
        """The staging folder is the store: nothing to discard."""

    def local_files(self, names: Iterable[str]) -> ContextManager[Path]:
        return contextlib.nullcontext(self.dir)

"""The shard files a plan reads (:class:`PlanFiles`): fetched (an object store; nothing for a
folder), opened, checked once per file version (``shardgen.format.check``) and linked into the
plan's folder, each in a subfolder of its own (dmlc lists the folder of every path it is given).
A file is held open: MXNet reads it through ``/proc/self/fd``, so a file deleted or replaced in the
store is still the one checked. Reads count their use of a file; under a ``cache_limit`` a file
no read uses is closed (and may be evicted), else it stays open for later epochs.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from loader.errors import LoaderError
from loader.source.location import Location
from shardgen.errors import ShardError
from shardgen.format.check import REBUILD, check_shard
from shardgen.store.manifest import Manifest, ShardEntry

__all__ = ["PlanFiles", "recheck", "identity"]

_PROC_FD = os.path.isdir("/proc/self/fd")  # MXNet opens a checked file through its descriptor


class PlanFiles:
    """The shard files a plan reads, held open: MXNet opens them through ``/proc/self/fd``, so a
    file deleted or replaced in the store mid-epoch is still the one checked and read."""

    def __init__(self, location: Location, manifest: Manifest, shards: tuple, verify: str, who: str,
                 keep: bool) -> None:
        self.location, self.schema, self.shards, self.verify = location, manifest.schema, shards, verify
        self.who, self.keep = who, keep  # keep: never let go of a file once open (no cache_limit)
        self.fds: list[int] = [-1] * len(shards)
        self.frames: list = [None] * len(shards)  # ShardFrames of each open file
        self.users = collections.Counter()  # shard -> reads using it
        self.folder: Optional[Path] = None
        self.checked: dict = {}  # fd -> its file's identity (stat, verify) when recheck() last found it good
        self.lock = threading.Lock()
        self.fetch_lock = threading.Lock()

    def ensure(self, ks: Sequence[int], *, use: bool = True, halt: Optional[threading.Event] = None) -> None:
        """Shards ``ks`` fetched (an object store; ``halt``: waiting for room in a cache under
        ``cache_limit`` until set), opened, checked and linked; ``use``: counted as used until
        ``let_go``."""
        with self.fetch_lock:
            with self.lock:
                if use:  # counted first: a read let go meanwhile cannot close what this one needs
                    self.users.update(ks)
                missing = [k for k in dict.fromkeys(ks) if self.fds[k] < 0]
            try:
                if missing:
                    self.location.fetch([self.shards[k] for k in missing], who=f"{self.who}-{missing[0]}",
                                        schema=self.schema, halt=halt)
                for k in missing:
                    self._open(k)
            except BaseException:
                if use:
                    self.let_go(ks)
                raise
            finally:
                if missing:
                    self.location.release(f"{self.who}-{missing[0]}")

    def _open(self, k: int) -> None:
        s, store = self.shards[k], self.location.store.resolve()
        fd = _open_shard(store, s)
        try:
            seen = identity(fd, self.verify)
            frames = _check(self.location, store, fd, s, self.schema, self.verify)
            target = f"/proc/self/fd/{fd}" if _PROC_FD else str(store / s.rec)
            with self.lock:  # a link let go of in another thread is removed under this lock too
                link = f"{self.folder}/{k:06d}"
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(link)
                os.mkdir(link)  # one link per folder: dmlc lists a path's folder to find it
                os.symlink(target, f"{link}/s.rec")
                self.fds[k], self.frames[k], self.checked[fd] = fd, frames, seen
        except OSError as exc:
            os.close(fd)
            raise LoaderError(f"{self.folder}: cannot write the loader's index folder ({exc.strerror}); pass "
                              "cache_dir= a writable folder (or set XDG_CACHE_HOME)") from None
        except BaseException:
            os.close(fd)
            raise
        if not self.keep:  # the open descriptor holds the file: the cache may evict its name
            self.location.pin(s)

    def let_go(self, ks: Sequence[int]) -> None:
        """Reads of ``ks`` are done with them: without ``keep``, a file no read uses is closed."""
        with self.lock:
            self.users.subtract(ks)
            free = [k for k in dict.fromkeys(ks) if self.users[k] <= 0 and self.fds[k] >= 0]
            if self.keep:
                return
            for k in free:
                del self.users[k]
                self._close_one(k)
        for k in free:
            self.location.unpin(self.shards[k])

    def _close_one(self, k: int) -> None:
        """Close shard ``k``'s file and remove its link (under ``lock``)."""
        fd = self.fds[k]
        self.checked.pop(fd, None)
        self.fds[k], self.frames[k] = -1, None
        with contextlib.suppress(OSError):
            shutil.rmtree(self.folder / f"{k:06d}")
        with contextlib.suppress(OSError):
            os.close(fd)

    def forget(self, k: int) -> bool:
        """Close shard ``k``'s file if no read uses it (found damaged: the next ``ensure`` opens it
        anew, fetched again); False if a read still does."""
        with self.lock:
            if self.fds[k] < 0 or self.users[k] > 0:
                return self.fds[k] < 0
            self._close_one(k)
        if not self.keep:
            self.location.unpin(self.shards[k])
        return True

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # this process's folder, once it holds no plan (``_make_folder``)
                self.folder.parent.rmdir()
            self.folder = None
        with self.lock:
            fds, self.fds = self.fds, [-1] * len(self.fds)
            self.frames = [None] * len(self.fds)
        for k, fd in enumerate(fds):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                if not self.keep:
                    self.location.unpin(self.shards[k])

    def __del__(self) -> None:
        self.close()


def recheck(plan: Any, schema: Any, verify: str) -> bool:
    """Check the plan's open files again if they changed since (size, mtime or ctime): a file
    damaged in place is caught before the next epoch reads it. This runs at every reset(): a file
    as it was when last found good costs one fstat. True if some file had changed (and is sound)."""
    files, changed = plan.files, False
    if files is None:
        return False
    store = os.path.join(str(plan.store), "")
    for k, (s, fd) in enumerate(zip(plan.shards, list(files.fds))):
        if fd < 0:  # not open (an object store's shard no read needs now)
            continue
        seen = identity(fd, verify)
        if files.checked.get(fd) == seen:
            continue
        try:
            check_shard(fd, store + s.rec, store + s.idx, s, schema, verify=verify)
        except ShardError as exc:
            advice = files.location.drop_damaged(s)
            if files.location.downloads and not files.forget(k):
                advice = advice.replace("the next reset()", "a new ShardIter")
            raise LoaderError(_told(str(exc), advice)) from None
        changed = True
        files.checked[fd] = seen
    return changed


def identity(fd: int, verify: str) -> tuple:
    """What ``recheck`` compares: a file as it was when last found good (taken before the check, so a
    change during the check makes the next recheck check it again)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, verify


def _open_shard(store: Path, s: ShardEntry) -> int:
    rec = store / s.rec
    try:
        return os.open(rec, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise LoaderError(f"{rec}: shard file is missing (listed in the manifest for {s.date})") from None
    except OSError as exc:
        raise LoaderError(f"{rec}: cannot open the shard of {s.date} ({exc.strerror})") from None


def _check(location: Location, store: Path, fd: int, s: ShardEntry, schema: Any, verify: str):
    """``check_shard`` of one open shard file; an index the location left out is fetched and the
    check run again."""
    try:
        return check_shard(fd, str(store / s.rec), str(store / s.idx), s, schema, verify=verify)
    except ShardError as exc:
        if not location.fetch_index(s):
            raise LoaderError(_told(str(exc), location.drop_damaged(s))) from None
    try:
        return check_shard(fd, str(store / s.rec), str(store / s.idx), s, schema, verify=verify)
    except ShardError as exc:
        raise LoaderError(_told(str(exc), location.drop_damaged(s))) from None


def _told(message: str, what_to_do: str) -> str:
    """A check's message with the location's advice instead of the store's."""
    return message.replace(REBUILD, what_to_do)

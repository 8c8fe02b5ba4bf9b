"""The shard files a plan reads (:class:`PlanFiles`): made local by the store (a download for an
object store's cache; nothing for a folder), opened, checked once per file version
(``shardgen.format.check``) and linked into the plan's folder, each in a subfolder of its own
(dmlc lists the folder of every path it is given). A file is held open: MXNet reads it through
``/proc/self/fd``, so a file deleted or replaced in the store is still the one checked. Reads
count their use of a file; in a bounded cache a file no read uses is closed (and may be evicted),
else it stays open for later epochs, shared with the plans after (:mod:`loader.source.shared_files`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from loader.errors import LoaderError, as_loader_errors
from loader.source.shared_files import FOLDERS, adopt, drop, found_good, make_link, release
from shardgen.errors import ShardError
from shardgen.format.check import REBUILD, check_shard
from shardgen.store import Store
from shardgen.store.manifest import Manifest, ShardEntry

__all__ = ["PlanFiles", "recheck", "identity"]

_PROC_FD = os.path.isdir("/proc/self/fd")  # MXNet opens a checked file through its descriptor


class PlanFiles:
    """The shard files a plan reads, held open: MXNet opens them through ``/proc/self/fd``, so a
    file deleted or replaced in the store mid-epoch is still the one checked and read."""

    def __init__(self, store: Store, manifest: Manifest, shards: tuple, verify: str, who: str,
                 keep: bool) -> None:
        self.store, self.schema, self.shards, self.verify = store, manifest.schema, shards, verify
        self.who, self.keep = who, keep  # keep: never let go of a file once open (an unbounded cache)
        self.fds: list[int] = [-1] * len(shards)
        self.frames: list = [None] * len(shards)  # ShardFrames of each open file
        self.users = collections.Counter()  # shard -> reads using it
        self.folder: Optional[Path] = None
        self.links: list = [None] * len(shards)  # the link MXNet opens each file by (``<process folder>/fd/<fd>``)
        self.keys: list = [None] * len(shards)  # its key in ``shared_files`` (kept files are shared between plans)
        self._store = store.local_dir.resolve()
        self.eager = False  # every file opened and checked when the plan was made
        self.held: dict = {}  # shard -> a descriptor opened when the plan was made, not checked yet (``hold``)
        self.checked: dict = {}  # fd -> its file's identity (stat, verify) when recheck() last found it good
        self.lock = threading.Lock()
        self.fetch_lock = threading.Lock()

    def ensure(self, ks: Sequence[int], *, use: bool = True, halt: Optional[threading.Event] = None) -> None:
        """Shards ``ks`` made local (``halt``: a cache waits for room or for the store until it is
        set), opened, checked and linked; ``use``: counted as used until ``let_go``."""
        with self.fetch_lock:
            with self.lock:
                if use:  # counted first: a read let go meanwhile cannot close what this one needs
                    self.users.update(ks)
                missing = [k for k in dict.fromkeys(ks) if self.fds[k] < 0]
            try:
                missing = [k for k in missing if not self._share(k)]
                if missing:
                    with as_loader_errors():
                        self.store.make_local([self.shards[k] for k in missing], who=f"{self.who}-{missing[0]}",
                                              schema=self.schema, halt=halt)
                for k in missing:
                    self._open(k)
            except BaseException:
                if use:
                    self.let_go(ks)
                raise
            finally:
                if missing:
                    self.store.let_go(f"{self.who}-{missing[0]}")

    def _key(self, k: int) -> Optional[tuple]:
        s = self.shards[k]
        return (self._where, s.rec, s.sha256, s.bytes, self.verify) if self.keep else None

    @functools.cached_property
    def _where(self) -> str:
        """This process's folder and the store: kept files are shared by the plans of one of each."""
        return f"{self.folder.parent}\0{self._store}"

    def _share(self, k: int) -> bool:
        """Take shard ``k``'s file from another plan of this process that holds it open (the
        generation before), checked again if it changed since it was found good; False if none does."""
        key = self._key(k)
        held = adopt(key)
        if held is None:
            return False
        with contextlib.suppress(KeyError, OSError):  # the other plan's descriptor is the one read
            os.close(self.held.pop(k))
        fd, frames, link, seen = held
        now = identity(fd, self.verify)  # before the check: a change during it is checked next time
        if now != seen:
            try:
                frames = _check(self.store, self._store, fd, self.shards[k], self.schema, self.verify)
            except BaseException:
                release(key)
                raise
            seen = found_good(key, now)
        with self.lock:
            self.fds[k], self.frames[k], self.links[k], self.keys[k], self.checked[fd] = fd, frames, link, key, seen
        return True

    def hold(self) -> None:
        """Open every shard file now, check none (a store read in place): the plan holds the files
        the generation published, so one replaced or deleted in the store before its block comes is
        still the one read (checked when its block comes: ``ensure``); a missing one is said now."""
        try:
            for k, s in enumerate(self.shards):
                self.held[k] = _open_shard(self._store, s)
        except BaseException:
            self._let_go_held()
            raise

    def _let_go_held(self) -> None:
        with self.lock:  # once, whoever comes first (``close`` may run in two threads at once)
            held, self.held = self.held, {}
        for fd in held.values():
            os.close(fd)

    def _open(self, k: int) -> None:
        s, store, key = self.shards[k], self._store, self._key(k)
        fd = self.held.pop(k, -1)
        if fd < 0:
            fd = _open_shard(store, s)
        try:
            seen = identity(fd, self.verify)
            frames = _check(self.store, store, fd, s, self.schema, self.verify)
            target = f"/proc/self/fd/{fd}" if _PROC_FD else str(store / s.rec)
            link = f"{self.folder.parent}/fd/{fd}"  # one link per folder: dmlc lists a path's folder to find it
            if not make_link(link, target, key, (fd, frames, link, seen)):
                key = None  # this plan's own (closed by it alone)
            with self.lock:
                self.fds[k], self.frames[k], self.links[k], self.keys[k], self.checked[fd] = fd, frames, link, key, seen
        except OSError as exc:
            os.close(fd)
            raise LoaderError(f"{self.folder}: cannot write the loader's index folder ({exc.strerror}); pass "
                              "cache_dir= a writable folder (or set XDG_CACHE_HOME)") from None
        except BaseException:
            os.close(fd)
            raise
        if not self.keep:  # the open descriptor holds the file: the cache may evict its name
            self.store.pin(s.rec, +1)

    def read_fd(self, k: int) -> int:
        """Shard ``k``'s descriptor for a read that holds it (``ensure``; call under ``lock``):
        LoaderError naming the file if it is not open, or no longer is the file opened and checked
        (its number closed by another path and taken by another open): a read never copies
        another file's bytes (one fstat per piece of a read, and one per file once it is copied)."""
        fd, s = self.fds[k], self.shards[k]
        seen = self.checked.get(fd) if fd >= 0 else None
        try:
            now = os.fstat(fd) if seen is not None else None
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != seen[:2]:
            raise LoaderError(f"{self._store / s.rec}: the shard file of {s.date} was closed under a read that "
                              "holds it, its descriptor is not the file the loader opened and checked; nothing "
                              "was copied from it (a bug of the loader's: please report it)")
        if (now.st_size, now.st_mtime_ns) != seen[2:4]:  # written in place since it was checked (a later block)
            raise LoaderError(f"{self._store / s.rec}: the shard file of {s.date} changed in place after the loader "
                              "checked it (its size or modification time moved); nothing was read from it unchecked. "
                              "shardgen never writes a published shard in place: find what did; reset() checks "
                              "it again and reads it as it is")
        return fd

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
            self.store.pin(self.shards[k].rec, -1)

    def _close_one(self, k: int) -> None:
        """Let go of shard ``k``'s file: closed, and its link removed, once no plan holds it (under ``lock``)."""
        fd, key, link = self.fds[k], self.keys[k], self.links[k]
        self.checked.pop(fd, None)
        self.fds[k], self.frames[k], self.links[k], self.keys[k] = -1, None, None, None
        drop(fd, key, link)

    def forget(self, k: int) -> bool:
        """Close shard ``k``'s file if no read uses it (found damaged: the next ``ensure`` opens it
        anew, fetched again); False if a read still does."""
        with self.lock:
            if self.fds[k] < 0 or self.users[k] > 0:
                return self.fds[k] < 0
            self._close_one(k)
        if not self.keep:
            self.store.pin(self.shards[k].rec, -1)
        return True

    def close(self) -> None:
        """Let go of every file and remove the plan's folder; safe to run again, and in two threads at once."""
        self._let_go_held()
        with self.lock:
            folder, self.folder = self.folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
            with FOLDERS, contextlib.suppress(OSError):  # this process's folder, once it holds no plan
                folder.parent.rmdir()
        with self.lock:
            fds, self.fds = self.fds, [-1] * len(self.fds)
            keys, links, self.keys, self.links = self.keys, self.links, [None] * len(fds), [None] * len(fds)
            self.frames = [None] * len(self.fds)
        for k, fd in enumerate(fds):
            if fd >= 0:
                drop(fd, keys[k], links[k])
                if not self.keep:
                    self.store.pin(self.shards[k].rec, -1)

    def __del__(self) -> None:
        if "fetch_lock" in vars(self):  # built whole: a Ctrl-C can cut __init__ short (nothing is open then)
            self.close()


def recheck(plan: Any, schema: Any, verify: str) -> bool:
    """Check the plan's open files again if they changed since (size, mtime or ctime): a file
    damaged in place is caught before the next epoch reads it. This runs at every reset(): a file
    as it was when last found good costs one fstat. True if some file had changed (and is sound).

    A stream may be reading the plan meanwhile (``load_state_dict()`` on the shards read now, the
    next epoch's stream at ``reset()``), whose reads let go of files and open others: each file is
    checked through a duplicate of its descriptor taken under the plan's lock, never through the
    number, which a file let go of frees for the next open (another date's file: it was found
    "damaged", its good cached copy removed; or a closed one: EBADF)."""
    files, changed = plan.files, False
    if files is None:
        return False
    store = os.path.join(str(plan.store), "")
    for k, s in enumerate(plan.shards):
        with files.lock:
            fd = files.fds[k]
            if fd < 0:  # not open (a cached shard no read needs now)
                continue
            mine = os.dup(fd)  # the file the plan holds now, whatever is let go of meanwhile
        try:
            seen = identity(mine, verify)
            if files.checked.get(fd) == seen:
                continue
            try:
                check_shard(mine, store + s.rec, store + s.idx, s, schema, verify=verify)
            except ShardError as exc:
                damage = str(exc)
            else:
                changed, damage = True, None
                with files.lock:
                    if files.fds[k] == fd:  # not let go of meanwhile (the number may be another file's now)
                        files.checked[fd] = seen
                        if files.keys[k] is not None:  # what a later plan sharing it compares with
                            found_good(files.keys[k], seen)
        finally:
            os.close(mine)
        if damage is not None:
            advice = files.store.forget_local(s)
            if advice is not None and not files.forget(k):
                advice = advice.replace("the next reset()", "a new ShardIter")
            raise LoaderError(_told(damage, advice))
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


def _check(source: Store, store: Path, fd: int, s: ShardEntry, schema: Any, verify: str):
    """``check_shard`` of one open shard file (the store made its ``.idx`` local when reading needs it)."""
    try:
        return check_shard(fd, str(store / s.rec), str(store / s.idx), s, schema, verify=verify)
    except ShardError as exc:
        raise LoaderError(_told(str(exc), source.forget_local(s))) from None


def _told(message: str, what_to_do: Optional[str]) -> str:
    """A check's message with the store's advice (a cache's: it dropped its copy), if it gives one."""
    return message if what_to_do is None else message.replace(REBUILD, what_to_do)

"""What one epoch reads: the selected shards of a manifest generation, each checked before MXNet
reads it, and for each native read (:class:`Read`: record ranges of shards, in the order the
epoch's order reads them) an MXNet index that makes dmlc read exactly those records.

dmlc's ``IndexedRecordIOSplitter`` takes exactly one ``.idx`` whose offsets are global across the
``;``-joined ``.rec`` files, in the order they are joined. A read joins its shards in its own order;
it may start inside its first file and end inside its last (the index ``reader_index`` writes
says how dmlc is made to stop there), and joins whole files in between (a record's size is the
distance to the next offset, which must not cover another file's head or tail).

Files are opened, checked and linked into the plan's folder once (``PlanFiles.ensure``): all of
them when the plan is made for a store folder, shard by shard as reads need them for an object
store, whose files a cache under ``cache_limit`` lets go of once read (``PlanFiles.let_go``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from loader.errors import LoaderError
from loader.source.location import Location
from shardgen.errors import ShardError
from shardgen.format.check import VERIFY_MODES, check_shard
from shardgen.format.index import reader_index
from shardgen.fsutil import HOST_TOKEN, pid_alive
from shardgen.store.manifest import Manifest, ShardEntry

__all__ = ["EpochPlan", "PlanFiles", "Read", "ReaderSource", "reader_source", "make_plan", "recheck"]


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
            seen = _identity(fd, self.verify)
            frames = _check(self.location, store, fd, s, self.schema, self.verify)
            target = Path("/proc/self/fd") / str(fd)
            if not target.parent.is_dir():  # pragma: no cover - no procfs
                target = store / s.rec
            with self.lock:  # a link let go of in another thread is removed under this lock too
                link = self.folder / f"{k:06d}"
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(link)
                link.mkdir()  # one link per folder: dmlc lists a path's folder to find it
                os.symlink(target, link / "s.rec")
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
                fd = self.fds[k]
                self.checked.pop(fd, None)
                self.fds[k], self.frames[k] = -1, None
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.folder / f"{k:06d}")
                with contextlib.suppress(OSError):
                    os.close(fd)
        for k in free:
            self.location.unpin(self.shards[k])

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


@dataclass(frozen=True)
class EpochPlan:
    """An immutable description of what an epoch reads."""

    store: Path
    generation: int
    fingerprint: str
    shards: tuple[ShardEntry, ...]
    folder: Path  # this process's private folder for the plan: an index per read, links to the .rec files
    files: Optional[PlanFiles] = field(compare=False, repr=False, default=None)

    @property
    def samples(self) -> int:
        return int(sum(s.samples for s in self.shards))

    @property
    def records(self) -> int:
        return int(sum(s.records for s in self.shards))

    @property
    def sample_counts(self) -> list[int]:
        return [s.samples for s in self.shards]


@dataclass(frozen=True)
class Read:
    """One native read: records ``[lo, hi)`` of each shard in ``pieces`` ``(shard, lo, hi)``, in
    this order; only the first may start inside its file, only the last may end inside it."""

    pieces: tuple
    slot: int  # the block slot of its first record

    @property
    def records(self) -> int:
        return int(sum(hi - lo for _, lo, hi in self.pieces))

    @property
    def shards(self) -> list[int]:
        return [k for k, _, _ in self.pieces]


@dataclass(frozen=True)
class ReaderSource:
    """What one native iterator is opened on: ``path_imgrec``, ``path_imgidx`` and dmlc's part."""

    rec_paths: str
    index: Path
    num_parts: int
    part_index: int


_SEQ = itertools.count()


def reader_source(plan: EpochPlan, read: Read) -> ReaderSource:
    """The files and index that make MXNet read exactly ``read`` (see the module docstring); the
    index is in a folder of its own, which the caller removes once the native iterator has read it."""
    files = plan.files
    offsets, base, end = [], 0, None
    with files.lock:
        for i, (k, lo, hi) in enumerate(read.pieces):
            frames = files.frames[k]
            offsets.append(frames.offsets[lo:hi] + base)
            if i == len(read.pieces) - 1 and hi < len(frames.offsets):
                end = int(frames.offsets[hi]) + base  # ends inside its file
            base += plan.shards[k].bytes
    text, parts = reader_index(np.concatenate(offsets), end)
    # In a folder of its own: dmlc lists the folder of every path it is given and stats each entry,
    # so a folder where other files come and go (links let go of, indexes removed) fails it.
    index = plan.folder / f"i{next(_SEQ)}" / "r.idx"
    try:
        index.parent.mkdir()
        index.write_bytes(text)
    except OSError as exc:
        raise LoaderError(f"{index}: cannot write a reader's index ({exc.strerror}); pass cache_dir= a "
                          "writable folder with room (or set XDG_CACHE_HOME)") from None
    rec_paths = ";".join(str(plan.folder / f"{k:06d}" / "s.rec") for k in read.shards)
    return ReaderSource(rec_paths, index, parts, 0)


def recheck(plan: EpochPlan, schema: Any, verify: str) -> None:
    """Check the plan's open files again if they changed since (size, mtime or ctime): a file
    damaged in place is caught before the next epoch reads it. This runs at every reset(): a file
    as it was when last found good costs one fstat."""
    files = plan.files
    if files is None:
        return
    store = os.path.join(str(plan.store), "")
    for s, fd in zip(plan.shards, list(files.fds)):
        if fd < 0:  # not open (an object store's shard no read needs now)
            continue
        seen = _identity(fd, verify)
        if files.checked.get(fd) == seen:
            continue
        try:
            check_shard(fd, store + s.rec, store + s.idx, s, schema, verify=verify)
        except ShardError as exc:
            raise LoaderError(str(exc)) from None
        files.checked[fd] = seen


def _identity(fd: int, verify: str) -> tuple:
    """What ``recheck`` compares: a file as it was when last found good (taken before the check, so a
    change during the check makes the next recheck check it again)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, verify


def _ensure_fd_room(needed: int) -> None:
    """A plan holds one descriptor per shard (two plans overlap at a reset): raise the soft
    RLIMIT_NOFILE toward the hard one when needed, or say clearly what to do."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    want = in_use + needed + 64
    if soft != resource.RLIM_INFINITY and want > soft:
        target = want * 2 if hard == resource.RLIM_INFINITY else min(hard, want * 2)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and want > soft:
            raise LoaderError(f"reading {needed} shards needs about {want} open files, the limit is {soft} (hard "
                              f"{hard}); raise it (`ulimit -n {want * 2}`) or select fewer dates")


def _open_shard(store: Path, s: ShardEntry) -> int:
    rec = store / s.rec
    try:
        return os.open(rec, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise LoaderError(f"{rec}: shard file is missing (listed in the manifest for {s.date})") from None
    except OSError as exc:
        raise LoaderError(f"{rec}: cannot open the shard of {s.date} ({exc.strerror})") from None


def _make_folder(folder: Path) -> None:
    """``folder`` and its parent (this process's folder), which a plan closing in another thread
    removes when it is empty: made again then."""
    for attempt in range(10):
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()
            return
        except FileNotFoundError:
            if attempt == 9:
                raise


def make_plan(location: Location, manifest: Manifest, shards: tuple[ShardEntry, ...], *, verify: str = "frame",
              who: str = "", eager: Optional[bool] = None) -> EpochPlan:
    """A plan over ``shards`` with its own folder for MXNet. ``eager`` (default: a store folder):
    every file is opened and checked now, so what is wrong with one is said by ``ShardIter()`` or
    ``reset()``; else (an object store) files are fetched and checked as reads need them.

    dmlc resolves each ``.rec`` path (and the index) by listing its folder and ``stat``-ing every
    entry there, which fails if a file is renamed meanwhile -- as the watcher's temp files are in
    the store -- and costs O(shards^2) stats when all links share a folder (0.7 s at 400 shards).
    So MXNet only ever sees the plan's own folder, holding an index per read and, one per
    subfolder, a link to each shard file this process holds open.
    """
    if verify not in VERIFY_MODES:
        raise LoaderError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    store = location.store.resolve()
    if not shards:
        raise LoaderError(f"{location.manifest_path}: no shards selected (generation {manifest.generation})")
    eager = not location.downloads if eager is None else eager
    plans = location.plans.resolve()
    mine = plans / f"{HOST_TOKEN}-{os.getpid()}"
    if ";" in str(mine):
        raise LoaderError(f"{mine}: a path given to MXNet may not contain ';' (it joins .rec paths with it)")
    _ensure_fd_room(len(shards) if eager or location.cache_limit is None else 64)
    files = PlanFiles(location, manifest, shards, verify, who or f"plan-{id(shards)}",
                      keep=location.cache_limit is None)
    try:
        key = hashlib.sha256(json.dumps([str(store)] + [s.to_json() for s in shards]).encode()).hexdigest()[:12]
        folder = mine / f"{next(_SEQ):05d}-{key}"
        try:
            _clean_dead_processes(plans)
            _clean_dead_processes(location.root)  # where versions before 2026-12-05 put them
            shutil.rmtree(folder, ignore_errors=True)
            _make_folder(folder)
        except OSError as exc:
            raise LoaderError(f"{mine}: cannot write the loader's index folder ({exc.strerror}); pass "
                              "cache_dir= a writable folder (or set XDG_CACHE_HOME)") from None
        files.folder = folder
        if eager:
            files.ensure(range(len(shards)), use=False)
    except BaseException:
        files.close()
        raise
    return EpochPlan(store, manifest.generation, manifest.schema.fingerprint, shards, folder, files)


def _check(location: Location, store: Path, fd: int, s: ShardEntry, schema: Any, verify: str):
    """``check_shard`` of one open shard file; an index the location left out is fetched and the
    check run again."""
    try:
        return check_shard(fd, str(store / s.rec), str(store / s.idx), s, schema, verify=verify)
    except ShardError as exc:
        if not location.fetch_index(s):
            raise LoaderError(str(exc)) from None
    try:
        return check_shard(fd, str(store / s.rec), str(store / s.idx), s, schema, verify=verify)
    except ShardError as exc:
        raise LoaderError(str(exc)) from None


def _clean_dead_processes(plans: Path) -> None:
    """Remove plan folders of processes that are gone. ``HOST_TOKEN`` names this host, pid namespace
    and boot, so only folders whose pid can be checked here are matched."""
    for entry in plans.glob(f"{HOST_TOKEN}-*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)

"""What one epoch reads: the selected shards of a manifest generation, checked, and for each native
reader an MXNet index over exactly its range of records (:func:`reader_source`).

dmlc's ``IndexedRecordIOSplitter`` takes exactly one ``.idx`` whose offsets are global across the
``;``-joined ``.rec`` files. A range of records ``[first, stop)`` is read exactly by joining only
the files it touches, with the index ``shardgen.format.index.reader_index`` writes (which says
how dmlc is made to stop at ``stop``).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import hashlib
import itertools
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from loader.errors import LoaderError
from loader.pipeline.parts import shards_needed
from loader.source.location import Location
from shardgen.errors import ShardError
from shardgen.format.check import VERIFY_MODES, check_shard
from shardgen.format.index import reader_index
from shardgen.format.schema import day_number
from shardgen.fsutil import HOST_TOKEN, pid_alive
from shardgen.store.manifest import Manifest, ShardEntry

__all__ = ["EpochPlan", "ReaderSource", "reader_source", "part_shards", "make_plan", "hold", "drop", "recheck"]

class PlanFiles:
    """The shard files a plan reads, held open: MXNet opens them through ``/proc/self/fd``, so a
    file deleted or replaced in the store mid-epoch is still the one checked and read."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.folder: Optional[Path] = None
        self.sources: dict = {}  # (first, stop) -> ReaderSource written in the folder
        self.checked: dict = {}  # fd -> its file's identity (stat, verify) when recheck() last found it good
        self.lock = threading.Lock()

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # this process's folder, once it holds no plan (``_make_folder``)
                self.folder.parent.rmdir()
            self.folder = None
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                if fd < 0:
                    continue
                os.close(fd)

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class EpochPlan:
    """An immutable description of what an epoch reads."""

    store: Path
    generation: int
    fingerprint: str
    shards: tuple[ShardEntry, ...]
    folder: Path  # this process's private folder for the plan: the combined index, links to the .rec files
    records: int
    counts: np.ndarray = field(compare=False, repr=False, default=None)  # samples per record, global order
    files: Optional[PlanFiles] = field(compare=False, repr=False, default=None)
    offsets: np.ndarray = field(compare=False, repr=False, default=None)  # int64 byte offset of each record
    keys: np.ndarray = field(compare=False, repr=False, default=None)  # float32 key words of each record
    shard_first: np.ndarray = field(compare=False, repr=False, default=None)  # first record of each shard, + n
    source: Any = field(compare=False, repr=False, default=None)  # streamed: ``pipeline.segments.StreamSource``

    @property
    def samples(self) -> int:
        return int(self.counts.sum())

    def shard_of(self, record: int) -> int:
        return int(np.searchsorted(self.shard_first, record, side="right")) - 1

    def can_split(self, record: int) -> bool:
        """True when no other record of its shard has the same key and window count (see
        ``Schema.key_words``), so a reader can tell it apart from the others of its date."""
        s = self.shard_of(record)
        if self.files is not None and self.files.fds[s] < 0:  # not read (``part_shards``): a bound there stays
            return True
        span = slice(self.shard_first[s], self.shard_first[s + 1])
        same = (self.keys[span] == self.keys[record]).all(axis=1) & (self.counts[span] == self.counts[record])
        return int(np.count_nonzero(same)) == 1

    def day_of(self, record: int) -> int:
        return day_number(dt.date.fromisoformat(self.shards[self.shard_of(record)].date))


@dataclass(frozen=True)
class ReaderSource:
    """What one native iterator is opened on: ``path_imgrec``, ``path_imgidx`` and dmlc's part."""

    rec_paths: str
    index: Path
    num_parts: int
    part_index: int


def reader_source(plan: EpochPlan, first: int, stop: int) -> ReaderSource:
    """The files and index that make MXNet read exactly records ``[first, stop)`` of the plan
    (see the module docstring); written once per plan and range."""
    key = (first, stop)
    files = plan.files
    with files.lock:
        hit = files.sources.get(key)
        if hit is not None:
            return hit
        f0, f1 = plan.shard_of(first), plan.shard_of(stop - 1)
        base = plan.offsets[plan.shard_first[f0]]
        end = plan.offsets[stop] - base if stop < plan.shard_first[f1 + 1] else None  # ends inside a file
        text, parts = reader_index(plan.offsets[first:stop] - base, end)
        index = plan.folder / f"r{first}-{stop}.idx"
        tmp = index.with_suffix(".tmp")
        try:
            tmp.write_bytes(text)
            os.replace(tmp, index)
        except OSError as exc:
            raise LoaderError(f"{index}: cannot write a reader's index ({exc.strerror}); pass cache_dir= a "
                              "writable folder with room (or set XDG_CACHE_HOME)") from None
        rec_paths = ";".join(str(plan.folder / f"{i:06d}" / "s.rec") for i in range(f0, f1 + 1))
        files.sources[key] = source = ReaderSource(rec_paths, index, parts, 0)
        return source


def recheck(plan: EpochPlan, schema: Any, verify: str) -> None:
    """Check the plan's open files again if they changed since (size, mtime or ctime): a file
    damaged in place is caught before the next epoch reads it. This runs at every reset(): a file
    as it was when last found good costs one fstat."""
    files = plan.files
    if files is None:
        return
    store = os.path.join(str(plan.store), "")
    for s, fd in zip(plan.shards, files.fds):
        if fd < 0:  # not read by this part
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


_SEQ = itertools.count()


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


def part_shards(shards: tuple[ShardEntry, ...], part: Optional[tuple[int, int]], *, edges: bool = False
                ) -> np.ndarray:
    """Which of ``shards`` part ``part = (num_parts, part_index)`` reads (all of them for None):
    from the manifest alone (``loader.pipeline.parts.shards_needed``); ``edges``: only those the
    part's bounds fall inside (its other shards are streamed)."""
    if part is None or (part[0] == 1 and not edges):
        return np.ones(len(shards), bool)
    stays = [s.windows in (0, s.records) or bool(s.distinct) for s in shards]
    return shards_needed([s.samples for s in shards], stays, *part, edges=edges)


def make_plan(location: Location, manifest: Manifest, shards: tuple[ShardEntry, ...], *, verify: str = "frame",
              fetcher: str = "", part: Optional[tuple[int, int]] = None, source: Any = None) -> EpochPlan:
    """Fetch, open and check the shards' files and return a plan with its own folder for MXNet.

    ``part = (num_parts, part_index)``: only the shards that part reads are fetched and opened
    (``part_shards``); each of the others stands in the plan as one record of all its samples,
    which no reader's range includes (an object store's worker downloads its part, not the store).
    With a ``source`` (``loader.pipeline.segments.StreamSource``), only the shards the part's
    bounds fall inside are fetched now: the stream fetches the rest segment by segment.

    dmlc resolves each ``.rec`` path (and the index) by listing its folder and ``stat``-ing every
    entry there, which fails if a file is renamed meanwhile -- as the watcher's temp files are in
    the store -- and costs O(shards^2) stats when all links share a folder (0.7 s at 400 shards).
    So MXNet only ever sees the plan's own folder: written once, then left unchanged, holding the
    combined index and, one per subfolder, a link to each shard file this process holds open.
    """
    if verify not in VERIFY_MODES:
        raise LoaderError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    store = location.store.resolve()
    if not shards:
        raise LoaderError(f"{location.manifest_path}: no shards selected (generation {manifest.generation})")
    reads = part_shards(shards, part or (1, 0), edges=True) if source is not None else part_shards(shards, part)
    location.fetch([s for s, r in zip(shards, reads) if r], who=fetcher, schema=manifest.schema)  # into a mirror
    plans = location.plans.resolve()
    mine = plans / f"{HOST_TOKEN}-{os.getpid()}"
    if ";" in str(mine):
        raise LoaderError(f"{mine}: a path given to MXNet may not contain ';' (it joins .rec paths with it)")
    _ensure_fd_room(len(shards))
    files = PlanFiles()
    try:
        parts, counts, keys, base = [], [], [], 0
        no_key = np.zeros((1, len(manifest.schema.key_words)), np.float32)
        for s, read in zip(shards, reads):
            if not read:
                files.fds.append(-1)
                parts.append(np.array([base], np.int64))
                counts.append(np.array([s.samples], np.int64))
                keys.append(no_key)
                base += s.bytes
                continue
            fd = _open_shard(store, s)
            files.fds.append(fd)
            seen = _identity(fd, verify)
            frames = _check(location, store, fd, s, manifest.schema, verify)
            files.checked[fd] = seen  # the first reset() costs one fstat per file, as later ones do
            parts.append(frames.offsets + base)
            counts.append(frames.counts)
            keys.append(frames.keys)
            base += s.bytes
        shard_first = np.concatenate(([0], np.cumsum([len(c) for c in counts]))).astype(np.int64)
        offsets, counts, keys = np.concatenate(parts), np.concatenate(counts), np.concatenate(keys)
        proc_fd = Path("/proc/self/fd")
        key = hashlib.sha256(json.dumps([str(store), part] + [s.to_json() for s in shards]).encode()).hexdigest()[:12]
        folder = mine / f"{next(_SEQ):05d}-{key}"
        try:
            _clean_dead_processes(plans)
            _clean_dead_processes(location.root)  # where versions before 2026-12-05 put them
            shutil.rmtree(folder, ignore_errors=True)
            _make_folder(folder)
            files.folder = folder
            for i, (s, fd) in enumerate(zip(shards, files.fds)):
                if fd < 0:
                    continue
                target = proc_fd / str(fd) if proc_fd.is_dir() else store / s.rec
                (folder / f"{i:06d}").mkdir()  # one link per folder: dmlc lists a path's folder to find it
                os.symlink(target, folder / f"{i:06d}" / "s.rec")
        except OSError as exc:
            raise LoaderError(f"{mine}: cannot write the loader's index folder ({exc.strerror}); pass "
                              "cache_dir= a writable folder (or set XDG_CACHE_HOME)") from None
    except BaseException:
        files.close()
        raise
    return EpochPlan(store, manifest.generation, manifest.schema.fingerprint, shards, folder, len(offsets),
                     counts, files, offsets, keys, shard_first, source)


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


_HELD: collections.Counter = collections.Counter()  # plan folder -> iterators of this process using it
_HELD_LOCK = threading.Lock()


def hold(plan: EpochPlan) -> None:
    with _HELD_LOCK:
        _HELD[plan.folder] += 1


def drop(plan: EpochPlan) -> None:
    """One user less; the last one closes the plan's files and removes its folder."""
    with _HELD_LOCK:
        _HELD[plan.folder] -= 1
        last = _HELD[plan.folder] <= 0
        if last:
            del _HELD[plan.folder]
    if last and plan.files is not None:
        plan.files.close()

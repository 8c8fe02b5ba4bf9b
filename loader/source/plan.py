"""What one epoch reads: the selected shards of a manifest generation, each checked before MXNet
reads it, and for each native read (:class:`Read`: record ranges of shards, in the order the
epoch's order reads them) an MXNet index that makes dmlc read exactly those records.

dmlc's ``IndexedRecordIOSplitter`` reads a contiguous byte range of the ``;``-joined ``.rec`` files
(sizing each record by the next offset of its one ``.idx``), so a read straight from the shards
could only join whole files between a partial first and last one. Each read is instead a *tape*:
its records copied by the kernel (``sendfile``) from the checked files into a private memory file,
in the read's order, with an index of their offsets there (:func:`reader_source`). Any pieces of
any shards then make one native read.

A store read in place has every file opened when the plan is made (``PlanFiles.hold``); each file
is checked once, when the first block that reads it comes (``PlanFiles.ensure``), and one read
through a cache is fetched then too; a bounded cache lets go of it once read (``PlanFiles.let_go``).

Everything the loader writes locally lives under ONE root, ``cache_dir`` (default
``$XDG_CACHE_HOME/shardgen``, else ``~/.cache/shardgen``): the plan folders of this host's
processes in ``<cache_dir>/plans/``, and an object store's cache (``shardgen.store.cached``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from loader.errors import LoaderError
from loader.source.files import PlanFiles, recheck
from loader.source.shared_files import FOLDERS
from shardgen.format.check import VERIFY_MODES, has_checksums
from shardgen.format.index import reader_index
from shardgen.fsutil import HOST_TOKEN, pid_alive
from shardgen.store import Store
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import MANIFEST_NAME

log = logging.getLogger(__name__)

__all__ = ["EpochPlan", "PlanFiles", "Read", "ReaderSource", "reader_source", "make_plan", "recheck", "cache_root"]
PLANS = "plans"  # <cache_dir>/plans: this host's plan folders (an index and one link per shard)


def cache_root(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The loader's local root: ``cache_dir``, else ``$XDG_CACHE_HOME/shardgen``, else ``~/.cache/shardgen``."""
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardgen"


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
    """What one native iterator is opened on: ``path_imgrec``, ``path_imgidx`` and dmlc's part, and
    the tape it reads (closed, with the folder of its link, once the native iterator is freed)."""

    rec_paths: str
    index: Path
    num_parts: int
    part_index: int
    tape: Optional[Tape] = None


class Tape:
    """A read's memory file and the folder of its link; ``close()`` once, whoever calls it first
    (the native iterator's ``free()``, or the opening that failed)."""

    def __init__(self, fd: int, folder: Optional[Path] = None):
        self.fd, self.folder, self._lock = fd, folder, threading.Lock()

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)


_SEQ = itertools.count()


def _copy(dst: int, src: int, offset: int, count: int) -> None:
    """``count`` bytes of ``src`` from ``offset`` appended to ``dst`` (in the kernel: ``sendfile``)."""
    while count > 0:
        n = os.sendfile(dst, src, offset, count)
        if n <= 0:
            raise LoaderError(f"a shard ended {count} bytes early while its records were copied for MXNet's reader "
                              "(the file shrank under the loader?)")
        offset, count = offset + n, count - n


def reader_source(plan: EpochPlan, read: Read) -> ReaderSource:
    """The tape and index that make MXNet read exactly ``read`` (see the module docstring): the
    read's records, piece after piece, copied by the kernel from the checked files into one memory
    file (its own: nothing else can change it between the copy and MXNet's read), and an index of
    their offsets in it. Any pieces join, so a block that takes a piece of every date is one read,
    not one per date. The index is in a folder of its own, which the caller removes once the
    native iterator has read it."""
    files = plan.files
    offsets, pos = [], 0
    tape = Tape(os.memfd_create("shardgen-tape", os.MFD_CLOEXEC))
    try:
        with files.lock:
            spans = []
            for k, lo, hi in read.pieces:
                frames = files.frames[k]
                a = int(frames.offsets[lo])
                z = int(frames.offsets[hi]) if hi < len(frames.offsets) else int(plan.shards[k].bytes)
                offsets.append(frames.offsets[lo:hi] - a + pos)
                spans.append((files.read_fd(k), a, z - a))  # the file opened and checked, or LoaderError
                pos += z - a
        for fd, a, n in spans:  # (a read holds its files: let go only once it is done)
            _copy(tape.fd, fd, a, n)
        with files.lock:  # and after: a write in place that began before the copy ended has moved the mtime
            for k in dict.fromkeys(k for k, _, _ in read.pieces):
                files.read_fd(k)
        text, parts = reader_index(np.concatenate(offsets))
        # In folders of their own: dmlc lists the folder of every path it is given and stats each
        # entry, so a folder where other files come and go (links let go of, indexes removed) fails it.
        seq = next(_SEQ)
        index, tape.folder = plan.folder / f"i{seq}" / "r.idx", plan.folder / f"t{seq}"
        try:
            index.parent.mkdir()
            index.write_bytes(text)
            tape.folder.mkdir()
            os.symlink(f"/proc/self/fd/{tape.fd}", tape.folder / "s.rec")
        except OSError as exc:
            shutil.rmtree(index.parent, ignore_errors=True)
            raise LoaderError(f"{index}: cannot write a reader's index ({exc.strerror}); pass cache_dir= a "
                              "writable folder with room (or set XDG_CACHE_HOME)") from None
    except BaseException:
        tape.close()
        raise
    return ReaderSource(str(tape.folder / "s.rec"), index, parts, 0, tape)


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


def _make_folder(folder: Path) -> None:
    """``folder`` and its parent (this process's folder), which a plan closing in another thread
    removes when it is empty: both under ``FOLDERS``, so it is never removed between the two."""
    with FOLDERS:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir()


def make_plan(store: Store, root: Path, manifest: Manifest, shards: tuple[ShardEntry, ...], *, verify: str = "crc",
              who: str = "", eager: Optional[bool] = None) -> EpochPlan:
    """A plan over ``shards`` of ``store`` with its own folder for MXNet under ``root``. Files are
    checked (and fetched, from an object store) when a block that reads them is about to be read,
    not now (at ten years, checking 2,500 files first took 1.9 s); a store read in place has them
    all opened now (``PlanFiles.hold``: a file replaced later is not the one read; a missing one is
    said here). ``eager``: every file checked now, so what is wrong with one is said here.

    dmlc resolves each ``.rec`` path (and the index) by listing its folder and ``stat``-ing every
    entry there, which fails if a file is renamed meanwhile -- as the watcher's temp files are in
    the store -- and costs O(shards^2) stats when all links share a folder (0.7 s at 400 shards).
    So MXNet only ever sees the plan's own folder, holding an index per read and, one per
    subfolder, a link to each shard file this process holds open.
    """
    if verify not in VERIFY_MODES:
        raise LoaderError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    folder_read = store.local_dir.resolve()
    if not shards:
        span = (f"its {len(manifest.shards)} dates run from {manifest.shards[0].date} to {manifest.shards[-1].date}"
                if manifest.shards else "it lists no shard (run `shardgen build`)")
        raise LoaderError(f"{store.where(MANIFEST_NAME)}: no shards selected in generation {manifest.generation} "
                          f"({span}; check `dates`)")
    _notice_old_shards(store, shards, verify)
    eager = bool(eager)
    plans = (root / PLANS).resolve()
    mine = plans / f"{HOST_TOKEN}-{os.getpid()}"
    if ";" in str(mine):
        raise LoaderError(f"{mine}: a path given to MXNet may not contain ';' (it joins .rec paths with it)")
    keep = store.group_bytes() is None  # no bound on what reading holds: a file once open stays open
    _ensure_fd_room(len(shards) if eager or keep else 64)
    files = PlanFiles(store, manifest, shards, verify, who or f"plan-{id(shards)}", keep=keep)
    try:
        key = hashlib.sha256(json.dumps([str(folder_read)] + [s.to_json() for s in shards]).encode()).hexdigest()[:12]
        folder = mine / f"{next(_SEQ):05d}-{key}"
        try:
            _clean_dead_processes(plans)
            _clean_dead_processes(root)  # where versions before 2026-12-05 put them
            shutil.rmtree(folder, ignore_errors=True)
            _make_folder(folder)
        except OSError as exc:
            raise LoaderError(f"{mine}: cannot write the loader's index folder ({exc.strerror}); pass "
                              "cache_dir= a writable folder (or set XDG_CACHE_HOME)") from None
        files.folder = folder
        if eager:
            files.ensure(range(len(shards)), use=False)
            files.eager = True
        elif store.in_place:
            files.hold()
    except BaseException:
        files.close()
        raise
    return EpochPlan(folder_read, manifest.generation, manifest.schema.fingerprint, shards, folder, files)


_NOTICED: set = set()


def _notice_old_shards(store: Store, shards: tuple, verify: str) -> None:
    """One warning per store and process: shards written before record checksums are read with
    their framing checked, not their content, until they are rebuilt."""
    old = [s.date for s in shards if not has_checksums(s)]
    if verify == "crc" and old and store.where() not in _NOTICED:
        _NOTICED.add(store.where())
        log.warning("%s: %d shard(s) (%s%s) were written before record checksums: their content is checked by "
                    "frame only until rebuilt (`shardgen build --force` for their dates); `shardgen verify` "
                    "lists them", store.where(), len(old), ", ".join(old[:3]), ", ..." if len(old) > 3 else "")


def _clean_dead_processes(plans: Path) -> None:
    """Remove plan folders of processes that are gone. ``HOST_TOKEN`` names this host, pid namespace
    and boot, so only folders whose pid can be checked here are matched."""
    for entry in plans.glob(f"{HOST_TOKEN}-*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)

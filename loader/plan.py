"""What one epoch reads: the selected shards of a manifest generation, checked, and one combined
MXNet index over them whose offsets are global across the ``;``-joined ``.rec`` files.

dmlc's ``IndexedRecordIOSplitter`` takes exactly one ``.idx``, sorts its offsets and sizes each
record by the next offset, so the combined index must list every record of every joined file;
partitioning is by record: part ``p`` of ``P`` gets records ``[p*s, (p+1)*s)`` with
``s = ceil(n / P)``.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import math
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from shardgen.errors import ManifestError, ShardError
from shardgen.fsutil import HOST_TOKEN, pid_alive
from shardgen.manifest import MANIFEST_NAME, Manifest, ShardEntry
from shardgen.store import read_idx_offsets

from .errors import LoaderError

__all__ = ["EpochPlan", "load_manifest", "select_shards", "make_plan", "part_sizes", "default_cache_dir",
           "manifest_path_of", "normalize_dates", "hold", "drop"]

DateRange = Optional[Sequence[Optional[str]]]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardgen-loader"


def load_manifest(path: Path) -> Manifest:
    try:
        return Manifest.load(path)
    except ManifestError as exc:
        raise LoaderError(str(exc)) from None


def _bound(value: object, what: str) -> Optional[dt.date]:
    if value is None:
        return None
    try:
        return value if isinstance(value, dt.date) else dt.date.fromisoformat(str(value))
    except ValueError:
        raise LoaderError(f"dates: {what} {value!r} is not YYYY-MM-DD") from None


def normalize_dates(dates: DateRange) -> Optional[tuple]:
    """A checked ``(start, end)`` pair of ISO dates (either None), or None for all dates."""
    if dates is None:
        return None
    if isinstance(dates, str) or len(dates) != 2:
        raise LoaderError(f"dates must be a (start, end) pair, got {dates!r}")
    bounds = (_bound(dates[0], "start"), _bound(dates[1], "end"))
    return tuple(None if b is None else b.isoformat() for b in bounds)


def select_shards(manifest: Manifest, dates: DateRange) -> tuple[ShardEntry, ...]:
    """The manifest's shards with ``start <= date <= end`` (either end None = open)."""
    dates = normalize_dates(dates)
    if dates is None:
        return manifest.shards
    start, end = dates
    return tuple(s for s in manifest.shards if (start is None or s.date >= start) and (end is None or s.date <= end))


def part_sizes(n: int, num_parts: int) -> list[int]:
    """Records in each part, as dmlc splits them."""
    step = math.ceil(n / num_parts)
    return [max(0, min((p + 1) * step, n) - p * step) for p in range(num_parts)]


@dataclass(frozen=True)
class EpochPlan:
    """An immutable description of what an epoch reads."""

    store: Path
    generation: int
    fingerprint: str
    shards: tuple[ShardEntry, ...]
    folder: Path  # this process's private folder for the plan: the combined index, links to the .rec files
    records: int

    @property
    def index(self) -> Path:
        return self.folder / "index.idx"

    @property
    def rec_paths(self) -> str:
        return ";".join(str(self.folder / f"{i:06d}.rec") for i in range(len(self.shards)))


def _check_files(store: Path, shards: Sequence[ShardEntry]) -> None:
    for s in shards:
        rec = store / s.rec
        try:
            size = rec.stat().st_size
        except OSError:
            raise LoaderError(f"{rec}: shard file is missing (listed in the manifest for {s.date})") from None
        if size != s.bytes:
            raise LoaderError(f"{rec}: {size} bytes, the manifest says {s.bytes} (truncated or rewritten?)")
        if not (store / s.idx).is_file():
            raise LoaderError(f"{store / s.idx}: index file is missing (shard {s.date})")


def _combined_index(store: Path, shards: Sequence[ShardEntry]) -> bytes:
    parts, base = [], 0
    for s in shards:
        try:
            offsets = read_idx_offsets(store / s.idx)
        except ShardError as exc:
            raise LoaderError(str(exc)) from None
        if len(offsets) != s.records or (len(offsets) and (offsets[0] != 0 or offsets[-1] >= s.bytes)):
            raise LoaderError(f"{store / s.idx}: {len(offsets)} records within {s.bytes} bytes do not match "
                              f"the manifest ({s.records} records)")
        parts.append(offsets + base)
        base += s.bytes
    offsets = np.concatenate(parts)
    return "".join(f"{i}\t{o}\n" for i, o in enumerate(offsets.tolist())).encode()


def make_plan(manifest_path: Path, manifest: Manifest, shards: tuple[ShardEntry, ...],
              cache_dir: Path) -> EpochPlan:
    """Check the shards' files and return a plan, building its folder unless this process has it.

    dmlc resolves each ``.rec`` path (and the index) by listing its folder and ``stat``-ing every
    entry there, which fails if a file is renamed meanwhile -- as the watcher's temp files are in
    the store. So MXNet only ever sees the plan's own folder: written once, then left unchanged,
    holding the combined index and a symlink to each shard file.
    """
    store = Path(manifest_path).resolve().parent
    if not shards:
        raise LoaderError(f"{manifest_path}: no shards selected (generation {manifest.generation})")
    mine = Path(cache_dir).resolve() / f"{HOST_TOKEN}-{os.getpid()}"
    if ";" in str(store) or ";" in str(mine):
        raise LoaderError(f"{store if ';' in str(store) else mine}: a path given to MXNet may not contain ';' "
                          "(it joins .rec paths with it)")
    _check_files(store, shards)
    key_src = json.dumps([str(store)] + [s.to_json() for s in shards], sort_keys=True)
    folder = mine / hashlib.sha256(key_src.encode()).hexdigest()[:24]
    if not folder.is_dir():
        index = _combined_index(store, shards)
        try:
            _clean_dead_processes(Path(cache_dir))
            if mine.is_dir():
                _trim(mine)
            tmp = mine / f".tmp-{folder.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "index.idx").write_bytes(index)
            for i, s in enumerate(shards):
                os.symlink(store / s.rec, tmp / f"{i:06d}.rec")
            os.rename(tmp, folder)
        except OSError as exc:
            raise LoaderError(f"{mine}: cannot write the loader's index folder ({exc.strerror}); pass "
                              "cache_dir= a writable folder (or set XDG_CACHE_HOME)") from None
    return EpochPlan(store, manifest.generation, manifest.schema.fingerprint, shards, folder,
                     sum(s.records for s in shards))


def _clean_dead_processes(cache_dir: Path) -> None:
    """Remove plan folders of processes that are gone. ``HOST_TOKEN`` names this host, pid namespace
    and boot, so only folders whose pid can be checked here are matched."""
    for entry in cache_dir.glob(f"{HOST_TOKEN}-*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


_HELD: collections.Counter = collections.Counter()  # plan folder -> iterators of this process using it
_HELD_LOCK = threading.Lock()


def hold(plan: EpochPlan) -> None:
    with _HELD_LOCK:
        _HELD[plan.folder] += 1


def drop(plan: EpochPlan) -> None:
    with _HELD_LOCK:
        _HELD[plan.folder] -= 1
        if _HELD[plan.folder] <= 0:
            del _HELD[plan.folder]


def _trim(mine: Path, keep_unheld: int = 4) -> None:
    """Remove this process's plan folders that no iterator holds, but the newest few."""
    with _HELD_LOCK:
        idle = [f for f in mine.glob("*") if f not in _HELD and not f.name.startswith(".tmp-")]
        idle.sort(key=lambda f: f.stat().st_mtime, reverse=True)
        for folder in idle[keep_unheld:]:
            shutil.rmtree(folder, ignore_errors=True)


def manifest_path_of(path: Path) -> Path:
    """Accept a manifest file or a store folder."""
    path = Path(path)
    return path / MANIFEST_NAME if path.is_dir() else path

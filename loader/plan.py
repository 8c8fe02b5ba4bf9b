"""What one epoch reads: the selected shards of a manifest generation, checked, and one combined
MXNet index over them whose offsets are global across the ``;``-joined ``.rec`` files.

dmlc's ``IndexedRecordIOSplitter`` takes exactly one ``.idx``, sorts its offsets and sizes each
record by the next offset, so the combined index must list every record of every joined file;
partitioning is by record: part ``p`` of ``P`` gets records ``[p*s, (p+1)*s)`` with
``s = ceil(n / P)``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from shardgen.errors import ManifestError, ShardError
from shardgen.fsutil import atomic_write
from shardgen.manifest import MANIFEST_NAME, Manifest, ShardEntry
from shardgen.store import read_idx_offsets

from .errors import LoaderError

__all__ = ["EpochPlan", "load_manifest", "select_shards", "make_plan", "part_sizes", "default_cache_dir",
           "manifest_path_of"]

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


def select_shards(manifest: Manifest, dates: DateRange) -> tuple[ShardEntry, ...]:
    """The manifest's shards with ``start <= date <= end`` (either end None = open)."""
    if dates is None:
        return manifest.shards
    if isinstance(dates, str) or len(dates) != 2:
        raise LoaderError(f"dates must be a (start, end) pair, got {dates!r}")
    start, end = _bound(dates[0], "start"), _bound(dates[1], "end")
    return tuple(s for s in manifest.shards
                 if (start is None or dt.date.fromisoformat(s.date) >= start)
                 and (end is None or dt.date.fromisoformat(s.date) <= end))


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
    index: Path  # the combined .idx
    records: int

    @property
    def rec_paths(self) -> str:
        return ";".join(str(self.store / s.rec) for s in self.shards)


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
    """Check the shards' files and return a plan, building the combined index unless cached."""
    store = Path(manifest_path).resolve().parent
    if not shards:
        raise LoaderError(f"{manifest_path}: no shards selected (generation {manifest.generation})")
    if ";" in str(store):
        raise LoaderError(f"{store}: a store path may not contain ';' (MXNet joins .rec paths with it)")
    _check_files(store, shards)
    key_src = json.dumps([str(store)] + [s.to_json() for s in shards], sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    index = Path(cache_dir) / f"{key}.idx"
    if index.exists():
        os.utime(index)  # recently used: kept by _trim_cache
    else:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(index, _combined_index(store, shards), fsync=False)
        _trim_cache(Path(cache_dir))
    return EpochPlan(store, manifest.generation, manifest.schema.fingerprint, shards, index,
                     sum(s.records for s in shards))


def _trim_cache(cache_dir: Path, keep: int = 16) -> None:
    files = sorted(cache_dir.glob("*.idx"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[keep:]:
        old.unlink(missing_ok=True)


def manifest_path_of(path: Path) -> Path:
    """Accept a manifest file or a store folder."""
    path = Path(path)
    return path / MANIFEST_NAME if path.is_dir() else path

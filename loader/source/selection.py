"""Which shards an epoch reads: the manifest (a file or a store folder), the ``(start, end)``
date selection, and the ``date`` label turned back into dates."""

from __future__ import annotations

import datetime as dt
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from loader.errors import LoaderError
from shardgen.errors import ManifestError
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["DateRange", "manifest_path_of", "load_manifest", "normalize_dates", "select_shards", "to_datetime64"]

DateRange = Optional[Sequence[Optional[str]]]


def manifest_path_of(path: Path) -> Path:
    """Accept a manifest file or a store folder (what is not a file is taken as a folder)."""
    path = Path(path)
    return path if path.is_file() else path / MANIFEST_NAME


_PARSED: dict = {}  # path -> (file identity, Manifest): parsed again only when the file changed
_PARSED_LOCK = threading.Lock()


def load_manifest(path: Path) -> Manifest:
    """The manifest at ``path``, parsed. Every reset() asks; an unchanged file (same inode, size,
    mtime and ctime: the manifest is replaced by rename) is not parsed again (400 shards: ~9 ms an
    epoch)."""
    try:
        try:
            st = os.stat(path)
        except OSError:
            return Manifest.load(path)  # says what is wrong
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with _PARSED_LOCK:
            hit = _PARSED.get(str(path))
        if hit is not None and hit[0] == key:
            return hit[1]
        manifest = Manifest.load(path)
        with _PARSED_LOCK:
            _PARSED.pop(str(path), None)
            _PARSED[str(path)] = (key, manifest)
            while len(_PARSED) > 16:
                del _PARSED[next(iter(_PARSED))]
        return manifest
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
    if None not in bounds and bounds[0] > bounds[1]:
        raise LoaderError(f"dates ({bounds[0]}, {bounds[1]}): the start is after the end; dates are (start, end), "
                          "both included")
    return tuple(None if b is None else b.isoformat() for b in bounds)


def select_shards(manifest: Manifest, dates: DateRange) -> tuple[ShardEntry, ...]:
    """The manifest's shards with ``start <= date <= end`` (either end None = open)."""
    dates = normalize_dates(dates)
    if dates is None:
        return manifest.shards
    start, end = dates
    return tuple(s for s in manifest.shards if (start is None or s.date >= start) and (end is None or s.date <= end))


def to_datetime64(days: Any) -> np.ndarray:
    """The ``date`` label (float32 days since 1970-01-01) as ``datetime64[D]``."""
    arr = days.asnumpy() if hasattr(days, "asnumpy") else np.asarray(days)
    return arr.astype(np.int64).astype("datetime64[D]")

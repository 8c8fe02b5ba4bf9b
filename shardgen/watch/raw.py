"""The raw files a watcher reads and removes: those whose writer is done (``settled``), and those
of dates that left the window (``prune_raw``, also run by ``shardgen gc``)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path

from shardgen.config import Config
from shardgen.store.manifest import Manifest

__all__ = ["settled", "prune_raw"]

log = logging.getLogger(__name__)


def settled(files: dict[dt.date, Path], settle_s: float) -> dict[dt.date, Path]:
    """The raw files whose mtime is ``settle_s`` old (not being written any more)."""
    found, now = {}, time.time()
    for date, path in files.items():
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if now - st.st_mtime >= settle_s:
            found[date] = path
    return found


def prune_raw(cfg: Config, manifest: Manifest, left: set, files: dict[dt.date, Path]) -> tuple[set, list]:
    """Remove the raw files of the dates gc deleted the shards of (``left``: dates that left the
    manifest, in this process's memory) and, with the window full, of every date of ``files``
    older than the oldest shard (never produced again: also after a gc that ran while no watcher
    did), unless ``store.keep_raw``; never of a date the manifest lists. The dates of ``left``
    still listed (retired, within their grace) are returned, to prune once gc deletes them, with
    the dates whose raw file was removed."""
    listed = {e.date for e in (*manifest.shards, *manifest.retired)}
    if cfg.store.keep_raw:
        return set(left), []
    left = set(left)
    if manifest.window and len(manifest.shards) >= manifest.window:  # as ``wanted`` judges a date too old
        oldest = manifest.shards[0].date
        left |= {d.isoformat() for d in files if d.isoformat() < oldest}
    removed = []
    for day in sorted(left - listed):
        path = cfg.raw_path(dt.date.fromisoformat(day))
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("%s: cannot remove the raw file of %s (%s)", path, day, exc.strerror)
            continue
        log.info("%s: removed %s (its shard was deleted; store.keep_raw = false)", day, path)
        removed.append(day)
    return left & listed, removed

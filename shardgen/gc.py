"""Garbage collection: delete retired shards once they are past ``grace_s`` and no live reader
lease names a generation that still listed them. The manifest drops them (generation + 1)."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import replace
from pathlib import Path
from typing import Optional

from .lease import live_lease_generations
from .lock import MANIFEST_LOCK, StoreLock
from .manifest import MANIFEST_NAME, Manifest, RetiredEntry, parse_utc

__all__ = ["collect", "deletable"]

log = logging.getLogger(__name__)


def _age_s(entry: RetiredEntry, now: dt.datetime) -> float:
    return (now - parse_utc(entry.retired_at)).total_seconds()


def deletable(entry: RetiredEntry, live: list[int], grace_s: float, now: dt.datetime) -> bool:
    """Past its grace period, and no live lease reads a generation that listed it."""
    if _age_s(entry, now) < grace_s:
        return False
    if entry.retired_generation <= 0:  # unknown: any live reader might use it
        return not live
    return all(g >= entry.retired_generation for g in live)


def collect(store: Path, *, grace_s: float, lease_ttl_s: float,
            now: Optional[dt.datetime] = None) -> list[str]:
    """Delete what may go; returns the dates deleted."""
    store = Path(store)
    if not (store / MANIFEST_NAME).exists():
        return []
    now = now or dt.datetime.now(dt.timezone.utc)
    with StoreLock(store / MANIFEST_LOCK, what="manifest"):
        manifest = Manifest.load(store / MANIFEST_NAME)
        live = live_lease_generations(store, lease_ttl_s)
        live_dates = {s.date for s in manifest.shards}
        gone, kept = [], []
        for entry in manifest.retired:
            if entry.date not in live_dates and deletable(entry, live, grace_s, now):
                for name in (entry.rec, entry.idx, f"{entry.date}.json"):
                    (store / name).unlink(missing_ok=True)
                gone.append(entry.date)
                log.info("deleted retired shard %s", entry.date)
            else:
                kept.append(entry)
        if gone:
            replace(manifest, retired=tuple(kept)).save(store / MANIFEST_NAME)
    return gone

"""Publishing into a store's manifest: the rolling window, retirement, one new generation.

``publish`` is written once for every kind of store: under the store's ``publishing()`` lock (a
folder: the manifest lock) and the writer's lock (an object store: checked before each write), it
reads the manifest, applies the entries and the window (``apply_entries``), and saves the next
generation (snapshot first, then ``manifest.json``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Iterable, Optional, Union

from shardgen.clock import utc_now
from shardgen.format.schema import Schema
from shardgen.store import Store, open_store
from shardgen.store.base import check_schema
from shardgen.store.manifest import Manifest, RetiredEntry, ShardEntry
from shardgen.store.writer_lock import WriterLockLike

__all__ = ["publish", "apply_entries", "log_retired", "check_schema", "published_here"]

log = logging.getLogger(__name__)
_PUBLISHED = [0]  # manifests this process published: what a stopped command can say it did


def published_here() -> int:
    """How many manifests this process has published (a command stopped by a signal says whether
    finished shards were published, or nothing was)."""
    return _PUBLISHED[0]


def publish(store: Union[Store, str, os.PathLike], schema: Schema, window: int, entries: Iterable[ShardEntry], *,
            lock: Optional[WriterLockLike] = None) -> Optional[Manifest]:
    """Add or replace shards, apply the window; the new manifest or None if nothing changed.
    ``lock``: the store's writer lock if the caller holds it (else it is taken for this publish)."""
    store = open_store(store)
    if lock is None:
        with store.writer_lock("publish") as held:
            return publish(store, schema, window, entries, lock=held)
    with store.publishing():
        old = store.open_manifest(schema, window)
        new = apply_entries(old, entries, window, generation=store.next_generation(old))
        if new is None:
            return None
        saved = store.save(new, lock)
        _PUBLISHED[0] += 1
    log_retired(saved)
    return saved


def apply_entries(old: Manifest, entries: Iterable[ShardEntry], window: int, *,
                  generation: int) -> Optional[Manifest]:
    """``old`` with ``entries`` added or replacing their dates and the window applied (what leaves
    is retired at ``generation``, the number the result will be published as); None if nothing changes."""
    now = utc_now()
    retired = {r.rec: r for r in old.retired}  # keyed by file: a date may have several versions
    shards = {s.date: s for s in old.shards}
    for e in entries:
        prev = shards.get(e.date)
        if prev is not None and prev.rec != e.rec:  # a rewrite: the old files retire, unchanged
            retired.setdefault(prev.rec, RetiredEntry(prev.date, prev.rec, prev.idx, now, generation))
        shards[e.date] = e
    dates = sorted(shards)
    keep = dates[-window:] if window else dates
    for date in dates[: len(dates) - len(keep)]:
        s = shards[date]
        retired.setdefault(s.rec, RetiredEntry(date, s.rec, s.idx, now, generation))
    live = {shards[d].rec for d in keep}
    retired = {rec: r for rec, r in retired.items() if rec not in live}
    new = replace(old, window=window, shards=tuple(shards[d] for d in keep),
                  retired=tuple(sorted(retired.values(), key=lambda r: (r.date, r.rec))))
    if new.shards == old.shards and new.retired == old.retired and new.window == old.window:
        return None
    return new


def log_retired(saved: Manifest) -> None:
    for r in saved.retired:
        if r.retired_generation == saved.generation:
            log.info("retired %s (left the %d-date window)", r.date, saved.window)

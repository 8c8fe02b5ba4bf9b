"""Garbage collection of retired shard files and of superseded generation snapshots.

A snapshot ``generations/<N>.json`` is kept while it is the newest, while a live reader lease
names ``N`` or an older generation (that reader may be about to open a newer one: e.g. the
generation its dist_sync workers agree on next), or while it was superseded less than
``grace_s`` ago. A snapshot numbered past the manifest's generation (or any, in a store with no
manifest) was left by a writer killed before it published it, and is removed. A retired shard's
files are deleted once it has been retired for ``grace_s``, no live lease names a generation that
still listed it, and no kept snapshot lists them. The manifest then drops them (generation + 1).
Every name is checked to be a plain file name inside the store when the manifest is read: nothing
outside the store is ever unlinked.

``collect`` is written once for every kind of store (the rules are ``kept_snapshots`` and ``sweep``):
under the store's ``publishing()`` lock and the writer's lock (checked before each deletion).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
from dataclasses import replace
from typing import Callable, Optional, Union

from shardgen.clock import seconds_since, utc_datetime
from shardgen.errors import ManifestError
from shardgen.store import Store, open_store
from shardgen.store.manifest import Manifest, RetiredEntry
from shardgen.store.naming import MANIFEST_NAME, snapshot_name
from shardgen.store.writer_lock import WriterLockLike

__all__ = ["collect", "deletable", "kept_snapshots", "sweep", "entry_files"]

log = logging.getLogger(__name__)


def _age_s(entry: RetiredEntry, now: dt.datetime) -> float:
    return seconds_since(entry.retired_at, now)


def deletable(entry: RetiredEntry, live: list[int], grace_s: float, now: dt.datetime) -> bool:
    """Past its grace period, and no live lease reads a generation that listed it."""
    if _age_s(entry, now) < grace_s:
        return False
    if entry.retired_generation <= 0:  # unknown: any live reader might use it
        return not live
    return all(g >= entry.retired_generation for g in live)


def kept_snapshots(numbers: list[int], manifest: Manifest, live: list[int], grace_s: float, now: dt.datetime,
                   load: Callable[[int], Manifest]) -> tuple[list[int], list[int]]:
    """(kept, removable) of the snapshot generations ``numbers``, by the rule in the module
    docstring; ``load(n)`` reads snapshot ``n``. Snapshots newer than the manifest are leftovers of
    a writer killed before it published them (every snapshot of a store with no manifest is too)."""
    published = [n for n in numbers if n <= manifest.generation]
    oldest_live = min(live) if live else None
    superseded_at = {}  # generation -> when the next published generation replaced it
    later = manifest.updated
    for n in sorted(published, reverse=True):
        superseded_at[n] = later
        try:
            later = load(n).updated or later
        except ManifestError as exc:
            log.warning("%s", exc)
    kept, gone = [], []
    for n in published:
        recent = not superseded_at[n] or seconds_since(superseded_at[n], now) < grace_s
        if n == manifest.generation or (oldest_live is not None and n >= oldest_live) or recent:
            kept.append(n)
        else:
            gone.append(n)
    gone += [n for n in numbers if n > manifest.generation]
    return kept, gone


def sweep(manifest: Manifest, kept: list[int], live: list[int], grace_s: float, now: dt.datetime,
          load: Callable[[int], Manifest]) -> tuple[list[RetiredEntry], list[RetiredEntry]]:
    """(deletable, kept) retired entries: past ``grace_s``, read by no live lease and listed by no
    kept snapshot (``load(n)`` reads snapshot ``n``; one that cannot be read keeps them all)."""
    in_use, blind = manifest.files(), False
    for n in kept:
        if n != manifest.generation:
            try:
                in_use |= load(n).files()
            except ManifestError as exc:  # what it lists is unknown: delete no retired file this time
                log.warning("%s; keeping every retired file while this snapshot is kept", exc)
                blind = True
    gone, kept_entries = [], []
    for entry in manifest.retired:
        if not blind and not in_use.intersection(entry_files(entry)) and deletable(entry, live, grace_s, now):
            gone.append(entry)
        else:
            kept_entries.append(entry)
    return gone, kept_entries


def entry_files(entry: RetiredEntry) -> list[str]:
    return [n for n in (entry.rec, entry.idx, entry.sidecar) if n]


def collect(store: Union[Store, str, os.PathLike], *, grace_s: float, lease_ttl_s: float,
            now: Optional[dt.datetime] = None, lock: Optional[WriterLockLike] = None) -> list[str]:
    """Delete what may go; returns the dates whose retired files were deleted. ``lock``: the
    store's writer lock if the caller holds it (else it is taken for this collection)."""
    store = open_store(store)
    if store.size(MANIFEST_NAME) is None and not store.snapshot_generations():
        return []
    if lock is None:
        with store.writer_lock("gc", ttl_s=lease_ttl_s) as held:
            return collect(store, grace_s=grace_s, lease_ttl_s=lease_ttl_s, now=now, lock=held)
    now = now or utc_datetime()
    with store.publishing():
        if store.size(MANIFEST_NAME) is None:  # no generation was ever published: every snapshot is a
            _remove_snapshots(store, store.snapshot_generations())  # killed first writer's leftover
            return []
        manifest = store.require_manifest()  # refuses names outside the store
        live = store.live_generations(lease_ttl_s)
        load = functools.lru_cache(None)(store.load_generation)
        kept, old_snapshots = kept_snapshots(store.snapshot_generations(), manifest, live, grace_s, now, load)
        gone, kept_entries = sweep(manifest, kept, live, grace_s, now, load)
        for entry in gone:
            lock.check()
            for name in entry_files(entry):
                store.delete(name)
            log.info("deleted retired shard %s (%s)", entry.date, entry.rec)
        if gone:
            store.save(replace(manifest, retired=tuple(kept_entries)), lock)
        _remove_snapshots(store, old_snapshots)
    return [entry.date for entry in gone]


def _remove_snapshots(store: Store, numbers: list[int]) -> None:
    for n in numbers:
        store.delete(snapshot_name(n))
        log.info("removed snapshot of generation %d", n)

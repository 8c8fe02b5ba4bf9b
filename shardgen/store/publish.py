"""Publishing into a store's manifest under the manifest lock: the rolling window, retirement,
and the version a rewritten date's files get."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from shardgen.clock import utc_now
from shardgen.errors import ConfigError, ManifestError
from shardgen.format.schema import Schema
from shardgen.store.lock import StoreLock
from shardgen.store.manifest import Manifest, RetiredEntry, ShardEntry, Sidecar
from shardgen.store.naming import MANIFEST_LOCK, MANIFEST_NAME, date_file_names, name_version, next_generation

__all__ = ["open_manifest", "publish", "apply_entries", "log_retired", "next_version", "check_sidecar", "check_schema"]

log = logging.getLogger(__name__)


def open_manifest(store: Path, schema: Schema, window: int) -> Manifest:
    """The store's manifest, or an empty generation-0 one; ConfigError if the schema differs."""
    path = Path(store) / MANIFEST_NAME
    if not path.exists():
        return Manifest(schema=schema, window=window)
    return check_schema(Manifest.load(path), schema, str(path))


def check_schema(manifest: Manifest, schema: Schema, where: str) -> Manifest:
    """``manifest`` if it holds ``schema``; ConfigError otherwise."""
    if manifest.schema.fingerprint != schema.fingerprint:
        raise ConfigError(
            f"{where}: the store holds schema {manifest.schema.fingerprint} but the config gives "
            f"{schema.fingerprint}; use a new store.dir for a new schema")
    return manifest


def publish(store: Path, schema: Schema, window: int, entries: Iterable[ShardEntry]) -> Optional[Manifest]:
    """Add or replace shards under the manifest lock, apply the window; the new manifest or None."""
    store = Path(store)
    with StoreLock(store / MANIFEST_LOCK, what="manifest"):
        old = open_manifest(store, schema, window)
        new = apply_entries(old, entries, window, generation=next_generation(store, old))
        if new is None:
            return None
        saved = new.save(store / MANIFEST_NAME)
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


def next_version(store: Path, date: dt.date) -> int:
    """A version of ``date``'s shard files that no file on disk, in the manifest or in its
    retired list uses: a rewrite never touches a published file."""
    store, day = Path(store), date.isoformat()
    names = date_file_names(store, date)
    try:
        m = Manifest.load(store / MANIFEST_NAME)
        names += [e.rec for e in (*m.shards, *m.retired) if e.date == day]
    except ManifestError:
        pass
    return max((name_version(n) for n in names), default=0) + 1


def check_sidecar(store: Path, sidecar: Sidecar, fingerprint: str) -> Optional[str]:
    """Why a shard described by its sidecar is not usable, or None if sizes and schema match."""
    if sidecar.fingerprint != fingerprint:
        return f"schema fingerprint {sidecar.fingerprint}, expected {fingerprint}"
    for name, size in ((sidecar.rec, sidecar.bytes), (sidecar.idx, sidecar.idx_bytes)):
        try:
            actual = (Path(store) / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, expected {size}"
    return None

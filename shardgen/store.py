"""A shard store on disk: publishing into the manifest (rolling window), verify and status."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from .clock import seconds_since, utc_datetime, utc_now
from .errors import ConfigError, ManifestError, ShardError
from .frames import check_shard
from .layout import Schema
from .lock import StoreLock
from .manifest import Manifest, RetiredEntry, ShardEntry, Sidecar
from .naming import (
    MANIFEST_LOCK,
    MANIFEST_NAME,
    date_file_names,
    name_version,
    next_generation,
    snapshot_generations,
    snapshot_path,
)
from .watchstate import load_state

__all__ = ["open_manifest", "publish", "verify_shard", "verify_store", "status",
           "check_sidecar", "next_version"]

log = logging.getLogger(__name__)


def open_manifest(store: Path, schema: Schema, window: int) -> Manifest:
    """The store's manifest, or an empty generation-0 one; ConfigError if the schema differs."""
    path = Path(store) / MANIFEST_NAME
    if not path.exists():
        return Manifest(schema=schema, window=window)
    manifest = Manifest.load(path)
    if manifest.schema.fingerprint != schema.fingerprint:
        raise ConfigError(
            f"{path}: the store holds schema {manifest.schema.fingerprint} but the config gives "
            f"{schema.fingerprint}; use a new store.dir for a new schema")
    return manifest


def publish(store: Path, schema: Schema, window: int, entries: Iterable[ShardEntry]) -> Optional[Manifest]:
    """Add or replace shards under the manifest lock, apply the window; the new manifest or None."""
    store = Path(store)
    entries = list(entries)
    with StoreLock(store / MANIFEST_LOCK, what="manifest"):
        old = open_manifest(store, schema, window)
        now, generation = utc_now(), next_generation(store, old)
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
        saved = new.save(store / MANIFEST_NAME)
    for r in saved.retired:
        if r.retired_generation == saved.generation:
            log.info("retired %s (left the %d-date window)", r.date, window)
    return saved


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


def verify_shard(store: Path, entry: ShardEntry, schema: Schema, *, source: str = "the manifest") -> Optional[str]:
    """What is wrong with a shard (size, sha256, index, framing) against ``entry``, or None;
    ``source`` names where ``entry`` came from in the messages."""
    rec = Path(store) / entry.rec
    try:
        fd = os.open(rec, os.O_RDONLY)
    except OSError as exc:
        return f"{rec}: cannot read ({exc.strerror})"
    try:
        check_shard(fd, str(rec), str(Path(store) / entry.idx), entry, schema, verify="sha256", cache=False,
                    check_index=True)
    except ShardError as exc:
        return str(exc).replace("the manifest", source)
    finally:
        os.close(fd)
    return None


def _check_published_sidecar(store: Path, entry: ShardEntry) -> Optional[str]:
    """Whether the shard's sidecar and ``.idx`` are still what was published with it."""
    path = Path(store) / entry.sidecar if entry.sidecar else None
    try:
        sidecar = Sidecar.load(path) if path else None
    except ShardError as exc:
        return str(exc)
    if sidecar is None:
        return None  # adopted or older shards may have none; the .rec and .idx are checked anyway
    if (sidecar.records, sidecar.bytes, sidecar.sha256, sidecar.rec, sidecar.idx) != \
            (entry.records, entry.bytes, entry.sha256, entry.rec, entry.idx):
        return f"{path}: changed since publication (differs from the manifest's entry)"
    try:
        size = (Path(store) / entry.idx).stat().st_size
    except OSError as exc:
        return f"{Path(store) / entry.idx}: cannot read ({exc.strerror})"
    if size != sidecar.idx_bytes:
        return f"{Path(store) / entry.idx}: changed since publication ({size} bytes, published {sidecar.idx_bytes})"
    return None


def verify_store(store: Path) -> tuple[Manifest, list[tuple[str, str]]]:
    """Check every published shard of the manifest and of every kept snapshot (size, sha256,
    index, framing, sidecar): no published file may have changed. (date, problem) pairs."""
    store = Path(store)
    manifest = Manifest.load(store / MANIFEST_NAME)
    entries = {e.rec: e for e in manifest.shards}
    problems = []
    for generation in snapshot_generations(store):
        if generation == manifest.generation:
            continue
        try:
            snap = Manifest.load(snapshot_path(store, generation))
        except ManifestError as exc:
            problems.append(("-", str(exc)))
            continue
        for e in snap.shards:
            if entries.setdefault(e.rec, e) != e:
                problems.append((e.date, f"{snapshot_path(store, generation)}: lists {e.rec} with another "
                                         "size or sha256 than a newer generation (a published file was rewritten)"))
    for entry in sorted(entries.values(), key=lambda e: (e.date, e.rec)):
        problem = verify_shard(store, entry, manifest.schema) or _check_published_sidecar(store, entry)
        if problem:
            problems.append((entry.date, problem))
    return manifest, problems


def status(store: Path, *, today: Optional[dt.date] = None) -> dict:
    """A summary of the manifest, as ``shardgen status --json`` prints it."""
    path = Path(store) / MANIFEST_NAME
    m = Manifest.load(path)
    today = today or dt.date.today()
    age = None
    if m.updated:
        age = round(seconds_since(m.updated, utc_datetime()), 1)
    last = m.shards[-1].date if m.shards else None
    watch = load_state(store) or {}
    return {
        "manifest": str(path),
        "generation": m.generation,
        "shards": len(m.shards),
        "records": m.records,
        "windows": m.samples,
        "bytes_per_window": round(m.bytes / m.samples, 1) if m.samples else None,
        "layout": m.schema.layout.to_json(),
        "bytes": m.bytes,
        "first_date": m.shards[0].date if m.shards else None,
        "last_date": last,
        "lag_days": (today - dt.date.fromisoformat(last)).days if last else None,
        "window": m.window,
        "retired": len(m.retired),
        "format": _format_of(path),
        "snapshots": snapshot_generations(Path(store)),
        "updated": m.updated,
        "age_s": age,
        "schema": m.schema.to_json(),
        "watch_updated": watch.get("updated"),  # the watcher's last cycle (None: no watcher state)
        "failing": watch.get("failing", []),  # date, kind, attempts, error, next_retry
    }


def _format_of(path: Path) -> Optional[str]:
    """The format the manifest file on disk declares (``shardgen/1`` until the next publish)."""
    try:
        return json.loads(path.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def dumps(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, indent=1)

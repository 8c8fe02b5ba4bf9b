"""``shardgen status``: a summary of a store's manifest, and of the watcher's state.

Written once for every kind of store. The watcher's state is read by whoever knows about the
watcher (the CLI, with ``watch.state.load_state``) and summarised by ``watch_fields``: the store
does not depend on it."""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Optional, Union

from shardgen.clock import seconds_since, utc_datetime
from shardgen.store import Store, open_store
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["status", "summary", "watch_fields", "dumps"]


def status(store: Union[Store, str, os.PathLike], *, today: Optional[dt.date] = None) -> dict:
    """A summary of the manifest, as ``shardgen status --json`` prints it (with ``watch_fields``)."""
    store = open_store(store)
    data = store.manifest_bytes()
    if data is None:
        raise store.no_manifest()
    where = store.where(MANIFEST_NAME)
    return summary(Manifest.parse(data, where), where, _format_of(data), store.snapshot_generations(), today=today)


def summary(m: Manifest, where: str, fmt: Optional[str], snapshots: list[int], *,
            today: Optional[dt.date] = None) -> dict:
    """The summary of manifest ``m`` (read from ``where``, declaring format ``fmt``)."""
    today = today or dt.date.today()
    age = None
    if m.updated:
        age = round(seconds_since(m.updated, utc_datetime()), 1)
    last = m.shards[-1].date if m.shards else None
    return {
        "manifest": where,
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
        "format": fmt,
        "snapshots": snapshots,
        "updated": m.updated,
        "age_s": age,
        "schema": m.schema.to_json(),
    }


def watch_fields(state: Optional[dict]) -> dict:
    """The watcher's part of the summary, from the state it wrote (None: no watcher state)."""
    state = state or {}
    return {
        "watch_updated": state.get("updated"),  # the watcher's last cycle (None: no watcher state)
        "failing": state.get("failing", []),  # date, kind, attempts, error, next_retry
    }


def _format_of(data: bytes) -> Optional[str]:
    """The format the manifest file declares (``shardgen/1`` until the next publish)."""
    try:
        return json.loads(data).get("format")
    except (ValueError, AttributeError):
        return None


def dumps(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, indent=1)

"""``shardgen status``: a summary of a store's manifest, and of the watcher's state (``print_text``:
the lines it prints).

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
from shardgen.store.build_state import build_fields, load_build_state
from shardgen.store.manifest import Manifest, declared_format
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.verify import newest_snapshot_problem

__all__ = ["status", "summary", "watch_fields", "dumps", "print_text"]


def status(store: Union[Store, str, os.PathLike], *, today: Optional[dt.date] = None) -> dict:
    """A summary of the manifest, as ``shardgen status --json`` prints it (with ``watch_fields``).
    ``snapshot_problem`` says what is wrong with the snapshot of the manifest's generation (the one
    a reader pinned to it opens), or is None; ``shardgen verify`` checks every published file.
    ``build_failing`` and ``empty``: the dates builds run on their own failed or found empty
    (:mod:`shardgen.store.build_state`), less those published since."""
    store = open_store(store)
    data = store.manifest_bytes()
    if data is None:
        raise store.no_manifest()
    where = store.where(MANIFEST_NAME)
    manifest, fmt = Manifest.parse(data, where), declared_format(data)
    info = summary(manifest, where, fmt, store.snapshot_generations(), today=today)
    info["snapshot_problem"] = newest_snapshot_problem(store, manifest, fmt)
    info.update(build_fields(load_build_state(store), {e.date for e in (*manifest.shards, *manifest.retired)}))
    return info


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
        "watch_error": state.get("error"),  # why its last cycle failed as a whole (a refused schema), or None
        "failing": state.get("failing", []),  # date, kind, attempts, error, next_retry
    }


def dumps(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, indent=1)


def print_text(info: dict) -> None:
    """Print ``info`` as ``shardgen status`` does without ``--json``: ``status`` and ``watch_fields``,
    with the CLI's ``watcher``, ``newest_raw`` and ``raw_lag_days``."""
    mb = info["bytes"] / 1e6
    per = f"{info['bytes_per_window']} bytes per window, " if info["windows"] else ""
    print(f"{info['manifest']}: generation {info['generation']}, {info['shards']} shards, "
          f"{info['windows']} windows, {mb:.1f} MB ({per}layout {info['layout']['kind']})")
    dates = (f"dates {info['first_date']} .. {info['last_date']} (lag {info['lag_days']} days)" if info["shards"]
             else "no dates")
    print(f"{dates}, window {info['window']}, retired {info['retired']}, updated {info['age_s']}s ago")
    snaps = info["snapshots"]
    print(f"snapshots kept: {len(snaps)}" + (f" (generations {', '.join(map(str, snaps))})" if snaps else "")
          + f", format {info['format']}")
    print(f"newest raw file {info['newest_raw']} (lag {info['raw_lag_days']} days)" if info["newest_raw"]
          else "no raw file")
    w = info["watcher"]
    if info["watch_updated"] or w["pid"] is not None:
        who = f"pid {w['pid']} on {w['host']}, " if w["pid"] is not None else ""
        state = (f"alive ({who}heartbeat {w['heartbeat_age_s']:.0f}s ago)" if w["alive"]
                 else f"NOT RUNNING ({who}{w['why']})")
        last = f"last cycle {info['watch_updated']}" if info["watch_updated"] else "no cycle finished yet"
        failing = sum(f["kind"] != "build" for f in info["failing"])
        print(f"watcher: {state}; {last}, {failing} failing dates")
    if info.get("watch_error"):
        print(f"watcher: last cycle FAILED, no date was tried: {info['watch_error']}")
    if info.get("build_updated"):
        failing = sum(f["kind"] == "build" for f in info["failing"])
        print(f"build: last recorded {info['build_updated']}, {failing} failing dates, {len(info['empty'])} empty")
    for f in info["failing"]:
        retry = (f"next retry {f['next_retry']}" if f["next_retry"] else "tried again by the next build"
                 if f["kind"] == "build" else "retried when the file changes")
        tries = f"{f['attempts']} attempt" + ("s" if f["attempts"] != 1 else "")
        print(f"failing {f['date']} ({f['kind']}, {tries}, {retry}): {f['error']}")
    for e in info.get("empty", []):
        print(f"empty {e['date']}: {e['error']}")

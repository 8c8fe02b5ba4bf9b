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

from shardgen.clock import parse_utc, seconds_since, utc_datetime
from shardgen.store import Store, open_store
from shardgen.store.build_state import build_fields, load_build_state
from shardgen.store.manifest import Manifest, declared_format
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.verify import newest_snapshot_problem

__all__ = ["status", "summary", "watch_fields", "settle", "dumps", "print_text"]


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
        "watch_error_generation": state.get("generation"),  # the manifest's generation then (None: unknown)
        "failing": state.get("failing", []),  # date, kind, attempts, error, next_retry
    }


def _after(later: Optional[str], earlier: Optional[str]) -> bool:
    """Whether the stamp ``later`` is after ``earlier`` (False if either is missing or unreadable)."""
    try:
        return bool(later and earlier) and parse_utc(later) > parse_utc(earlier)
    except ValueError:
        return False


def settle(info: dict, first: dt.date, last: dt.date) -> int:
    """Join the watcher's failing dates and the builds' (``build_failing``) in ``info["failing"]``, less
    the build's dates outside the configured ``first`` .. ``last`` (no build tries them again: they go
    to ``build_outside``, not counted); mark a watcher's error a later publish superseded
    (``watch_error_superseded``: a later generation was published than the refused cycle saw). The exit code of
    ``shardgen status``: 1 while dates fail, the watcher's last cycle failed as a whole (a refused
    schema) and nothing was published since, or the newest snapshot is damaged."""
    builds = info.pop("build_failing")
    inside = [f for f in builds if first.isoformat() <= f["date"] <= last.isoformat()]
    info["build_outside"] = [f for f in builds if f not in inside]
    info["failing"] = info["failing"] + inside
    then = info.get("watch_error_generation")
    later = (info["generation"] > then if isinstance(then, int) and not isinstance(then, bool)
             else _after(info["updated"], info["watch_updated"]))  # a watcher before the generation was noted
    info["watch_error_superseded"] = bool(info["watch_error"]) and later
    current_error = info["watch_error"] and not info["watch_error_superseded"]
    return 1 if info["failing"] or current_error or info["snapshot_problem"] else 0


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
    if info.get("watch_error") and info.get("watch_error_superseded"):
        print(f"watcher: its last cycle ({info['watch_updated']}) failed, no date was tried, but the manifest was "
              f"published since ({info['updated']}): {info['watch_error']}")
    elif info.get("watch_error"):
        print(f"watcher: last cycle FAILED, no date was tried: {info['watch_error']} ({info['watch_updated']})")
    if info.get("build_updated"):
        failing = sum(f["kind"] == "build" for f in info["failing"])
        print(f"build: last recorded {info['build_updated']}, {failing} failing dates, {len(info['empty'])} empty")
    for f in info["failing"]:
        retry = (f"next retry {f['next_retry']}" if f["next_retry"] else "tried again by the next build"
                 if f["kind"] == "build" else "retried when the file changes")
        tries = f"{f['attempts']} attempt" + ("s" if f["attempts"] != 1 else "")
        print(f"failing {f['date']} ({f['kind']}, {tries}, {retry}): {f['error']}")
    for f in info.get("build_outside", []):
        print(f"failed {f['date']} (build, outside the configured dates now: no build tries it again): {f['error']}")
    for e in info.get("empty", []):
        print(f"empty {e['date']}: {e['error']}")

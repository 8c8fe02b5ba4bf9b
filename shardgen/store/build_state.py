"""The dates a build run on its own could not publish, ``<store>/.build-state.json``: read by
``shardgen status``, as the watcher's ``.watch-state.json`` is (a cron ``build`` + ``status``
monitor sees the gaps)::

    {"format": "shardgen-build/1", "updated": "2026-01-01T00:00:00Z",
     "failing": [{"date": "2024-01-03", "attempts": 2, "error": "2024-01-03: generator exited with code 3",
                  "updated": "2026-01-01T00:00:00Z"}],
     "empty": [{"date": "2024-01-05", "error": "2024-01-05: 3 rows, fewer than time_steps=5: no windows ...",
                "updated": "2026-01-01T00:00:00Z"}]}

Each build (holding the writer lock) updates it: a date it published leaves both lists, a date that
failed joins ``failing`` (attempts counted across builds), a date found empty joins ``empty``. What
a later writer published (a watcher, an adopting build) is no longer listed: ``build_fields`` drops
the dates the manifest holds.
"""

from __future__ import annotations

import json
import logging
from typing import Iterable, Optional

from shardgen.errors import ShardgenError
from shardgen.store.base import Store

__all__ = ["BUILD_STATE", "FORMAT", "record_build", "load_build_state", "build_fields"]

log = logging.getLogger(__name__)
BUILD_STATE = ".build-state.json"
FORMAT = "shardgen-build/1"


def load_build_state(store: Store) -> Optional[dict]:
    """What the last builds recorded, or None (no build recorded anything, or it is unreadable:
    with a warning)."""
    where = store.where(BUILD_STATE)
    try:
        data = store.read(BUILD_STATE)
        doc = json.loads(data) if data is not None else None
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable build state (%s)", where, exc)
        return None
    if doc is not None and (not isinstance(doc, dict) or doc.get("format") != FORMAT):
        log.warning("%s: unknown build state format", where)
        return None
    problem = _problem(doc) if doc is not None else None
    if problem:
        log.warning("%s: unreadable build state (%s)", where, problem)
        return None
    return doc


def _problem(doc: dict) -> Optional[str]:
    """What is wrong with the fields of a build state of the right format, or None."""
    for key, fields in (("failing", ("date", "error", "updated")), ("empty", ("date", "error", "updated"))):
        entries = doc.get(key, [])
        if not isinstance(entries, list):
            return f"{key!r} is {type(entries).__name__}, expected a list"
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("date"), str):
                return f"{key!r} holds {json.dumps(entry)[:60]}, expected an object with a \"date\""
            bad = [f for f in fields if f in entry and not isinstance(entry[f], str)]
            attempts = entry.get("attempts", 1)
            if key == "failing" and (not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1):
                bad.append("attempts")
            if bad:
                return f"{key!r} entry {entry['date']}: bad {', '.join(bad)}"
    if not isinstance(doc.get("updated", ""), (str, type(None))):
        return "'updated' is not a time"
    return None


def record_build(store: Store, *, updated: str, published: Iterable, failed: Iterable[tuple],
                 empty: Iterable[tuple]) -> Optional[dict]:
    """Note one build's outcome (dates: ``datetime.date``; ``failed``/``empty``: ``(date, message)``)
    in the build state; the state written, or None when nothing changed or it cannot be written (a
    warning: the build's own exit code still says it)."""
    before = load_build_state(store) or {}
    failing = {f["date"]: f for f in before.get("failing", [])}
    blank = {e["date"]: e for e in before.get("empty", [])}
    for date in published:
        failing.pop(date.isoformat(), None)
        blank.pop(date.isoformat(), None)
    for date, message in failed:
        day = date.isoformat()
        attempts = failing.get(day, {}).get("attempts", 0) + 1
        failing[day] = {"date": day, "attempts": attempts, "error": message, "updated": updated}
        blank.pop(day, None)
    for date, message in empty:
        day = date.isoformat()
        blank[day] = {"date": day, "error": f"{day}: {message}", "updated": updated}
        failing.pop(day, None)
    doc = {"format": FORMAT, "updated": updated, "failing": sorted(failing.values(), key=lambda f: f["date"]),
           "empty": sorted(blank.values(), key=lambda e: e["date"])}
    if {k: v for k, v in doc.items() if k != "updated"} == {k: before.get(k) for k in doc if k != "updated"}:
        return None  # said already: a build that changed nothing writes nothing
    try:
        store.write(BUILD_STATE, json.dumps(doc, sort_keys=True, indent=1).encode(), durable=False)
    except (OSError, ShardgenError) as exc:
        log.warning("%s: cannot write the build state (%s); status will not list this build's dates",
                    store.where(BUILD_STATE), exc)
        return None
    return doc


def build_fields(state: Optional[dict], listed: set) -> dict:
    """The build's part of ``shardgen status``: its failing dates (as the watcher's are listed:
    ``kind`` ``build``, retried by the next build) and its empty dates, less the dates in ``listed``
    (published or retired meanwhile)."""
    state = state or {}
    failing = [{"date": f["date"], "kind": "build", "attempts": f.get("attempts", 1), "error": f.get("error", ""),
                "next_retry": None} for f in state.get("failing", []) if f.get("date") not in listed]
    empty = [{"date": e["date"], "error": e.get("error", "")} for e in state.get("empty", [])
             if e.get("date") not in listed]
    return {"build_updated": state.get("updated"), "build_failing": failing, "empty": empty}

"""The watcher's state file ``<store>/.watch-state.json``: which dates are failing and why.

Written atomically by ``shardgen watch`` after every cycle, read by ``shardgen status``::

    {"format": "shardgen-watch/1", "updated": "2026-01-01T00:00:00Z", "pid": 123,
     "error": null, "failing": [{"date": "2024-01-02", "kind": "due", "attempts": 2,
                  "error": "2024-01-02: raw/2024-01-02.npy: not a readable .npy array (...)",
                  "next_retry": "2026-01-01T00:00:02Z"}]}

``error`` (null while the last cycle went through) says why the last cycle failed as a whole (a
schema change refused, the store unreachable): no date was even tried. With an error, ``generation``
is the manifest's generation then (null if unknown): a later generation was published by a writer
that passed (a build after the config was reverted), and status no longer counts the error.
``kind`` is ``due`` (a date the watcher generates: retried with backoff, ``next_retry`` set) or
``dropped`` (a raw file dropped by others for a date it does not generate: retried when the
file changes, ``next_retry`` null).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Optional, Union

from shardgen.store import Store, open_store
from shardgen.store.naming import WATCH_STATE

__all__ = ["WATCH_STATE", "FORMAT", "Failing", "state_bytes", "save_state", "load_state", "parse_state"]

log = logging.getLogger(__name__)
FORMAT = "shardgen-watch/1"


@dataclass(frozen=True)
class Failing:
    date: str
    kind: str  # "due" | "dropped"
    attempts: int
    error: str
    next_retry: Optional[str]  # UTC, or None: when the dropped file changes


def state_bytes(*, updated: str, pid: int, failing: list[Failing], error: Optional[str] = None,
                generation: Optional[int] = None) -> bytes:
    """The state file's bytes."""
    doc = {"format": FORMAT, "updated": updated, "pid": pid, "error": error, "generation": generation,
           "failing": [asdict(f) for f in sorted(failing, key=lambda f: f.date)]}
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def save_state(store: Union[Store, str, os.PathLike], *, updated: str, pid: int, failing: list[Failing],
               error: Optional[str] = None, generation: Optional[int] = None) -> bytes:
    """Write the state file into the store; its bytes."""
    data = state_bytes(updated=updated, pid=pid, failing=failing, error=error, generation=generation)
    open_store(store).put_state(data)
    return data


def load_state(store: Union[Store, str, os.PathLike]) -> Optional[dict]:
    """The last state a watcher wrote, or None (no watcher ran, or the file is unreadable)."""
    store = open_store(store)
    try:
        data = store.get_state()
    except OSError as exc:
        log.warning("%s: unreadable watcher state (%s)", store.where(WATCH_STATE), exc)
        return None
    return parse_state(data, store.where(WATCH_STATE))


def parse_state(data: Optional[bytes], where: str) -> Optional[dict]:
    """The state from its bytes (None: none, or unreadable, with a warning)."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError as exc:
        log.warning("%s: unreadable watcher state (%s)", where, exc)
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        log.warning("%s: unknown watcher state format %r", where, doc.get("format") if isinstance(doc, dict) else None)
        return None
    return doc

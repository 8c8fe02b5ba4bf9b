"""Whether a watcher is alive: its heartbeat ``<store>/.watch-heartbeat.json``, for ``shardgen status``.

A running watcher keeps the file fresh every ``store.lease_ttl_s / 6`` from a thread, as a reader
keeps its lease (:mod:`shardgen.store.lease_file`: the same ``{"generation", "host", "pid", "pidns",
"boot_id"}``, generation 0; its mtime or Last-Modified is the heartbeat), and removes it when it
stops. ``status`` judges it by the rule gc applies to a lease (``why_dead``): dead when it has not
beaten for ``store.lease_ttl_s`` by the store's own clock -- so a ``status`` on another host judges
it by age alone -- or, on the watcher's own host, pid namespace and boot, when its pid is gone
(``kill -9``). No file: the watcher stopped, or none ever ran.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

from shardgen.errors import ShardgenError
from shardgen.store import Store
from shardgen.store.lease_file import why_dead
from shardgen.store.naming import WATCH_HEARTBEAT

__all__ = ["WATCH_HEARTBEAT", "WatcherHeartbeat", "watcher_status"]

log = logging.getLogger(__name__)


class WatcherHeartbeat:
    """The watcher's heartbeat file, kept fresh from ``start()`` to ``stop()``."""

    def __init__(self, store: Store, *, ttl_s: float):
        self.refresh_s = ttl_s / 6
        self._beat = store.heartbeat(WATCH_HEARTBEAT)
        self._beat.what, self._beat.unseen = "watcher heartbeat", "status cannot tell that this watcher runs"
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._beat.generation = 0  # it reads no generation: it only says who runs, and that it does
        self._beat.write()
        self._thread = threading.Thread(target=self._run, name="shardgen-watch-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._beat.stop.wait(self.refresh_s):
            self._beat.beat()

    def stop(self) -> None:
        """The watcher stops: the thread ends, the file is removed."""
        self._beat.release()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None


def watcher_status(store: Store, ttl_s: float) -> dict:
    """``status --json``'s ``watcher``: ``alive``, the ``pid`` and ``host`` of the last watcher that
    ran, its ``heartbeat_age_s`` by the store's clock, and ``why`` it is not alive (else None)."""
    where = store.where(WATCH_HEARTBEAT)
    found = store.read_with_mtime(WATCH_HEARTBEAT)
    if found is None:
        return {"alive": False, "pid": None, "host": None, "heartbeat_age_s": None,
                "why": "no heartbeat file (stopped, or never started)"}
    data, mtime = found
    try:
        now = store.clock()
    except (OSError, ShardgenError) as exc:  # an object store we may not write to
        log.warning("%s: cannot read the store's clock (%s); judging by this host's clock", where, exc)
        now = time.time()
    age = now - mtime
    try:
        info = json.loads(data)
        pid = int(info["pid"])
    except (ValueError, KeyError, TypeError):
        return {"alive": False, "pid": None, "host": None, "heartbeat_age_s": round(age, 1),
                "why": f"{where}: unreadable"}
    why = why_dead(info, age, ttl_s)
    return {"alive": why is None, "pid": pid, "host": info.get("host"), "heartbeat_age_s": round(age, 1), "why": why}

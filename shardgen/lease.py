"""Reader leases: a reader mid-epoch says which manifest generation it reads, so garbage
collection never deletes a shard under it.

A lease is ``<store>/leases/<host>-<pid>-<random>.json`` holding ``{"generation", "host", "pid"}``;
its mtime is its heartbeat, refreshed by a daemon thread while the epoch runs and removed when it
ends. A lease is dead when its mtime is older than the TTL, or when its process is gone on this
host. Readers never need write access to read a store: if the lease cannot be written, reading
goes on and a warning says that gc cannot see this reader.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from .fsutil import HOST_TOKEN, atomic_write, pid_alive

__all__ = ["LEASE_DIR", "DEFAULT_TTL_S", "Lease", "live_lease_generations"]

log = logging.getLogger(__name__)
LEASE_DIR = "leases"
DEFAULT_TTL_S = 60.0
_HOST = socket.gethostname()


class Lease:
    """Holds one lease file naming a generation; ``renew(generation)``, ``release()``."""

    def __init__(self, store: Path, *, refresh_s: float = DEFAULT_TTL_S / 6):
        self.path = Path(store) / LEASE_DIR / f"{HOST_TOKEN}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self.refresh_s = refresh_s
        self.generation: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._warned = False

    def renew(self, generation: int) -> None:
        """Hold a lease on ``generation`` from now on (and keep it fresh)."""
        self.generation = generation
        try:
            self.path.parent.mkdir(exist_ok=True)
            atomic_write(self.path, json.dumps({"generation": generation, "host": _HOST,
                                                "pid": os.getpid()}).encode(), fsync=False)
        except OSError as exc:
            if not self._warned:
                log.warning("%s: cannot write a reader lease (%s); gc cannot see this reader", self.path, exc)
                self._warned = True
            return
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="shardgen-lease", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        self.generation = None
        try:
            self.path.unlink()
        except OSError:
            pass

    def __del__(self) -> None:
        self.release()


def live_lease_generations(store: Path, ttl_s: float, *, now: Optional[float] = None,
                           remove_dead: bool = True) -> list[int]:
    """Generations named by live leases of the store; dead leases are removed."""
    folder = Path(store) / LEASE_DIR
    now = time.time() if now is None else now
    live = []
    if not folder.is_dir():
        return live
    for path in folder.glob("*.json"):
        try:
            age = now - path.stat().st_mtime
            info = json.loads(path.read_text())
            generation, host, pid = int(info["generation"]), info["host"], int(info["pid"])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s: unreadable lease; counting it as live until it is %gs old", path, ttl_s)
            if age <= ttl_s:
                live.append(-1)  # protects everything
            continue
        dead = age > ttl_s or (host == _HOST and not pid_alive(pid))
        if dead:
            log.info("ignoring dead reader lease %s (generation %d)", path.name, generation)
            if remove_dead:
                path.unlink(missing_ok=True)
        else:
            live.append(generation)
    return live

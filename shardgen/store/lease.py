"""Reader leases: a reader mid-epoch says which manifest generation it reads, so garbage
collection never deletes a shard under it.

A lease is ``<store>/leases/<host token>-<pid>-<random>.json`` holding ``{"generation", "host",
"pid", "pidns", "boot_id"}``; its mtime is its heartbeat, refreshed by a daemon thread (which writes
the file again if someone deleted it) and removed when the epoch ends or the lease is garbage
collected. A lease is dead when

* its heartbeat is older than the TTL, measured against the store filesystem's own clock (gc
  touches ``<store>/leases/.clock`` and compares mtimes with that, never with this host's clock:
  hosts sharing a filesystem may disagree about the time), or
* it names this host, this pid namespace and this boot, and its pid is gone. A pid from another pid
  namespace (a container sharing the hostname) means nothing here: only the heartbeat counts then.

Readers never need write access to read a store: if the lease cannot be written, reading goes on
and a warning says that gc cannot see this reader.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Optional

from shardgen.fsutil import atomic_write, boot_id, pid_alive, pid_namespace
from shardgen.store.naming import CLOCK_NAME, LEASE_DIR, new_lease_name

__all__ = ["LEASE_DIR", "DEFAULT_TTL_S", "Lease", "live_lease_generations", "judge_lease", "store_clock"]

log = logging.getLogger(__name__)
DEFAULT_TTL_S = 60.0
_HOST = socket.gethostname()
_PIDNS = pid_namespace()
_BOOT = boot_id()


class _Heartbeat:
    """What the heartbeat thread needs, without a reference to the Lease (which it must not keep alive)."""

    def __init__(self, path: Path):
        self.path = path
        self.generation: Optional[int] = None
        self.stop = threading.Event()
        self.lock = threading.RLock()  # orders a beat against release: a released lease is never rewritten
        self.warned = False
        self.written: Optional[int] = None  # the generation the lease last said

    def present(self) -> bool:
        """Whether the lease file is still there (one ``stat``): someone may have deleted it."""
        return self.path.exists()

    def write(self) -> bool:
        """Write the lease file (again); False, with one warning, if it cannot be written."""
        try:
            self.path.parent.mkdir(exist_ok=True)
            atomic_write(self.path, self.text(), fsync=False)
            self.written = self.generation
        except OSError as exc:
            if not self.warned:
                log.warning("%s: cannot write a reader lease (%s); gc cannot see this reader", self.path, exc)
                self.warned = True
            return False
        return True

    def text(self) -> bytes:
        """What the lease holds: the generation and who reads it."""
        return json.dumps({"generation": self.generation, "host": _HOST, "pid": os.getpid(), "pidns": _PIDNS,
                           "boot_id": _BOOT}, sort_keys=True).encode()

    def beat(self) -> None:
        with self.lock:
            if self.stop.is_set() or self.generation is None:  # released meanwhile
                return
            try:
                os.utime(self.path)  # None: the file server's "now", like gc's clock file
            except FileNotFoundError:
                log.warning("%s: reader lease was deleted; writing it again", self.path)
                self.write()
            except OSError as exc:
                if not self.warned:
                    log.warning("%s: cannot refresh a reader lease (%s)", self.path, exc)
                    self.warned = True

    def release(self) -> None:
        with self.lock:
            self.stop.set()
            self.generation = None
            try:
                self.path.unlink()
            except OSError:
                pass


class _RemoteHeartbeat(_Heartbeat):
    """A lease object in an object store: writing it again is its heartbeat (its Last-Modified)."""

    def __init__(self, remote, name: str):
        super().__init__(Path(name))
        self.remote, self.name = remote, name

    def write(self) -> bool:
        from shardgen.store.objstore import ObjectStoreError

        try:
            self.remote.put(self.name, self.text(), verify=False)
            self.written = self.generation
        except ObjectStoreError as exc:
            if not self.warned:
                log.warning("%s: cannot write a reader lease (%s); gc cannot see this reader",
                            self.remote.where(self.name), exc)
                self.warned = True
            return False
        return True

    def present(self) -> bool:
        return True  # a HEAD request per reset() is not worth it: the heartbeat writes the object again

    def beat(self) -> None:
        with self.lock:
            if not self.stop.is_set() and self.generation is not None:
                self.write()

    def release(self) -> None:
        from shardgen.store.objstore import ObjectStoreError

        with self.lock:
            self.stop.set()
            self.generation = None
            with contextlib.suppress(ObjectStoreError):
                self.remote.delete(self.name)


def _beat_until_gone(owner: weakref.ref, state: _Heartbeat, stop: threading.Event, refresh_s: float) -> None:
    while not stop.wait(refresh_s):
        if owner() is None:  # the Lease was dropped without release(): its finalizer cleans up
            return
        state.beat()


class Lease:
    """Holds one lease file naming a generation; ``renew(generation)``, ``release()``.

    The heartbeat thread holds only a weak reference: dropping the last reference to a Lease
    (``del lease``) removes its file and ends the thread.
    """

    def __init__(self, store, *, refresh_s: float = DEFAULT_TTL_S / 6):
        """``store``: a store folder, or an ``ObjectStore`` (the lease is then an object there)."""
        self.refresh_s = refresh_s
        if hasattr(store, "put"):  # an ObjectStore
            name = f"{LEASE_DIR}/{new_lease_name()}"
            self.path = Path(store.where(name))
            self._state: _Heartbeat = _RemoteHeartbeat(store, name)
        else:
            self.path = Path(store) / LEASE_DIR / new_lease_name()
            self._state = _Heartbeat(self.path)
        self._thread: Optional[threading.Thread] = None
        weakref.finalize(self, _Heartbeat.release, self._state)

    @property
    def generation(self) -> Optional[int]:
        return self._state.generation

    def renew(self, generation: int) -> None:
        """Hold a lease on ``generation`` from now on (and keep it fresh)."""
        state = self._state
        with state.lock:
            if (generation == state.generation == state.written and self._thread is not None
                    and self._thread.is_alive() and not state.stop.is_set() and state.present()):
                return  # said already and still there, kept fresh by the heartbeat: one stat, no write,
                # on the trainer's reset() each epoch
            state.generation = generation
            if not state.write():
                return
            if self._thread is not None and not state.stop.is_set():
                return  # the running heartbeat keeps this one fresh
            state.stop = threading.Event()  # a released lease's old thread keeps its own (set) event
            self._thread = threading.Thread(target=_beat_until_gone,
                                            args=(weakref.ref(self), state, state.stop, self.refresh_s),
                                            name="shardgen-lease", daemon=True)
            self._thread.start()

    def release(self) -> None:
        self._state.release()


def store_clock(store: Path) -> float:
    """"Now" by the store filesystem's clock: the mtime of a file we just touched there
    (falls back to this host's clock, with a warning, if the store is read-only)."""
    clock = Path(store) / LEASE_DIR / CLOCK_NAME
    try:
        clock.touch()  # creates it, or utime(None): the file server sets its own "now"
        return clock.stat().st_mtime
    except OSError as exc:
        log.warning("%s: cannot touch the store clock (%s); judging lease ages by this host's clock", clock, exc)
        return time.time()


def _pid_is_checkable(info: dict) -> bool:
    """Whether the lease's pid is a pid of this host, pid namespace and boot."""
    return (info.get("host") == _HOST and bool(_PIDNS) and info.get("pidns") == _PIDNS
            and bool(_BOOT) and info.get("boot_id") == _BOOT)


def judge_lease(where: str, age: Optional[float], text: Optional[bytes], ttl_s: float
                ) -> tuple[Optional[int], Optional[str]]:
    """What one lease (its bytes, ``age`` by the store's clock) means to gc: ``(generation, None)``
    while it is live (-1 if it is unreadable but young: it protects everything), ``(None, why)``
    when it is dead (remove it), ``(None, None)`` when it is unreadable and old (leave it)."""
    try:
        if text is None:
            raise ValueError("cannot be read")
        info = json.loads(text)
        generation, pid = int(info["generation"]), int(info["pid"])
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("%s: unreadable lease; counting it as live until it is %gs old", where, ttl_s)
        return (-1 if age is not None and age <= ttl_s else None), None
    if age > ttl_s:
        why = f"no heartbeat for {age:.0f}s"
    elif _pid_is_checkable(info) and not pid_alive(pid):
        why = f"process {pid} is gone"
    else:
        return generation, None
    log.info("ignoring dead reader lease %s (generation %d): %s", where, generation, why)
    return None, why


def live_lease_generations(store: Path, ttl_s: float, *, now: Optional[float] = None,
                           remove_dead: bool = True) -> list[int]:
    """Generations named by live leases of the store; dead leases are removed.

    ``now`` is a time by the store's clock (default: ``store_clock(store)``)."""
    folder = Path(store) / LEASE_DIR
    live: list[int] = []
    if not folder.is_dir():
        return live
    now = store_clock(store) if now is None else now
    for path in folder.glob("*.json"):
        age, text = None, None
        try:
            age = now - path.stat().st_mtime
            text = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError:
            pass
        generation, dead = judge_lease(str(path), age, text, ttl_s)
        if generation is not None:
            live.append(generation)
        elif dead and remove_dead:
            path.unlink(missing_ok=True)
    return live

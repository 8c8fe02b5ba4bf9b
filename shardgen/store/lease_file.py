"""One reader lease file: what it says, how it is kept fresh, and when gc counts it as dead.

A lease ``leases/<host token>-<pid>-<random>.json`` holds ``{"generation", "host", "pid", "pidns",
"boot_id"}``; its modification time is its heartbeat, judged by the store's own clock. A
``FileHeartbeat`` (a store folder) refreshes the mtime with ``utime`` and writes the file again if
someone deleted it; an ``ObjectHeartbeat`` (an object store) writes the object again (its
Last-Modified). ``judge_lease`` is the rule gc applies to one lease (see :mod:`shardgen.store.lease`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Optional

from shardgen.errors import ShardgenError
from shardgen.fsutil import atomic_write, boot_id, pid_alive, pid_namespace
from shardgen.store.naming import LEASE_DIR

__all__ = ["HOST", "PIDNS", "BOOT", "LEASE_DIR_MODE", "Heartbeat", "FileHeartbeat", "ObjectHeartbeat", "judge_lease",
           "why_dead", "lease_folder"]

log = logging.getLogger(__name__)
HOST = socket.gethostname()
PIDNS = pid_namespace()
BOOT = boot_id()
# ``leases/`` of a store folder: every user who reads the store may write its lease there, as in /tmp
# (sticky: a reader removes only its own leases; the store's owner -- gc -- any). Readers that run
# as another user (store files 644/755) are seen by gc only through it.
LEASE_DIR_MODE = 0o1777


def lease_folder(path: Path) -> Path:
    """Make the lease folder ``path`` (mode ``LEASE_DIR_MODE``, whatever the umask) unless it is
    there; one that only its owner may write (what versions before issue 62 made) is opened up by
    its owner. One that others may write already (a site's own group mode, 2770) is left alone."""
    try:
        path.mkdir()
        os.chmod(path, LEASE_DIR_MODE)
    except FileExistsError:
        st = path.stat()
        if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            os.chmod(path, LEASE_DIR_MODE)
    return path


class Heartbeat:
    """What the heartbeat thread needs, without a reference to the Lease (which it must not keep
    alive): the generation said, and how the lease is written, refreshed and removed."""

    what = "reader lease"  # for messages: what it is, what its loss means
    unseen = ("gc cannot see this reader: only store.grace_s protects what it reads (a retired shard, a superseded "
              "snapshot are deleted that long after they leave the manifest, even while this reader still reads "
              "them); to be seen, it needs write access to the store's leases/ folder (docs/reliability.md, "
              "readers without write access)")

    def __init__(self, where: str):
        self.where = where
        self.generation: Optional[int] = None
        self.stop = threading.Event()
        self.lock = threading.RLock()  # orders a beat against release: a released lease is never rewritten
        self.warned = False
        self.written: Optional[int] = None  # the generation the lease last said
        self.placed = False  # written since the last removal: release() has something to remove
        self.pid = os.getpid()  # a forked child's finalizer must not remove its parent's live lease

    def text(self) -> bytes:
        """What the lease holds: the generation and who reads it."""
        return json.dumps({"generation": self.generation, "host": HOST, "pid": os.getpid(), "pidns": PIDNS,
                           "boot_id": BOOT}, sort_keys=True).encode()

    def write(self) -> bool:
        """Write the lease (again); False, with one warning, if it cannot be written."""
        try:
            self.placed = True  # before: a write that fails after the store took it is still removed
            self.put(self.text())
            self.written = self.generation
        except (OSError, ShardgenError) as exc:
            if not self.warned:
                log.warning("%s: cannot write a %s (%s); %s", self.where, self.what, exc, self.unseen)
                self.warned = True
            return False
        return True

    def put(self, data: bytes) -> None:  # pragma: no cover - each kind's
        raise NotImplementedError

    def present(self) -> bool:
        """Whether the lease is still there, as far as one cheap look can tell."""
        return True

    def beat(self) -> None:
        """Refresh the heartbeat (unless released meanwhile)."""
        with self.lock:
            if not self.stop.is_set() and self.generation is not None:
                self.write()

    def remove(self) -> None:  # pragma: no cover - each kind's
        raise NotImplementedError

    def release(self) -> None:
        """Stop the heartbeat and remove the lease, once per placement: a Lease released and
        then garbage-collected sends no second request (a store that is gone would cost the
        collecting thread its whole retry budget again)."""
        if os.getpid() != self.pid:  # a forked child (its lock may have been held at the fork)
            return
        with self.lock:
            self.stop.set()
            self.generation = None
            if not self.placed:
                return
            self.placed = False  # one try: a lease left behind ages out (gc's lease_ttl_s)
            with contextlib.suppress(OSError, ShardgenError):
                self.remove()


class FileHeartbeat(Heartbeat):
    """A lease file in a store folder: ``utime`` is its heartbeat (the file server's "now")."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = Path(path)

    def put(self, data: bytes) -> None:
        if self.path.parent.name == LEASE_DIR:  # only leases/ is opened to every user: never the store folder
            lease_folder(self.path.parent)     # (the watcher's heartbeat lies beside the manifest)
        atomic_write(self.path, data, fsync=False)

    def present(self) -> bool:
        return self.path.exists()  # one stat: someone may have deleted it

    def beat(self) -> None:
        with self.lock:
            if self.stop.is_set() or self.generation is None:  # released meanwhile
                return
            try:
                # None: the file server's "now", like gc's clock file; a symlink planted in the
                # world-writable leases/ is not followed
                os.utime(self.path, follow_symlinks=False)
            except FileNotFoundError:
                log.warning("%s: %s was deleted; writing it again", self.path, self.what)
                self.write()
            except OSError as exc:
                if not self.warned:
                    log.warning("%s: cannot refresh a %s (%s)", self.path, self.what, exc)
                    self.warned = True

    def remove(self) -> None:
        self.path.unlink()


class ObjectHeartbeat(Heartbeat):
    """A lease object in an object store: writing it again is its heartbeat (its Last-Modified).
    ``present`` does not ask (a HEAD request per ``reset()`` is not worth it): the heartbeat
    writes the object again anyway."""

    def __init__(self, objects, name: str):
        super().__init__(objects.where(name))
        self.objects, self.name = objects, name

    def put(self, data: bytes) -> None:
        self.objects.put(self.name, data, verify=False)

    def remove(self) -> None:
        self.objects.delete(self.name)


def _pid_is_checkable(info: dict) -> bool:
    """Whether the lease's pid is a pid of this host, pid namespace and boot."""
    return (info.get("host") == HOST and bool(PIDNS) and info.get("pidns") == PIDNS
            and bool(BOOT) and info.get("boot_id") == BOOT)


def why_dead(info: dict, age: float, ttl_s: float) -> Optional[str]:
    """Why the process that keeps a heartbeat file saying ``info`` (a reader lease, the watcher's
    heartbeat) is dead, or None while it lives: no heartbeat for ``ttl_s`` by the store's clock
    (``age``), or -- for a pid of this host, pid namespace and boot -- its pid is gone."""
    if age > ttl_s:
        return f"no heartbeat for {age:.0f}s"
    if _pid_is_checkable(info) and not pid_alive(int(info["pid"])):
        return f"process {info['pid']} is gone"
    return None


def judge_lease(where: str, age: Optional[float], text: Optional[bytes], ttl_s: float
                ) -> tuple[Optional[int], Optional[str]]:
    """What one lease (its bytes, ``age`` by the store's clock) means to gc: ``(generation, None)``
    while it is live (-1 if it is unreadable but young: it protects everything), ``(None, why)``
    when it is dead (remove it), ``(None, None)`` when it is unreadable and old (leave it)."""
    try:
        if text is None:
            raise ValueError("cannot be read")
        info = json.loads(text)
        generation, _pid = int(info["generation"]), int(info["pid"])
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("%s: unreadable lease; counting it as live until it is %gs old", where, ttl_s)
        return (-1 if age is not None and age <= ttl_s else None), None
    why = why_dead(info, age, ttl_s)
    if why is None:
        return generation, None
    log.info("ignoring dead reader lease %s (generation %d): %s", where, generation, why)
    return None, why

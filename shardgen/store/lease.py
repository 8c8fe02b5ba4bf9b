"""Reader leases: a reader mid-epoch says which manifest generation it reads, so garbage
collection never deletes a shard under it.

A lease is ``<store>/leases/<host token>-<pid>-<random>.json`` holding ``{"generation", "host",
"pid", "pidns", "boot_id"}`` (:mod:`shardgen.store.lease_file`); its mtime (an object's
Last-Modified) is its heartbeat, refreshed by a daemon thread (which writes the file again if
someone deleted it) and removed when the epoch ends or the lease is garbage collected. A lease is dead when

* its heartbeat is older than the TTL, measured against the store filesystem's own clock (gc
  touches ``<store>/leases/.clock`` and compares mtimes with that, never with this host's clock:
  hosts sharing a filesystem may disagree about the time), or
* it names this host, this pid namespace and this boot, and its pid is gone. A pid from another pid
  namespace (a container sharing the hostname) means nothing here: only the heartbeat counts then.

Readers never need write access to read a store: if the lease cannot be written, reading goes on
and a warning says that gc cannot see this reader.

A process killed before it could release its lease (``kill -9``) leaves it behind. Each new lease
first removes those of this host's dead processes at once
(``remove_dead_leases_of_this_host``: the lease name carries ``HOST_TOKEN`` and the pid); any other
lease waits for gc and its TTL.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Optional, Union

from shardgen.errors import ShardgenError
from shardgen.fsutil import HOST_TOKEN, pid_alive
from shardgen.offthread import OffThread
from shardgen.store import Store, open_store
from shardgen.store.lease_file import Heartbeat, judge_lease
from shardgen.store.naming import LEASE_DIR, lease_pid_of_this_host, new_lease_name
from shardgen.store.objstore import ObjectStore

__all__ = ["LEASE_DIR", "DEFAULT_TTL_S", "Lease", "live_lease_generations", "judge_lease", "store_clock",
           "remove_dead_leases_of_this_host"]

log = logging.getLogger(__name__)
DEFAULT_TTL_S = 60.0


def remove_dead_leases_of_this_host(store: Store) -> list[str]:
    """Remove the leases of dead processes of this host, pid namespace and boot (their name says
    so, ``HOST_TOKEN``, and their pid is gone); the names removed. Never another process's live
    lease: a pid is judged only where it means this process's namespace."""
    if HOST_TOKEN.endswith("_nons"):  # the namespace is unknown: pids mean nothing
        return []
    removed = []
    for name in store.lease_names():
        pid = lease_pid_of_this_host(name)
        if pid is not None and not pid_alive(pid):
            store.delete(f"{LEASE_DIR}/{name}")
            log.info("removed %s: process %d of this host is gone", store.where(f"{LEASE_DIR}/{name}"), pid)
            removed.append(name)
    return removed


def _sweep(store: Store) -> None:
    """``remove_dead_leases_of_this_host``; a reader that cannot list or delete there reads on
    (gc removes them by age)."""
    with contextlib.suppress(OSError, ShardgenError):
        remove_dead_leases_of_this_host(store)


def _beat_until_gone(owner: weakref.ref, state: Heartbeat, stop: threading.Event, refresh_s: float) -> None:
    while not stop.wait(refresh_s):
        if owner() is None:  # the Lease was dropped without release(): its finalizer cleans up
            return
        state.beat()


# A Lease dropped without release(): its removal (a request with retries, 23 s with a store that is
# gone) runs off the collecting thread; daemon threads die with the interpreter, so exit waits for it.
_DROPPED = OffThread("shardgen-lease-release")
_JOIN_AT_EXIT: list = []  # exit waits for them: registered with the first Lease, not at import


def _join_at_exit() -> None:
    if not _JOIN_AT_EXIT:
        _JOIN_AT_EXIT.append(atexit.register(_DROPPED.join))


class Lease:
    """Holds one lease file naming a generation; ``renew(generation)``, ``release()``.

    The heartbeat thread holds only a weak reference: dropping the last reference to a Lease
    (``del lease``) removes its file and ends the thread.
    """

    def __init__(self, store: Union[Store, ObjectStore, str, os.PathLike], *,
                 refresh_s: float = DEFAULT_TTL_S / 6):
        """``store``: a ``Store``, or what ``open_store`` opens (a folder, a URL, an ``ObjectStore``)."""
        self.refresh_s = refresh_s
        _join_at_exit()
        store = open_store(store)
        _sweep(store)
        name = f"{LEASE_DIR}/{new_lease_name()}"
        self.path = Path(store.where(name))  # where the lease file is (a path, or the object's URL)
        self._state: Heartbeat = store.heartbeat(name)
        self._thread: Optional[threading.Thread] = None
        weakref.finalize(self, _DROPPED.run, self._state.release)

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


def store_clock(store: Union[Store, str, os.PathLike]) -> float:
    """"Now" by the store's own clock (a store folder: the file server's; falls back to this
    host's clock, with a warning, if the store is read-only)."""
    return open_store(store).clock()


def live_lease_generations(store: Union[Store, str, os.PathLike], ttl_s: float, *, now: Optional[float] = None,
                           remove_dead: bool = True) -> list[int]:
    """Generations named by live leases of the store; dead leases are removed.

    ``now`` is a time by the store's clock (default: ``store_clock(store)``)."""
    return open_store(store).live_generations(ttl_s, now=now, remove_dead=remove_dead)

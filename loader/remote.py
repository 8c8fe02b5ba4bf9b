"""``ShardIter`` with ``producer="process"`` (the default): the trainer's side of the producer
process (:mod:`loader.producer`), which does all of an iterator's reading, shuffling and batch
assembly. The trainer's ``next()`` only waits on a socket (the GIL released), maps a shared-memory
slot and wraps it for MXNet without a copy: about 0.1 ms of Python, and none of the producer's
work competes with the training loop for this process's GIL.

The iterator behaves as the in-process one (``producer="thread"``) does; its epochs, order,
resumption, generations and errors are that one's, run in the producer process.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import mxnet as mx

from shardgen.format.schema import Schema

from . import lifecycle
from .errors import LoaderError
from .generations import Choice
from .plan import default_cache_dir
from .producer import BATCH_ERROR, MAX_MESSAGE
from .selection import manifest_path_of, normalize_dates
from .settings import check_arguments
from .shard_iter import ShardIter
from .slots import SlotMaps

__all__ = ["ProcessShardIter", "START_TIMEOUT_S"]

EPOCH_COMMANDS = ("init", "reset", "load", "close")

START_TIMEOUT_S = 120.0  # the producer process's start (it imports MXNet) and an iterator's first epoch
CLOSE_TIMEOUT_S = 30.0


class _Producer:
    """This process's producer process, started on first use (and again after a fork)."""

    _lock = threading.Lock()
    _current: Optional[_Producer] = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "loader.producer", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.control = mine

    @classmethod
    def get(cls) -> _Producer:
        with cls._lock:
            p = cls._current
            if p is None or p.pid != os.getpid() or p.proc.poll() is not None:
                p = cls._current = cls()
            return p

    def session(self) -> socket.socket:
        """A new session's socket (the producer gets the other end)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self.control, [b"s"], [theirs.fileno()])
        except OSError:
            mine.close()
            raise LoaderError(f"the loader's producer process (pid {self.proc.pid}) is gone "
                              f"(exit code {self.proc.poll()})") from None
        finally:
            theirs.close()
        return mine


def _close_session(sock: socket.socket, proc: subprocess.Popen) -> None:
    try:
        sock.close()
    except OSError:
        pass


class ProcessShardIter(ShardIter):
    """A ``ShardIter`` whose work runs in the producer process; see the module docstring."""

    def __init__(self, manifest: os.PathLike | str, batch_size: int, *, producer: str = "process", **kwargs: Any):
        check_arguments(batch_size=batch_size, num_parts=kwargs.get("num_parts", 1),
                        part_index=kwargs.get("part_index", 0),
                        preprocess_threads=kwargs.get("preprocess_threads", 4),
                        prefetch_buffer=kwargs.get("prefetch_buffer", 4), readers=kwargs.get("readers"),
                        native_batch=kwargs.get("native_batch"), last_batch=kwargs.get("last_batch", "pad"),
                        seed=kwargs.get("seed", 0), verify=kwargs.get("verify", "frame"))
        mx.io.DataIter.__init__(self, int(batch_size))
        self.manifest_path = manifest_path_of(Path(manifest))
        self.shuffle, self.seed = bool(kwargs.get("shuffle", True)), int(kwargs.get("seed", 0))
        self.preprocess_threads = int(kwargs.get("preprocess_threads", 4))
        self.prefetch_buffer = int(kwargs.get("prefetch_buffer", 4))
        self.num_parts, self.part_index = int(kwargs.get("num_parts", 1)), int(kwargs.get("part_index", 0))
        self.last_batch, self.verify = kwargs.get("last_batch", "pad"), kwargs.get("verify", "frame")
        self._dates = normalize_dates(kwargs.get("dates"))
        self.cache_dir = Path(kwargs["cache_dir"]) if kwargs.get("cache_dir") is not None else default_cache_dir()
        self.epoch, self.history, self._closed = 0, [], False
        self._choice = Choice(pin=kwargs.get("generation"))
        self._token, self._error, self._stale, self._early = 0, None, [], collections.deque()
        self._lock = threading.RLock()
        self._producer = _Producer.get()
        self._sock = self._producer.session()
        self._finalizer = weakref.finalize(self, _close_session, self._sock, self._producer.proc)
        try:
            info = self._call("init", (str(manifest), batch_size), kwargs, timeout=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.schema = Schema.from_json(info["schema"])
        self.label_names = tuple(info["label_names"])
        self.memory = info["memory"]
        self._slots = SlotMaps(info["floats"], info["views"])
        self._describe()
        self._start(info)
        lifecycle.track(self)

    # -- messages -------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            self._sock.send(pickle.dumps(message))
        except OSError:
            raise self._gone() from None

    def _gone(self) -> LoaderError:
        if self._closed:
            return LoaderError(f"{self.manifest_path}: the iterator was closed while this call waited")
        code = self._producer.proc.poll()
        return LoaderError(f"{self.manifest_path}: the loader's producer process (pid {self._producer.proc.pid}) "
                           f"is gone ({'exit code ' + str(code) if code is not None else 'connection closed'})")

    def _receive(self, timeout: Optional[float] = None) -> tuple:
        self._sock.settimeout(timeout)
        try:
            data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 4)
        except socket.timeout:
            raise LoaderError(f"{self.manifest_path}: the producer process did not answer within "
                              f"{timeout:g}s") from None
        except OSError:
            data, fds = b"", []
        if not data:
            raise self._gone()
        message = pickle.loads(data)
        if message[0] == "batch":
            self._slots.add(message[2], fds)
        return message

    def _call(self, kind: str, *args: Any, timeout: Optional[float] = START_TIMEOUT_S) -> Any:
        """Send a command and wait for its answer. A command that starts an epoch (``EPOCH_COMMANDS``)
        starts a new token: batches of the old one are dropped. Others keep the token: batches of
        the running epoch that arrive first wait in ``_early`` for ``next()``."""
        with self._lock:
            if kind in EPOCH_COMMANDS:
                self._token += 1
                self._early.clear()
            token = self._token
            self._send((kind, token, *args))
            while True:
                message = self._receive(timeout)
                if message[0] == "batch":
                    (self._early if message[1] == token and kind not in EPOCH_COMMANDS else self._stale).append(
                        message)
                    continue
                if message[1] != token or (message[0] == "error" and message[2].startswith(BATCH_ERROR)):
                    if message[1] == token:
                        self._early.append(message)
                    continue
                if message[0] == "error":
                    raise LoaderError(message[2])
                return message[2]

    # -- epochs ---------------------------------------------------------------------------------

    def _start(self, info: dict) -> None:
        self.epoch, self._batches = info["epoch"], info["batches"]
        self._part_samples, self._readers = info["records"], info["readers"]
        self._plan = SimpleNamespace(**info["plan"])
        self._epoch_state = info["state"]
        self._cursor, self._samples, self._blocked = info["cursor"], 0, 0.0
        self._epoch_t0 = self._epoch_t1 = None
        self._error = None

    @property
    def plan(self) -> Any:
        return self._plan

    @property
    def readers(self) -> int:
        return self._readers

    @property
    def records_per_epoch(self) -> int:
        return self._part_samples if self.last_batch == "pad" else self._batches * self.batch_size

    @property
    def dates(self) -> Optional[tuple]:
        return self._dates

    @dates.setter
    def dates(self, value: Any) -> None:
        self._check_open()
        dates = normalize_dates(value)
        self._call("dates", dates)
        self._dates = dates

    def reset(self) -> None:
        self._check_open()
        self._close_epoch()
        try:
            generation = self._choice.manifest(self.manifest_path).generation if self._choice.kv is not None else None
            info = self._call("reset", generation)
        except LoaderError:
            self._cursor, self._batches = 0, max(1, self._batches)
            self._error = LoaderError(f"{self.manifest_path}: no epoch to read: the last reset() failed; fix the cause "
                                      "(e.g. the date selection) and call reset() again")
            raise
        self._start(info)

    def next(self) -> mx.io.DataBatch:
        t0 = time.perf_counter()
        if self._epoch_t0 is None:
            self._epoch_t0 = t0
        if self._cursor >= self._batches:
            raise StopIteration
        self._check_open()
        if self._error is not None:
            raise self._error
        with self._lock:
            message = self._early.popleft() if self._early else self._next_message()
            if message[0] == "error":
                self._error = LoaderError(message[2].removeprefix(BATCH_ERROR))
                raise self._error
        arrays, pad = self._slots.wrap(message[2]), message[3]
        self._cursor += 1
        self._samples += self.batch_size - pad if self.last_batch == "pad" else self.batch_size
        t1 = time.perf_counter()
        self._blocked += t1 - t0
        self._epoch_t1 = t1
        return mx.io.DataBatch(data=arrays[:1], label=arrays[1:], pad=pad,
                               provide_data=self._provide_data, provide_label=self._provide_label)

    def _next_message(self) -> tuple:
        """The next batch (or error) of this epoch from the producer: ``next()``'s only wait."""
        free = self._slots.released() + [m[2] for m in self._stale]
        self._stale.clear()
        self._send(("ack", self._token, self._cursor, free))
        while True:
            message = self._receive()
            if message[1] == self._token:
                return message
            if message[0] == "batch":
                self._stale.append(message)

    # -- resumption -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = dict(self._epoch_state)
        state.update(batches=self._cursor, pinned=self._choice.pin, dates=list(self.dates) if self.dates else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        from .checkpoint import check_state

        check_state(self, state)
        self._check_open()
        info = self._call("load", state)
        self._dates = normalize_dates(state.get("dates"))
        if state.get("pinned") is not None:
            self._choice = Choice(pin=state["pinned"])
        self._start(info)

    # -- the end --------------------------------------------------------------------------------

    def _close_epoch(self) -> None:
        if self._cursor:
            self.history.append(self.stats)

    def _epoch_running(self) -> bool:
        return True

    def _release(self) -> None:
        if getattr(self, "_sock", None) is None:
            return
        if self._lock.acquire(blocking=False):  # no next() waiting: close the session and wait for it
            try:
                self._call("close", timeout=CLOSE_TIMEOUT_S)
            except LoaderError:
                pass
            finally:
                self._lock.release()
        else:  # a next() waits in another thread: wake it (its recv ends); the producer closes the session
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._finalizer()

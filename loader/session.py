"""The trainer's connection to its producer process (:mod:`loader.producer`): the process, started
once per trainer process, and one session per iterator.

A session's reader thread takes every message off the socket: batches of the current epoch are
mapped and lent to MXNet as they arrive (so ``next()`` only pops a ready batch: no socket
call, no MXNet call), answers go to the command waiting for them, batches of an earlier epoch
give their slot back. This thread holds the trainer's GIL some 20-100 us per batch; the
producer's work (the native readers' hand-off, the shuffle buffer, batch assembly) never does.

``next()`` tells the producer how many batches it took every ``ack_every`` batches (the producer
keeps at most ``prefetch_buffer + 1`` batches ahead of that) and gives back the slots MXNet gave
back.
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
from pathlib import Path
from typing import Any, Optional

from .errors import LoaderError
from .producer import BATCH_ERROR, receive
from .slots import SlotMaps
from .zerocopy import lenders

__all__ = ["Producer", "Session", "EPOCH_COMMANDS"]

EPOCH_COMMANDS = ("init", "reset", "load", "close")


class Producer:
    """This process's producer process, started on first use (and again after a fork or a death)."""

    _lock = threading.Lock()
    _current: Optional[Producer] = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "loader.producer", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.control = mine

    @classmethod
    def get(cls) -> Producer:
        with cls._lock:
            p = cls._current
            if p is None or p.pid != os.getpid() or p.proc.poll() is not None:
                p = cls._current = cls()
            return p

    def connect(self) -> socket.socket:
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


class Session:
    """One iterator's connection; see the module docstring."""

    def __init__(self, where: Path):
        self.where, self.pid = where, os.getpid()
        self.producer = Producer.get()
        self.sock = self.producer.connect()
        self.cond = threading.Condition()
        self.calling = threading.RLock()  # one command at a time
        self.token = 0
        self.replies: dict = {}
        self.ready: collections.deque = collections.deque()  # ("batch", arrays, pad) | ("error", message)
        self.free: list[int] = []
        self.slots: Optional[SlotMaps] = None
        self.gone: Optional[str] = None
        self.closed = False
        lenders(+1)
        self.untold = 0  # batches taken and not yet told to the producer
        self.thread = threading.Thread(target=self._read, name="shardgen-session", daemon=True)
        self.thread.start()

    # -- the reader thread ----------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                data, fds = receive(self.sock, 4)
            except OSError:
                data, fds = b"", []
            if not data:
                try:  # reap it, to say how it ended
                    code = self.producer.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = None
                with self.cond:
                    self.gone = (f"the loader's producer process (pid {self.producer.proc.pid}) is gone "
                                 f"({'exit code ' + str(code) if code is not None else 'connection closed'})")
                    self.cond.notify_all()
                return
            self._route(pickle.loads(data), fds)

    def _route(self, message: tuple, fds: list[int]) -> None:
        kind, token = message[0], message[1]
        if kind == "batch":
            self.slots.add(message[2], fds)
            arrays = self.slots.wrap(message[2]) if token == self.token else None
            with self.cond:
                if arrays is not None and token == self.token:
                    self.ready.append(("batch", arrays, message[3]))
                    self.cond.notify_all()
                elif arrays is None:
                    self.free.append(message[2])
            return  # a batch wrapped for an epoch that just ended: its slot comes back by refcount
        if kind == "ok" and self.slots is None and isinstance(message[2], dict) and "views" in message[2]:
            self.slots = SlotMaps(message[2]["floats"], message[2]["views"])  # before the first batch
        with self.cond:
            if kind == "error" and message[2].startswith(BATCH_ERROR):
                if token == self.token:
                    self.ready.append(("error", message[2][len(BATCH_ERROR):]))
            else:
                self.replies[token] = (kind, message[2])
            self.cond.notify_all()

    # -- the trainer's side ---------------------------------------------------------------------

    def mine(self) -> None:
        if os.getpid() != self.pid:
            raise LoaderError(f"{self.where}: this iterator belongs to process {self.pid} (this is a fork of it); "
                              "make a new ShardIter in this process")

    def send(self, message: tuple) -> None:
        self.mine()
        try:
            self.sock.send(pickle.dumps(message))
        except OSError:
            raise LoaderError(f"{self.where}: {self.gone or 'the producer process is gone'}") from None

    def call(self, kind: str, *args: Any, timeout: float) -> Any:
        """Send a command and wait for its answer (a LoaderError if the producer reports one)."""
        self.mine()  # first: a fork's copy of a lock held at fork time would hang it
        with self.calling:
            free = None
            with self.cond:
                if kind in EPOCH_COMMANDS:
                    self.token += 1
                    self.ready.clear()
                    self.untold = 0
                    free, self.free = self.free, []
                token = self.token
            if free is not None and self.slots is not None:
                # The slots this epoch's batches came in, unless still held: an epoch cut short before
                # its first ack (fewer than ``ack_every`` batches taken) would otherwise keep them all
                # from the producer, which makes new ones. No token: the count taken is not updated.
                self._ack(None, 0, free)
            self.send((kind, token, *args))
            deadline = time.monotonic() + timeout
            with self.cond:
                while token not in self.replies:
                    if self.gone is not None:
                        raise LoaderError(f"{self.where}: {'the iterator was closed' if self.closed else self.gone}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LoaderError(f"{self.where}: the producer process did not answer {kind!r} within "
                                          f"{timeout:g}s")
                    self.cond.wait(left)
                answer, payload = self.replies.pop(token)
        if answer == "error":
            raise LoaderError(payload)
        return payload

    def _ack(self, token: Any, taken: int, free: list[int]) -> None:
        """Tell the producer ``taken`` (for ``token``'s epoch) and give back ``free`` and the slots
        MXNet gave back."""
        self.send(("ack", token, taken, free + self.slots.released()))

    def take(self, taken: int, ack_every: int) -> tuple:
        """The next item of this epoch: ``("batch", arrays, pad)`` or ``("error", message)``."""
        self.mine()
        with self.cond:
            while not self.ready and self.gone is None and not self.closed:
                self.cond.wait()
            if self.closed:
                raise LoaderError(f"{self.where}: the iterator was closed while this next() waited")
            if not self.ready:
                raise LoaderError(f"{self.where}: {self.gone}")
            item = self.ready.popleft()
            self.untold += 1
            tell = self.untold >= ack_every
            if tell:
                self.untold = 0
                free, self.free = self.free, []
                token = self.token
        if tell:
            self._ack(token, taken + 1, free)
        return item

    def close(self, timeout: float) -> None:
        """End the session: the producer closes its iterator (lease, plan, native threads) first
        when nothing else waits on it; a waiting ``next()`` or command is woken with an error. In a
        fork of the trainer it only closes this process's copy of the socket."""
        if os.getpid() != self.pid:
            self.sock.close()
            return
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        lenders(-1)
        if self.gone is None and self.calling.acquire(timeout=0.1):
            try:
                self.call("close", timeout=timeout)
            except LoaderError:
                pass
            finally:
                self.calling.release()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(timeout)
        self.sock.close()

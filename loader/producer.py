"""The producer process: where a ``ShardIter``'s work runs, away from the trainer's GIL.

One producer process serves every ``ShardIter`` of a trainer process (``loader.remote`` starts it
with ``python -m loader.producer FD`` on first use). Each iterator is a *session*: its own socket
(sent over the control socket ``FD``), a reader thread for its messages, and a pump thread that
owns an in-process ``ShardIter`` (native readers, shuffle buffer, batch assembly: the thread
mode) whose batch buffers are shared-memory slots (``loader.slots``). The pump sends each batch
as ``("batch", token, slot, pad)`` and keeps at most ``prefetch_buffer + 1`` batches ahead of
what the trainer took.

Messages from the trainer: ``("init", token, args, kwargs)``, ``("reset", token, generation)``
(``generation``: the one the kvstore workers agreed on, or None), ``("load", token, state)``,
``("dates", token, value)``, ``("close", token)``, and ``("ack", token, taken, free slots)``.
Answers: ``("ok", token, info)`` or ``("error", token, message)``; every command starts a new
token, and batches of older tokens are dropped by the trainer.

The process ignores SIGINT (Ctrl-C is the trainer's to handle: it closes its iterators) and exits
when the trainer's end of the control socket closes, even if the trainer was killed.
"""

from __future__ import annotations

import array
import collections
import os
import pickle
import signal
import socket
import sys
import threading
from typing import Any, Optional

from .errors import LoaderError
from .generations import Choice

__all__ = ["main", "epoch_info", "receive", "BATCH_ERROR"]

SWITCH_INTERVAL_S = 0.0005
BATCH_ERROR = "batch: "  # an error met while reading the epoch (not a command's)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[bytes, list[int]]:
    """One message and the descriptors sent with it; ``b""`` when the other end is closed.
    The message's size is asked first (a receive buffer of the largest size a message may have
    would be allocated and faulted in at every call: about 1 ms for 16 MB)."""
    peek = bytearray(1)
    size = sock.recv_into(peek, 1, socket.MSG_PEEK | socket.MSG_TRUNC)
    if size == 0:
        return b"", []
    data, ancillary, _flags, _addr = sock.recvmsg(size, socket.CMSG_LEN(max_fds * 4) if max_fds else 0)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(array.array("i", payload[: len(payload) // 4 * 4]))
    return data, fds


def epoch_info(it: Any) -> dict:
    """What the trainer mirrors of an in-process iterator at an epoch's start."""
    plan = it.plan
    return {"epoch": it.epoch, "cursor": it._cursor, "batches": it.batches_per_epoch,
            "records": it.records_per_epoch, "readers": it.readers, "state": it.state_dict(),
            "plan": {"store": plan.store, "generation": plan.generation, "fingerprint": plan.fingerprint,
                     "shards": plan.shards, "records": plan.records, "samples": plan.samples,
                     "folder": plan.folder}}


class Session:
    """One iterator of the trainer."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.cond = threading.Condition()
        self.commands: collections.deque = collections.deque()
        self.token = 0
        self.taken = 0  # batches of this token the trainer took
        self.it: Any = None
        self.arena: Any = None
        self.send_lock = threading.Lock()
        self.done = threading.Event()

    def send(self, message: tuple, fds: Optional[list] = None) -> None:
        with self.send_lock:
            if fds:
                socket.send_fds(self.sock, [pickle.dumps(message)], fds)
            else:
                self.sock.send(pickle.dumps(message))

    def read(self) -> None:
        """Messages from the trainer, until it closes its end."""
        while True:
            try:
                data = receive(self.sock)[0]
            except OSError:
                data = b""
            message = pickle.loads(data) if data else ("close", None)
            with self.cond:
                if message[0] == "ack":
                    _, token, taken, free = message
                    if self.arena is not None:
                        self.arena.give_back_slots(free)
                    if token == self.token:
                        self.taken = taken
                else:
                    self.commands.append(message)
                self.cond.notify_all()
            if not data or message[0] == "close":
                return

    def pump(self) -> None:
        try:
            self._pump()
        except OSError:  # the trainer's end is closed (dropped, exited or killed)
            self._close(None)

    def _pump(self) -> None:
        sent, batches, active = 0, 0, False
        while True:
            with self.cond:
                while not self.commands and not (active and sent < batches and sent - self.taken <= self.window):
                    self.cond.wait()
                command = self.commands.popleft() if self.commands else None
            if command is not None:
                if command[0] == "close":
                    self._close(command[1])
                    return
                info = self._command(command)
                if info is not None:
                    with self.cond:
                        sent = self.taken = info["cursor"]
                    batches, active = info["batches"], True
                continue
            try:
                batch = self.it.next()
            except Exception as exc:  # noqa: BLE001 - damage, a reader error: the trainer's next() raises it
                active = False
                self.send(("error", self.token, BATCH_ERROR + _describe(exc)))
                continue
            number, fds = self.arena.announce(batch.data[0])
            self.send(("batch", self.token, number, batch.pad), fds)
            sent += 1

    @property
    def window(self) -> int:
        return self.it.prefetch_buffer if self.it is not None else 1

    def _command(self, command: tuple) -> Optional[dict]:
        """Run one command; the epoch it starts (or None)."""
        kind, token = command[0], command[1]
        if kind in ("init", "reset", "load"):  # a new epoch: batches carry the new token
            with self.cond:
                self.token = token
        try:
            if kind == "init":
                info = self._init(*command[2:])
            elif kind == "reset":
                if command[2] is not None:
                    self.it._choice = Choice(pin=command[2])
                self.it.reset()
                info = epoch_info(self.it)
            elif kind == "load":
                self.it.load_state_dict(command[2])
                info = epoch_info(self.it)
            elif kind == "dates":
                self.it.dates = command[2]
                info = None
            else:
                raise LoaderError(f"unknown command {kind!r}")
        except Exception as exc:  # noqa: BLE001 - the trainer raises it as a LoaderError
            self.send(("error", token, _describe(exc)))
            return None
        self.send(("ok", token, info))
        return info

    def _init(self, args: tuple, kwargs: dict) -> dict:
        from .memory import check_footprint, in_producer_process
        from .shard_iter import ShardIter
        from .slots import SlotArena

        def arena(schema, floats, keep):
            self.arena = SlotArena(schema, floats, keep)
            return self.arena

        self.it = ShardIter(*args, producer="thread", _arena=arena, **kwargs)
        it = self.it
        memory = in_producer_process(it.memory, it.prefetch_buffer, self.arena.batch_floats)
        check_footprint(memory, f"prefetch_buffer={it.prefetch_buffer} in the producer process, "
                                f"batch_size={it.batch_size}")
        return {**epoch_info(it), "schema": it.schema.to_json(), "label_names": it.label_names,
                "memory": memory, "floats": self.arena.batch_floats, "views": it._epochs.stream._views}

    def _close(self, token: Any) -> None:
        try:
            if self.it is not None:
                self.it.close()
            if self.arena is not None:
                self.arena.close()
        finally:
            if token is not None:
                try:
                    self.send(("ok", token, None))
                except OSError:
                    pass
            self.sock.close()
            self.done.set()

    def run(self) -> None:
        threading.Thread(target=self.read, name="shardgen-session-read", daemon=True).start()
        threading.Thread(target=self.pump, name="shardgen-session-pump", daemon=True).start()


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, LoaderError) else f"{type(exc).__name__}: {exc}"


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The pump must get the GIL soon after the trainer takes a batch, not when the assembling
    # thread's 5 ms slice ends: this process is ours, so its threads switch every 0.5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    control = socket.socket(fileno=int(argv[0]))
    sessions: list[Session] = []
    while True:
        try:
            _msg, fds, _flags, _addr = socket.recv_fds(control, 16, 1)
        except OSError:
            fds = []
        if not fds:  # the trainer is gone (or closing): its sessions see their sockets close too
            for session in sessions:
                session.done.wait(5.0)
            os._exit(0)
        session = Session(socket.socket(fileno=fds[0]))
        sessions = [s for s in sessions if not s.done.is_set()] + [session]
        session.run()


if __name__ == "__main__":
    sys.exit(main())

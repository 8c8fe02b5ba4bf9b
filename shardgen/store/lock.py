"""Single-writer locks on a store, with ``flock`` (released by the kernel if the holder dies)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

from shardgen.errors import LockError
from shardgen.store.naming import MANIFEST_LOCK, WATCH_LOCK

__all__ = ["StoreLock", "MANIFEST_LOCK", "WATCH_LOCK"]


class StoreLock:
    """``with StoreLock(path, timeout=...)``: exclusive; waits up to ``timeout`` (None: forever, 0: no wait)."""

    def __init__(self, path: Path, *, timeout: Optional[float] = None, what: str = "store"):
        self.path, self.timeout, self.what = Path(path), timeout, what
        self._fd: Optional[int] = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def note(self) -> str:
        """What the holder writes in the lock file, for the messages of those it refuses: what it is,
        its host and pid (a bare pid is ambiguous on a folder that several hosts share)."""
        return f"{self.what} on {socket.gethostname()}, pid {os.getpid()}\n"

    def refusal(self) -> str:
        """Why a waiter gave up: the lock is held (and by whom, as the file says)."""
        return f"{self.path}: {self.what} lock is held by another {self.what} ({self.holder()})"

    def acquire(self) -> StoreLock:
        try:  # never through a symlink: truncating its target would destroy someone else's file
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockError(f"{self.path}: {self.what} lock file is a symlink; refusing to use it "
                                "(remove it and retry)") from None
            # The store cannot be written (a read-only mount, no permission): the environment's
            # failure, as a full disk is, not another holder's (the CLI's exit code follows the errno).
            raise OSError(exc.errno, f"cannot open the {self.what} lock file ({exc.strerror}): the store "
                          "must be writable to write into it", str(self.path)) from None
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    raise LockError(self.refusal()) from None
                time.sleep(0.05)
        with contextlib.suppress(OSError):  # the holder is for messages only; a full disk must not stop us
            os.ftruncate(fd, 0)
            os.write(fd, self.note().encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

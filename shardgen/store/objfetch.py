"""Downloading an object into a local file, checked: the ``download`` of ``ObjectStore``.

The bytes go to a temp file next to the target; size and sha256 are checked, then it is renamed:
a file at the target name is always whole and verified. Bytes that differ are fetched once more,
then refused (``ObjectMismatch``). Transient faults are tried ``attempts`` times in all (the AWS
setting ``max_attempts``, default ``ATTEMPTS``) with ``backoff``, then ``StoreUnreachable`` names
the endpoint and the object. A local write that fails is not a network fault: it is said at once,
in one line naming the folder and the object (a full disk says so).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from shardgen.backoff import retry_delay
from shardgen.fsutil import temp_name
from shardgen.store.objurl import ObjectMismatch, ObjectStoreError, StoreUnreachable

__all__ = ["ATTEMPTS", "BACKOFF_S", "MAX_BACKOFF_S", "CHUNK", "TransientFault", "Downloads", "backoff"]

ATTEMPTS = 4  # tries of one request or download before giving up, unless AWS_MAX_ATTEMPTS says otherwise
BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
CHUNK = 1 << 20


def backoff(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed try: 0.5, 1, 2, 4, then 8 at most."""
    return retry_delay(failures, base=BACKOFF_S, cap=MAX_BACKOFF_S)


class TransientFault(Exception):
    """A request failed in a way worth trying again (connection reset, 5xx, throttling)."""


class _LocalWrite(Exception):
    pass


class DownloadStopped(ObjectStoreError):
    """A download given up mid-file: its ``should_stop()`` said so, or the interpreter is exiting."""


class Downloads:
    """``download`` over the object store's ``chunks(name)``, ``where(name)`` and ``endpoint``."""

    def chunks(self, name: str) -> Iterator[bytes]:  # pragma: no cover - ObjectStore's
        raise NotImplementedError

    def where(self, name: str = "") -> str:  # pragma: no cover - ObjectStore's
        raise NotImplementedError

    @property
    def endpoint(self) -> str:  # pragma: no cover - ObjectStore's
        raise NotImplementedError

    @property
    def attempts(self) -> int:  # pragma: no cover - ObjectStore's
        raise NotImplementedError

    def download(self, name: str, dest: Path, *, size: Optional[int] = None, sha256: Optional[str] = None,
                 what: str = "", should_stop: Optional[Callable[[], bool]] = None) -> None:
        """Fetch an object into ``dest`` (temp file, checks, rename). Transient faults are retried;
        bytes that differ from ``size``/``sha256`` are fetched once more, then ObjectMismatch. Once
        ``should_stop()`` (or the interpreter exits) it gives up between two chunks: DownloadStopped."""
        dest = Path(dest)
        mismatches, faults = 0, 0
        while True:
            tmp = temp_name(dest)
            try:
                got_size, got_sha = self._fetch(name, tmp, should_stop)
                problem = None
                if size is not None and got_size != size:
                    problem = f"{got_size} bytes, the manifest says {size}"
                elif sha256 is not None and got_sha != sha256:
                    problem = f"sha256 {got_sha[:16]}..., the manifest says {sha256[:16]}..."
                if problem is None:
                    os.replace(tmp, dest)
                    return
            except _LocalWrite as exc:
                cause = exc.__cause__
                if cause.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ObjectStoreError(f"{tmp.parent}: the disk is full ({cause.strerror}) writing the download "
                                           f"of {self.where(name)}; free space there") from None
                raise ObjectStoreError(f"{tmp.parent}: cannot write the download of {self.where(name)} "
                                       f"({cause.strerror or cause})") from None
            except (ConnectionError, OSError, TransientFault) as exc:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                faults += 1
                if faults >= self.attempts:
                    times = f"{faults} time" + ("s" if faults != 1 else "")
                    raise StoreUnreachable(f"{self.where(name)}: download failed {times}; cannot reach "
                                           f"{self.endpoint} ({exc})") from None
                time.sleep(backoff(faults))
                continue
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            mismatches += 1
            if mismatches >= 2:
                raise ObjectMismatch(f"{self.where(name)}{' (' + what + ')' if what else ''}: refused after "
                                     f"{mismatches} downloads: {problem}")

    def _fetch(self, name: str, tmp: Path, should_stop: Optional[Callable[[], bool]] = None) -> tuple[int, str]:
        """Size and sha256 of the object's bytes, written to ``tmp``."""
        sha, size = hashlib.sha256(), 0
        try:
            fh = open(tmp, "wb")
        except OSError as exc:
            raise _LocalWrite() from exc
        with fh:
            for chunk in self.chunks(name):
                if (should_stop is not None and should_stop()) or not threading.main_thread().is_alive():
                    raise DownloadStopped(f"{self.where(name)}: download stopped (nothing reads it any more)")
                sha.update(chunk)
                try:
                    fh.write(chunk)
                except OSError as exc:
                    raise _LocalWrite() from exc
                size += len(chunk)
        return size, sha.hexdigest()

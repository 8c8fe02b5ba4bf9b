"""Crash-safe file publishing: temp file in the same folder, fsync, ``os.replace``, fsync folder."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

__all__ = ["temp_name", "atomic_write", "atomic_writer", "write_temp", "link_new", "fsync_dir", "clean_temp_files",
           "clean_dead_joblib_files", "pid_alive", "file_version",
           "host_token", "pid_namespace", "boot_id", "make_dirs", "remove_empty_dirs", "HOST_TOKEN"]

log = logging.getLogger(__name__)
Buffer = Union[bytes, bytearray, memoryview]


def host_token(hostname: str) -> str:
    """A host name safe inside file names that use '-' and '.' as separators."""
    return re.sub(r"[^A-Za-z0-9_]", "_", hostname)


def _read(path: str, *, link: bool = False) -> str:
    try:
        return os.readlink(path) if link else Path(path).read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's pid namespace, e.g. ``pid:[4026531836]`` ('' if unknown)."""
    return _read("/proc/self/ns/pid", link=True)


def boot_id() -> str:
    """The kernel's boot id ('' if unknown): a pid namespace id is only unique within one boot."""
    return _read("/proc/sys/kernel/random/boot_id")


def _ns_token(namespace: str, boot: str) -> str:
    return hashlib.sha256(f"{namespace}|{boot}".encode()).hexdigest()[:8] if namespace and boot else "nons"


# Names this host, pid namespace and boot in temp files, leases and loader folders: a pid found in a
# name carrying this token is a pid of *our* namespace, so it may be checked with kill(pid, 0).
# Containers that share a hostname but not a pid namespace get different tokens.
HOST_TOKEN = f"{host_token(socket.gethostname())}_{_ns_token(pid_namespace(), boot_id())}"
# .<final name>.tmp-<host>-<pid>-<random>: who wrote it, so a dead writer's leftovers can go.
_JOBLIB_RE = re.compile(r"^(?:sem\.loky-(?P<sem>\d+)-|joblib_memmapping_folder_(?P<memmap>\d+)_)")
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>\w+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temp_name(path: Path) -> Path:
    """A unique hidden temp path next to ``path``, naming this host and process."""
    return path.with_name(f".{path.name}.tmp-{HOST_TOKEN}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` when it names no file (a write or fsync failing with ENOSPC does not):
    "No space left on device" alone does not say which disk."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, str(path))  # the same subclass (PermissionError, ...)


@contextlib.contextmanager
def _temp_file(path: Path, *, fsync: bool, publish: Optional[Callable[[Path], None]] = None) -> Iterator:
    """``(file, its path)``: a new temp file next to ``path``, fsynced when the block ends, then
    ``publish(tmp)``; removed if anything fails (an OSError that names no file names ``path``)."""
    tmp = temp_name(path)
    try:
        with open(tmp, "xb") as fh:  # a new name: never through a symlink someone planted
            yield fh, tmp
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if publish is not None:
            publish(tmp)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and _named(exc, path) is not exc:
            raise _named(exc, path) from None
        raise


@contextlib.contextmanager
def atomic_writer(path: Path, *, fsync: bool = True) -> Iterator:
    """Yield a binary file that becomes ``path`` only if the block finishes without error."""
    path = Path(path)
    with _temp_file(path, fsync=fsync, publish=lambda tmp: os.replace(tmp, path)) as (fh, _tmp):
        yield fh
    if fsync:
        fsync_dir(path.parent)


def write_temp(path: Path, chunks: Union[Buffer, Iterable[Buffer]], *, fsync: bool = True) -> Path:
    """Write ``chunks`` to a new temp file next to ``path`` (fsynced); return the temp file, for
    :func:`link_new` to publish. Nothing is left behind if writing fails."""
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        chunks = (chunks,)
    with _temp_file(Path(path), fsync=fsync) as (fh, tmp):
        for chunk in chunks:
            fh.write(chunk)
    return tmp


def link_new(tmp: Path, path: Path) -> bool:
    """Give the temp file ``tmp`` the name ``path`` only if no file has it: False, and nothing
    changed, if one does (a hard link fails with EEXIST; ``os.replace`` would write over it).
    The caller removes ``tmp`` (already gone where the filesystem has no hard links: renamed)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:  # a filesystem without hard links: no atomic no-replace rename, check first
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK):
            raise
        if os.path.lexists(path):
            return False
        os.rename(tmp, path)
    return True


def atomic_write(path: Path, chunks: Union[Buffer, Iterable[Buffer]], *, fsync: bool = True) -> None:
    """Write ``chunks`` (one buffer or several) to ``path`` atomically."""
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        chunks = (chunks,)
    with atomic_writer(path, fsync=fsync) as fh:
        for chunk in chunks:
            fh.write(chunk)


_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc/<pid>/status's pending-signal masks


def _dying(pid: int) -> bool:
    """Whether ``pid`` is a zombie, or is being killed (SIGKILL pending): it will never write again.
    A process killed with its parent can stay a zombie, and one killed with a big heap takes tens of
    ms to exit; ``kill(pid, 0)`` answers that both exist."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except (OSError, ValueError):
        return False
    state = fields.get("State", "").split()
    if state and state[0] in ("Z", "X"):
        # A zombie main thread whose other threads still run (it called pthread_exit) is alive.
        threads = fields.get("Threads", "1").strip()
        return not threads.isdigit() or int(threads) <= 1
    try:
        pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    except ValueError:
        return False
    return bool(pending & _SIGKILL_BIT)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host and can still act (not a zombie, not
    being killed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _dying(pid)


def file_version(path: Path) -> Optional[tuple[str, float, int]]:
    """What tells one version of a file from the next: its path, mtime and size (None: gone)."""
    try:
        st = Path(path).stat()
    except FileNotFoundError:
        return None
    return str(path), st.st_mtime, st.st_size


def clean_temp_files(folder: Path) -> list[Path]:
    """Delete (and log) temp files left in ``folder`` by dead processes of this host, pid namespace
    and boot (``HOST_TOKEN``); return them. Others' temp files are never judged by pid."""
    removed = []
    if not Path(folder).is_dir():
        return removed
    for entry in os.scandir(folder):
        m = _TEMP_RE.match(entry.name)
        if m and m["host"] == HOST_TOKEN and not pid_alive(int(m["pid"])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
                log.info("removed %s left by a dead process", entry.name)
    return removed


def clean_dead_joblib_files(root: Union[str, Path] = "/dev/shm") -> list[Path]:
    """joblib's shared-memory leftovers of processes that died without their cleanup (``kill -9``
    of a build with ``jobs > 1``: its semaphores ``sem.loky-<pid>-*`` and memmapping folders
    ``joblib_memmapping_folder_<pid>_*`` stay in /dev/shm for ever): removed when ``<pid>`` is gone
    and the entry is this user's. Returns them."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = _JOBLIB_RE.match(entry.name)
        if not m or pid_alive(int(m["sem"] or m["memmap"])):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(Path(entry.path))
    return removed


def make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those this call created, outermost first
    (one another process created meanwhile is not among them)."""
    folder = Path(folder)
    made = []
    for path in [p for p in (*reversed(folder.parents), folder) if not p.is_dir()]:
        try:
            os.mkdir(path)
            made.append(path)
        except FileExistsError:
            pass
    folder.mkdir(parents=True, exist_ok=True)  # a file in the way: mkdir's own error
    return made


def remove_empty_dirs(made: list[Path]) -> None:
    """Remove the folders ``make_dirs`` returned that are empty, innermost first; never a file."""
    for path in reversed(made):
        with contextlib.suppress(OSError):  # not empty (or gone): kept
            os.rmdir(path)

"""Starting a generator so that it never outlives us: its own session (process group, killed
whole), and SIGKILL when the process that started it dies, set before it runs.

Where ``setpriv --pdeathsig`` and ``/bin/sh`` exist, the generator starts through them and Python
uses vfork (0.3 ms); elsewhere through a ``preexec_fn`` (a full fork, 5-7 ms). ``exit_watch``
sees an exit at once through a pidfd; ``kill_group`` ends a generator and whatever it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

__all__ = ["spawn", "kill_group", "exit_watch"]


@functools.cache
def _setpriv() -> Optional[str]:
    """util-linux ``setpriv`` (looked up on the system path only, never the user's PATH) if it can
    set the parent-death signal (``--pdeathsig``) and there is a ``/bin/sh``, else None."""
    found = shutil.which("setpriv", path=os.confstr("CS_PATH")) if sys.platform.startswith("linux") else None
    if not found or not os.access(_SH, os.X_OK):
        return None
    try:
        out = subprocess.run([found, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return found if b"--pdeathsig" in out else None


_SH = "/bin/sh"
# What the shell that setpriv starts runs, once the parent-death signal is set: if the process that
# started it died before that (its parent is no longer "$1"), nothing would kill it, so it stops.
_GUARD = '[ "$PPID" = "$1" ] || exit 255; shift; exec "$@"'


def _executable(exe: str, cwd: Path) -> str:
    """The absolute path of what exec would run for ``exe`` started in ``cwd``; else the OSError
    Popen would have raised."""
    if os.sep in exe:
        candidates = [Path(cwd) / exe]
    else:  # relative PATH entries are relative to cwd, as for exec in the child
        candidates = [Path(cwd) / d / exe for d in os.get_exec_path()]
    code = errno.ENOENT
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c.absolute())
        if c.exists():
            code = errno.EACCES
    raise OSError(code, os.strerror(code), exe)


@functools.cache
def _host_elf() -> bytes:
    """This Python's ELF class, byte order and machine (a generator built for another is refused
    by the kernel, and said so through Popen)."""
    try:
        with open(sys.executable, "rb") as fh:
            head = fh.read(20)
    except OSError:
        return b""
    return head[4:6] + head[18:20] if head.startswith(b"\x7fELF") else b""


def _starts_like_a_program(path: str, cwd: Path) -> bool:
    """An ELF executable for this machine, or a script whose ``#!`` interpreter (read as the
    kernel reads it: up to a space or tab, a ``\\r`` kept; relative to ``cwd``) is an executable
    file. Anything else (no ``#!``, a missing interpreter, another machine's binary) starts
    through Popen, whose error is the kernel's own: a shell would run a file it cannot exec as
    a shell script, or name it "not found"."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(256)
    except OSError:
        return False
    if head.startswith(b"\x7fELF"):
        return len(head) >= 20 and head[16:18] in (b"\x02\x00", b"\x03\x00") and \
            head[4:6] + head[18:20] == _host_elf()
    if not head.startswith(b"#!") or b"\n" not in head:
        return False
    line = head[2:].split(b"\n", 1)[0].lstrip(b" \t")
    interpreter = line.replace(b"\t", b" ").split(b" ", 1)[0]
    if not interpreter:
        return False
    target = Path(cwd) / os.fsdecode(interpreter)
    return target.is_file() and os.access(target, os.X_OK)


_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SHELL_SETS = frozenset({"PPID", "IFS", "OPTIND"})  # the shell sets or resets these


def _environment_passes_a_shell() -> bool:
    """Whether ``/bin/sh`` hands this environment on unchanged: it drops variables whose names
    are not shell names (``BASH_FUNC_module%%``, ``app.mode``) and sets a few itself. (``PWD``
    it sets to the generator's folder, which Popen with ``cwd=`` leaves naming this process's.)"""
    return all(_SHELL_NAME.match(name) and name not in _SHELL_SETS for name in os.environ)


def spawn(argv: list[str], cwd: Path, stderr) -> subprocess.Popen:
    """Start the generator in a session of its own that gets SIGKILL if this thread's process
    dies. Through ``setpriv --pdeathsig KILL`` and a one-line ``/bin/sh`` guard where there are
    both, the generator is a program this machine runs and the environment passes a shell
    unchanged: Python then starts the child with vfork (0.3 ms). Else through a ``preexec_fn``,
    which forces a full fork and Python code in the child: 5-7 ms of every date of a ``jobs=1``
    build, whose generator runs ~100 ms. Through the guard the generator's ``argv[0]`` is its
    absolute path and ``$PWD`` its folder; a file replaced between the check and the exec (a
    window of microseconds) is exec'd as it then is."""
    setpriv = _setpriv()
    if setpriv is not None:
        path = _executable(argv[0], cwd)
        if _starts_like_a_program(path, cwd) and _environment_passes_a_shell():
            return subprocess.Popen([setpriv, "--pdeathsig", "KILL", "--", _SH, "-c", _GUARD, "sh", str(os.getpid()),
                                     path, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=stderr, cwd=cwd, start_new_session=True)
    parent = os.getpid()
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=cwd,
                            preexec_fn=lambda: _new_session_dying_with_parent(parent))


def _new_session_dying_with_parent(parent: int) -> None:
    """In the child: own process group, and SIGKILL if the worker that started it dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the worker died before prctl took effect
            os._exit(255)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def exit_watch(proc: subprocess.Popen) -> Iterator[Callable[[float], int]]:
    """``wait(seconds)``: the exit code, or TimeoutExpired. Through a pidfd where Linux has one, so
    an exit is seen at once: ``Popen.wait(timeout)`` polls with sleeps growing to 50 ms, which
    added ~10 ms to every date of a build. ``poll``, not ``select``: any descriptor number works.
    The pidfd is closed when the block ends (not left to the garbage collector)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        yield lambda seconds: proc.wait(timeout=seconds)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)

        def wait(seconds: float) -> int:
            if proc.returncode is None and not poller.poll(max(0, int(seconds * 1000))):
                raise subprocess.TimeoutExpired(proc.args, seconds)
            return proc.wait()

        yield wait
    finally:
        os.close(fd)

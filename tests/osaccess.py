"""Real OS access limits for tests: a second OS user (``useradd``, then ``setuid``) and a read-only bind
mount (``mount --bind`` + ``remount,ro``). Each skips, saying why, where the machine cannot."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

OTHER_USER = "shardgen62"


def other_user() -> str:
    """A second OS user (made once, no home, no shell); skips unless we are root with ``useradd``."""
    if os.geteuid() != 0:
        pytest.skip("a second OS user needs root")
    if subprocess.run(["id", OTHER_USER], capture_output=True).returncode != 0:
        r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                           capture_output=True, text=True)
        if r.returncode != 0 and subprocess.run(["id", OTHER_USER], capture_output=True).returncode != 0:
            pytest.skip(f"useradd failed: {r.stderr.strip()}")
    return OTHER_USER


# This machine's Python lives under /root (0700): another user cannot execute it. So the process
# starts as root, imports what it runs (Python, numpy, MXNet, loader, shardgen: all loaded from /root),
# and then becomes the other user for good (setgroups, setgid, setuid) before it touches the store:
# every file it opens, writes or removes from then on is checked by the kernel as that user's.
_BECOME = """
import os, pwd, sys
import loader, loader.shard_iter, shardgen.store.lease, shardgen.store.folder, mxnet, numpy, logging, json
u = pwd.getpwnam(sys.argv.pop(1))
os.setgroups([]); os.setgid(u.pw_gid); os.setuid(u.pw_uid)
assert os.geteuid() == u.pw_uid and os.getegid() == u.pw_gid
code = sys.argv.pop(1)
exec(compile(code, "<as-user>", "exec"))
"""


def as_user(user: str, code: str, args: list, **kw) -> subprocess.Popen:
    """Python ``code`` run with ``args`` (``sys.argv[1:]``) as ``user`` (see above; no HOME: the
    loader is given its cache_dir)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", _BECOME, user, code, *map(str, args)], env=env, text=True,
                            start_new_session=True, **kw)


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A folder every user may traverse (pytest's tmp_path is 0700), made as this user (files 644/755
    under the usual umask 022), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="shardgen-shared-", dir="/tmp"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def writable_by_all(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o777)
    return folder


@contextlib.contextmanager
def read_only_view(source: Path, target: Path) -> Iterator[Path]:
    """``target``: a read-only bind mount of ``source``; skips (with what the machine said) where
    bind mounts are not allowed (no root, no CAP_SYS_ADMIN, a container without it)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount --bind is not allowed here: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"remount,ro is not allowed here: {r.stderr.strip()}")
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


PYTHON = sys.executable

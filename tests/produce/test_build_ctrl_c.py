"""Ctrl-C to a ``shardgen build`` (issue 62 review): its loky workers block SIGINT as the watcher's
do, so SIGINT to the whole process group while they start (importing numpy) stops the build alone
(exit 130) and no worker prints an import traceback; and a stopped command says that finished
shards were published only when some were. Through the installed ``shardgen`` command, started in
a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_config

pytestmark = pytest.mark.slow
SHARDGEN = Path(sys.executable).parent / "shardgen"
BOUND_S = 20.0  # a stop takes under a second here; beside two CPU hogs a few


def _session_pids(session: int, token: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getsid(int(proc.name)) == session and token.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _generators(cfg_dir: Path) -> list[int]:
    """This test's generators (each runs in a session of its own; its argv names the test's folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"fake_gen.py" in argv and str(cfg_dir).encode() in argv:
                found.append(int(proc.name))
    return found


def _importing_workers(session: int) -> list[int]:
    """The session's loky workers that are importing (numpy's core is loaded)."""
    return [pid for pid in _session_pids(session, "popen_loky_posix")
            if "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()]


def _blocks_sigint(pid: int) -> bool:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return bool(int(fields["SigBlk"], 16) & (1 << (signal.SIGINT - 1)))


def _poll(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = predicate()
        except (OSError, ValueError, KeyError):
            found = None
        if found:
            return found
    raise AssertionError(f"timed out waiting for {what}")


def _start(cfg: Path, *extra: str) -> subprocess.Popen:
    """The build, its stderr going to ``<config folder>/stderr`` (read while it runs)."""
    with open(cfg.parent / "stderr", "w") as err:
        return subprocess.Popen([SHARDGEN, "build", "-c", cfg, *extra], stdout=subprocess.DEVNULL, stderr=err,
                                text=True, start_new_session=True)


def _stopped(proc: subprocess.Popen, cfg_dir: Path) -> tuple[int, str]:
    try:
        proc.wait(timeout=BOUND_S)
    except subprocess.SubprocessError:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        raise AssertionError(f"the build did not exit within {BOUND_S:g} s of the signal: "
                             f"{(cfg_dir / 'stderr').read_text()}") from None
    finally:
        for pid in _session_pids(proc.pid, "") + _generators(cfg_dir):
            os.kill(pid, signal.SIGKILL)
    return proc.returncode, (cfg_dir / "stderr").read_text()


def test_ctrl_c_while_a_builds_workers_start_exits_130_without_a_traceback(cfg_dir):
    cfg = write_config(cfg_dir, end="2024-01-08", jobs=2, timeout=900, modes={"*": "slow:600"})
    proc = _start(cfg)
    try:
        workers = _poll(lambda: proc.poll() is not None or _importing_workers(proc.pid), "workers starting")
        assert proc.poll() is None, (cfg_dir / "stderr").read_text()
        assert all(_blocks_sigint(pid) for pid in workers)  # before: unblocked, a Ctrl-C broke their import
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    os.killpg(proc.pid, signal.SIGINT)
    code, err = _stopped(proc, cfg_dir)
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted; nothing was published" in err, err


@pytest.mark.parametrize("first", ["ok", "slow:600"], ids=["a date finished", "nothing finished"])
def test_a_stopped_build_says_finished_shards_were_published_only_when_some_were(cfg_dir, first):
    cfg = write_config(cfg_dir, end="2024-01-05", jobs=1, timeout=900, modes={"*": "slow:600", "2024-01-02": first})
    proc = _start(cfg, "-v")
    try:  # 2024-01-02 finished (to be published within PUBLISH_EVERY_S, or when the build stops), or its
        # generator runs
        _poll(lambda: proc.poll() is not None or ("published 2024-01-02" in (cfg_dir / "stderr").read_text()
                                                  if first == "ok" else _generators(cfg_dir)), "the moment")
        assert proc.poll() is None, (cfg_dir / "stderr").read_text()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    os.kill(proc.pid, signal.SIGINT)
    code, err = _stopped(proc, cfg_dir)
    said = "finished shards were published" if first == "ok" else "nothing was published"
    assert code == 130 and f"interrupted; {said}" in err, err

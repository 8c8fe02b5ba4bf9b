"""A watcher stopped by a signal, however it is sent (issue 62, item 9): Ctrl-C in a terminal (SIGINT
to the whole process group: the watcher, its loky workers and their generators' parents), SIGINT
or SIGTERM to its pid, even while the command is still importing the library. One exit code (0,
docs/config.md), no traceback, no joblib warning about results "not used" or tasks "cancelled", and no
generator left behind. Through the installed ``shardgen`` command, started in a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import runs, write_config
from test_watch import processes_with, wait_for

pytestmark = pytest.mark.slow
SHARDGEN = Path(sys.executable).parent / "shardgen"  # the console script a user runs
BOUND_S = 20.0  # a stop takes under a second here; beside two CPU hogs a few


def _importing_numpy(pid: int) -> bool:
    """The command is importing the library (numpy's core is loaded: the first of the half second
    its imports take, long before the watcher's own handlers are in)."""
    return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()


def _workers_spawned(session: int) -> bool:
    """A loky worker of the watcher's session is importing (numpy's core is loaded: Python's own
    SIGINT handler is in, its imports go on for a few hundred milliseconds)."""
    return any(os.getsid(pid) == session and _importing_numpy(pid) for pid in processes_with("popen_loky_posix"))


def _poll_until(predicate, *, what: str, timeout: float = 60.0) -> None:
    """``wait_for`` without its naps: the moments above last a few hundred milliseconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, ValueError):
            pass
    raise AssertionError(f"timed out waiting for {what}")


def _start(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen([SHARDGEN, "watch", "-c", cfg, "--interval", "0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stopped(proc: subprocess.Popen, modes: str) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=BOUND_S)
    except subprocess.SubprocessError:  # not stopped within the bound
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"the watcher did not exit within {BOUND_S:g} s of the signal: {err}") from None
    finally:
        for pid in processes_with(modes):
            os.kill(pid, signal.SIGKILL)
    assert not processes_with(modes), "generators outlived the watcher"
    return proc.returncode, err


def _assert_quiet_stop(code: int, err: str) -> None:
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "executed" not in err and "cancelled" not in err, err  # joblib's "N tasks ... but not used"
    assert "could not start" not in err, err


@pytest.mark.parametrize("how", ["SIGINT to the group", "SIGTERM to the group", "SIGINT to the pid",
                                 "SIGTERM to the pid"])
def test_a_watcher_stopped_while_its_generators_run_exits_0_quietly(cfg_dir, how):
    cfg = write_config(cfg_dir, end="2024-01-08", jobs=2, timeout=900,
                       modes={"*": "slow:600", "2024-01-02": "ok", "2024-01-03": "ok"})
    modes = f"{cfg_dir}/modes.json"
    proc = _start(cfg)
    try:
        wait_for(lambda: (cfg_dir / "shards" / "2024-01-03.json").exists(), timeout=60, what="two dates written")
        wait_for(lambda: len(processes_with("fake_gen.py", modes)) == 2 and len(runs(cfg_dir)) >= 4, timeout=60,
                 what="two slow generators running")
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(proc.communicate(timeout=10)[1]) from None
    sig = signal.SIGINT if how.startswith("SIGINT") else signal.SIGTERM
    if how.endswith("group"):
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    _assert_quiet_stop(*_stopped(proc, modes))


@pytest.mark.parametrize("moment", ["importing", "workers starting"])
def test_ctrl_c_while_the_command_starts_exits_0_without_a_traceback(cfg_dir, moment):
    """SIGINT to the group while the command imports the library (numpy loading: its entry point's
    handlers are in, the watcher's not yet), or while its loky workers start (importing too)."""
    cfg = write_config(cfg_dir, end="2024-01-05", jobs=2)
    modes = f"{cfg_dir}/modes.json"
    proc = _start(cfg)
    ready = _importing_numpy if moment == "importing" else _workers_spawned
    try:
        _poll_until(lambda: proc.poll() is not None or ready(proc.pid), what=moment)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    os.killpg(proc.pid, signal.SIGINT)
    code, err = _stopped(proc, modes)
    _assert_quiet_stop(code, err)
    assert "watch stopped (SIGINT)" in err or "SIGINT: finishing up" in err, err

"""Exit: a dist_sync job ends when its workers are done (loader's exit hook), and the launcher
never waits forever for a worker that does not exit."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mxnet as mx
import pytest
from conftest import ROOT, make_store

from loader.shutdown import wait_for_engine

COUNTS = {"2024-01-02": 50, "2024-01-03": 37, "2024-01-04": 44}
PLAIN_WORKER = Path(__file__).resolve().parent / "plain_worker.py"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_exit_hook_order_waitall_then_close_then_mxnet(tmp_path):
    make_store(tmp_path / "store", COUNTS)
    script = tmp_path / "order.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys
        import mxnet as mx
        atexit.register(print, "3 mxnet's hooks run next", flush=True)  # registered after MXNet's: runs before them
        real_waitall = mx.nd.waitall
        def waitall():
            print("1 waitall", flush=True)
            real_waitall()
        mx.nd.waitall = waitall
        from loader import ShardIter
        real_close = ShardIter.close
        def close(self):
            print("2 close", flush=True)
            real_close(self)
        ShardIter.close = close
        it = ShardIter(sys.argv[1], batch_size=4)
        next(iter(it))
    """))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "store" / "manifest.json")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["1 waitall", "2 close", "3 mxnet's hooks run next"]


def test_engine_wait_is_bounded_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(mx.nd, "waitall", lambda: time.sleep(5))
    t0 = time.monotonic()
    assert wait_for_engine(0.2) is False
    assert time.monotonic() - t0 < 2
    assert "did not finish its pending work within 0.2s" in caplog.text


def launch(*args, timeout):
    return subprocess.run([sys.executable, "-m", "loader.launch", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_plain_gluon_worker_exits_every_time(tmp_path):
    """A worker ending right after trainer.step, without waitall: hung in most runs before the hook."""
    make_store(tmp_path / "store", COUNTS)
    for run in range(6):
        t0 = time.monotonic()
        r = launch("-n", 2, "-s", 1, "--timeout", 55, "--", sys.executable, PLAIN_WORKER,
                   tmp_path / "store" / "manifest.json", timeout=90)
        took = time.monotonic() - t0
        assert r.returncode == 0, f"run {run}: exit {r.returncode} after {took:.0f}s\n{r.stdout}{r.stderr}"
        assert took < 60, f"run {run} took {took:.0f}s"


@pytest.mark.slow
def test_a_straggling_worker_stops_the_job(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(f"""
        import os, subprocess, time
        if os.environ["SHARDGEN_WORKER_RANK"] == "1":
            child = subprocess.Popen(["sleep", "1000"])
            with open({str(tmp_path / "pids")!r}, "w") as fh:
                fh.write(f"{{os.getpid()}} {{child.pid}}")
            time.sleep(1000)
    """))
    t0 = time.monotonic()
    r = launch("-n", 2, "-s", 1, "--straggler-s", 3, "--", sys.executable, worker, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 124, r.stdout + r.stderr
    assert "worker 1 still running 3s after worker 0 exited 0" in r.stderr
    assert took < 30
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "the launcher left the worker or its child behind"


def test_launch_rejects_a_non_positive_straggler_timeout():
    r = launch("--straggler-s", 0, "--", "true", timeout=60)
    assert r.returncode == 2 and "--straggler-s must be > 0" in r.stderr

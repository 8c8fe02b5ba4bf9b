"""One written shutdown order (``loader.pipeline.shutdown``, issue 55): ``close()``, a dropped
iterator and interpreter exit run the same steps in the same order; ``reset()`` runs its own one;
a failing step does not keep the later ones from running."""

import gc
import logging
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, make_store

from loader import ShardIter
from loader.pipeline import shutdown
from loader.pipeline.pipeline import join_closing
from shardgen.store.naming import LEASE_DIR

DATES = {f"2024-01-{d:02d}": 20 for d in range(2, 6)}
ORDER = ["stop_streams", "free_arrays", "close_files", "release_claim", "drop_lease"]  # docs/internals.md


def _steps(caplog, who: str) -> list:
    return [r.getMessage().split(": ", 1)[1] for r in caplog.records
            if r.name == "loader.pipeline.shutdown" and r.getMessage().startswith(who + ": ")]


def _leases(store) -> list:
    folder = store / LEASE_DIR
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _reading(tmp_path, caplog) -> tuple:
    """An iterator that read a batch (steps logged), the name its steps are logged under, its plan's folder."""
    caplog.set_level(logging.DEBUG, logger="loader.pipeline.shutdown")
    make_store(tmp_path / "s", DATES)
    it = ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
    it.next()
    return it, it.reader.pipeline.who, it.reader.plan.folder


def _threads(before: frozenset = frozenset()) -> list:
    """The loader's threads alive now but not in ``before`` (an earlier test's iterator, still alive, keeps its own)."""
    return [t.name for t in set(threading.enumerate()) - before
            if t.name.startswith("shardgen") and t.name != "shardgen-close"]


def test_the_order_is_the_written_one():
    assert list(shutdown.STEPS) == ORDER
    assert shutdown.RESET_STEPS == ("stop_streams",)


def test_close_runs_every_step_in_order_and_lets_go_of_everything(tmp_path, caplog):
    before = frozenset(threading.enumerate())
    it, who, folder = _reading(tmp_path, caplog)
    assert {"shardgen-loader", "shardgen-batches"} <= set(_threads(before))
    assert _leases(tmp_path / "s") and folder.exists()
    it.close()
    assert _steps(caplog, who) == ORDER
    assert not folder.exists() and _leases(tmp_path / "s") == []
    deadline = time.monotonic() + 5  # the lease's heartbeat ends once it sees the release
    while _threads(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _threads(before), _threads(before)
    it.close()  # a second close runs nothing again
    assert _steps(caplog, who) == ORDER


def test_reset_stops_only_the_current_stream(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="loader.pipeline.shutdown")
    make_store(tmp_path / "s", DATES)
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:
        who = it.reader.pipeline.who
        sum(1 for _ in it)
        it.reset()
        assert _steps(caplog, who) == ["stop_streams"]
        assert _leases(tmp_path / "s")  # still reading
    assert _steps(caplog, who) == ["stop_streams"] + ORDER


def test_a_dropped_iterator_runs_the_same_order(tmp_path, caplog):
    it, who, folder = _reading(tmp_path, caplog)
    del it  # never closed
    gc.collect()
    join_closing(30)
    assert _steps(caplog, who) == ORDER
    assert not folder.exists() and _leases(tmp_path / "s") == []


def test_interpreter_exit_runs_the_same_order(tmp_path):
    make_store(tmp_path / "s", DATES)
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format='%(name)s %(message)s')\n"
            "from loader import ShardIter\n"
            f"it = ShardIter({str(tmp_path / 's')!r}, 8, cache_dir={str(tmp_path / 'c')!r})\n"
            "it.next()\n"
            "print(it.reader.pipeline.who, flush=True)\n")  # exits with the iterator open
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    who = out.stdout.strip()
    steps = [line.split(": ", 1)[1] for line in out.stderr.splitlines()
             if line.startswith(f"loader.pipeline.shutdown {who}: ")]
    assert steps == ORDER
    assert _leases(tmp_path / "s") == []


def test_a_failing_step_does_not_keep_the_later_ones_from_running():
    ran = []

    def step(name, fail=False):
        def run():
            ran.append(name)
            if fail:
                raise OSError(f"{name} failed")
        return run

    steps = {name: step(name, fail=name in ("free_arrays", "release_claim")) for name in ORDER}
    with pytest.raises(OSError, match="free_arrays failed"):  # the first failure
        shutdown.run(steps)
    assert ran == ORDER
    with pytest.raises(AssertionError, match="are not"):
        shutdown.run({"stop_streams": step("x")})
    ran.clear()
    with pytest.raises(KeyboardInterrupt):  # an interrupt: no step after it
        shutdown.run({**steps, "close_files": lambda: (_ for _ in ()).throw(KeyboardInterrupt())})
    assert ran == ["stop_streams", "free_arrays"]


def test_an_interrupt_stops_the_order_and_the_next_close_runs_it_all(tmp_path, caplog, monkeypatch):
    """Ctrl-C while the streams are being stopped: nothing after ``stop_streams`` runs while a
    stream may still read (review: the files were closed under live stream threads 28 times in 60);
    the next ``close()`` runs every step."""
    from loader.pipeline.pipeline import Pipeline

    it, who, folder = _reading(tmp_path, caplog)
    real, calls = Pipeline._join, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(Pipeline, "_join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        it.close()
    assert _steps(caplog, who) == ["stop_streams"] and folder.exists() and _leases(tmp_path / "s")
    it.close()
    assert _steps(caplog, who) == ["stop_streams"] + ORDER
    assert not folder.exists() and _leases(tmp_path / "s") == []
    with pytest.raises(Exception, match="closed"):
        it.next()

"""The watcher and garbage collection, with real processes bounded in time."""

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, batch_ids, make_store, runs, write_config

from loader import ShardIter
from shardgen.config import load_config
from shardgen.errors import LockError, ShardgenError
from shardgen.store.gc import collect
from shardgen.store.lease import LEASE_DIR, live_lease_generations
from shardgen.store.manifest import Manifest
from shardgen.store.verify import verify_store

pytestmark = pytest.mark.slow
DATES_4 = ["2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05"]


class WatchProc:
    """A `shardgen watch` subprocess, always cleaned up."""

    def __init__(self, cfg, *args):
        self.cfg = cfg
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "shardgen.cli", "watch", "-c", str(cfg), *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout=30):
        """Up and holding the watch lock (its signal handlers are installed before that)."""
        lock = Path(self.cfg).parent / "shards" / ".watch.lock"
        wait_for(lambda: self.proc.poll() is not None or lock.read_text().strip().endswith(f"pid {self.proc.pid}"),
                 timeout=timeout, what="watcher start")

    def stop(self, sig=signal.SIGTERM, timeout=20):
        self.wait_ready()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate(timeout=10)


@pytest.fixture
def watchers():
    procs = []
    yield lambda cfg, *a: procs.append(WatchProc(cfg, *a)) or procs[-1]
    for p in procs:
        p.kill()
        for pid in processes_with(f"{Path(p.cfg).parent}/modes.json"):  # generators a failed test left
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, ValueError, ShardgenError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_cycles(store, n, timeout=30.0):
    """Wait until the watcher has finished ``n`` more cycles (it rewrites its state file after each)."""
    path = Path(store) / ".watch-state.json"
    deadline = time.monotonic() + timeout
    last, seen = None, -1
    while seen < n:
        assert time.monotonic() < deadline, f"timed out waiting for {n} watcher cycles"
        try:
            st = path.stat()
            key = (st.st_ino, st.st_mtime_ns)
        except OSError:
            key = None
        if key is not None and key != last:
            last, seen = key, seen + 1
        time.sleep(0.01)


def processes_with(*tokens):
    """{pid: command line} of this machine's processes whose argv holds every token (exactly one
    test's folder names its generators, so the match is this test's own)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            line = " ".join(a.decode(errors="replace") for a in argv)
            if all(any(t in a.decode(errors="replace") for a in argv) for t in tokens):
                found[int(proc.name)] = line
    return found


def published(store):
    return [s.date for s in Manifest.load(Path(store) / "manifest.json").shards]


def drop_raw(folder, date, rows=30):
    """Drop a raw file the way another machine would: temp name, then rename."""
    from fake_gen import raw_for

    raw = folder / "raw"
    raw.mkdir(exist_ok=True)
    tmp = raw / f".incoming-{date}.npy"
    np.save(tmp, raw_for(date, rows, 7))
    os.replace(tmp, raw / f"{date}.npy")


def test_watcher_shards_due_dates_and_dropped_files(cfg_dir, watchers):
    cfg = write_config(cfg_dir, end="2024-01-03", extra="")
    cfg.write_text(cfg.read_text().replace("backoff_s = 0.0", "backoff_s = 0.0\nsettle_s = 0.3"))
    w = watchers(cfg, "--interval", "0.3")
    store = cfg_dir / "shards"
    wait_for(lambda: published(store) == ["2024-01-02", "2024-01-03"], what="due dates")
    drop_raw(cfg_dir, "2024-01-08")  # outside [dates]: only a dropped file brings it in
    wait_for(lambda: published(store)[-1:] == ["2024-01-08"], what="dropped file")
    assert "2024-01-08" not in runs(cfg_dir)  # not generated: read from the dropped file
    (cfg_dir / "raw" / "2024-01-09.npy").write_bytes(b"not an npy at all")
    wait_for(lambda: [f["date"] for f in json.loads((store / ".watch-state.json").read_text())["failing"]]
             == ["2024-01-09"], what="the bad file reported")
    wait_cycles(store, 4)  # several cycles after the report
    failing = json.loads((store / ".watch-state.json").read_text())["failing"]
    assert failing[0]["attempts"] == 1 and failing[0]["next_retry"] is None  # not read again
    code, out, err = w.stop()
    assert code == 0, err
    bad = [line for line in err.splitlines() if "2024-01-09" in line]
    assert len(bad) == 2 and "not a readable .npy" in bad[0]  # reported once, not every cycle
    assert "will read it again when it changes" in bad[1]
    assert "published 2024-01-08" in err
    assert verify_store(store)[1] == []


def test_a_bad_dropped_file_replaced_by_a_good_one_is_read_again_and_published(cfg_dir):
    """A bad file is not read again while it stays the same (its path, mtime and size): once it is
    replaced, the new file is read and its date published."""
    from shardgen.watch.watcher import Watcher

    path = write_config(cfg_dir, end="2024-01-02")
    path.write_text(path.read_text().replace("backoff_s = 0.0", "backoff_s = 0.0\nsettle_s = 0"))
    cfg = load_config(path)
    (cfg_dir / "raw").mkdir()
    (cfg_dir / "raw" / "2024-01-09.npy").write_bytes(b"not an npy at all")
    with Watcher(cfg, interval=60.0) as w:
        assert [d.isoformat() for d, _ in w.cycle().failed] == ["2024-01-09"]
        assert w.cycle().failed == [] and published(cfg.store.dir) == ["2024-01-02"]  # not read again
        drop_raw(cfg_dir, "2024-01-09")  # fixed: another file under the same name
        report = w.cycle()
    assert report.failed == [] and published(cfg.store.dir) == ["2024-01-02", "2024-01-09"]
    assert "2024-01-09" not in runs(cfg_dir)  # read from the file, never generated


def test_raw_files_after_today_off_the_calendar_or_older_than_the_window_are_never_published(cfg_dir, caplog):
    """Measured: a Saturday's file and a future date's were published (status: "lag -3 days"), and
    one older than the window was ignored without a word. Now: one warning per file, none published;
    the future date's file is read once that date has come."""
    from shardgen.watch.watcher import Watcher

    path = write_config(cfg_dir, end="2024-01-05", window=2)
    path.write_text(path.read_text().replace("backoff_s = 0.0", "backoff_s = 0.0\nsettle_s = 0"))
    cfg, today = load_config(path), [dt.date(2024, 1, 10)]
    names = {"2024-01-01": "older than the 2-date window", "2024-01-06": "for a Saturday, not on the weekdays",
             "2024-01-11": "for a date after today (2024-01-10)"}
    with Watcher(cfg, interval=60.0, today=lambda: today[0]) as w:
        w.cycle()
        assert published(cfg.store.dir) == ["2024-01-04", "2024-01-05"]  # 2024-01-02, -03 retired
        for date in [*names, "2024-01-03", "2024-01-09"]:  # -03: a retired date's file, no news
            drop_raw(cfg_dir, date)
        with caplog.at_level("WARNING"):
            for _ in range(3):
                assert w.cycle().failed == []
        assert published(cfg.store.dir) == ["2024-01-05", "2024-01-09"]
        lines = caplog.text.splitlines()
        assert len(lines) == 3, caplog.text  # one per file, not one per cycle
        for (date, why), line in zip(sorted(names.items()), lines):
            assert f"{date}: {cfg_dir / 'raw' / date}.npy is {why}" in line and line.endswith("not published")
        today[0] = dt.date(2024, 1, 11)  # its date has come
        w.cycle()
    assert published(cfg.store.dir) == ["2024-01-09", "2024-01-11"]
    # The old date's and the Saturday's files are older than the full window's oldest shard now: they
    # can never be published, and went with the raw files of the dates gc deleted.
    assert "2024-01-01" not in raw_dates(cfg_dir) and "2024-01-06" not in raw_dates(cfg_dir)
    drop_raw(cfg_dir, "2024-01-13")  # a Saturday again, for a new process
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "watch", "--once", "-c", str(path), "--today",
                        "2024-01-11"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "watching" in r.stderr and " once (" in r.stderr and "every" not in r.stderr
    assert r.stderr.count("not published") == 1, r.stderr  # this process's warning: the new Saturday's file
    (cfg_dir / "raw" / "2024-01-13.npy").unlink()
    later = dt.date.today() + dt.timedelta(days=3)
    drop_raw(cfg_dir, later.isoformat())
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "--json", "-c", str(path)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    info = json.loads(r.stdout)
    assert info["newest_raw"] == "2024-01-11" and info["raw_lag_days"] > 0  # the later file is no input yet


def raw_dates(cfg_dir):
    return sorted(p.name[:10] for p in (cfg_dir / "raw").glob("2*.npy"))


@pytest.mark.parametrize("keep", [False, True])
def test_raw_files_of_dates_whose_shards_gc_deleted_go_unless_kept(cfg_dir, keep):
    """Measured: 19 raw files stayed while 7 shards were in the window."""
    from shardgen.produce.build import build
    from shardgen.watch.watcher import Watcher

    path = write_config(cfg_dir, end="2024-01-05", window=2, grace=0)
    if keep:
        path.write_text(path.read_text().replace("grace_s = 0", "keep_raw = true\ngrace_s = 0"))
    cfg = load_config(path)
    (cfg_dir / "raw").mkdir()
    others = [cfg_dir / "raw" / ".incoming-2024-01-02.npy", cfg_dir / "raw" / "2024-01-02.csv"]
    for other in others:  # not a date's raw file (by generator.output): never touched
        other.write_text("x")
    with Watcher(cfg, interval=60.0) as w:
        assert w.cycle().deleted == ["2024-01-02", "2024-01-03"]  # retired, past their grace (0 s) at once
        assert raw_dates(cfg_dir) == (DATES_4 if keep else ["2024-01-04", "2024-01-05"])
        with pytest.raises(LockError, match=r"build refused: the store has another writer \(watch on"):
            build(cfg, start=dt.date(2024, 1, 5), end=dt.date(2024, 1, 5), force=True)  # one writer per store
    report = build(cfg, start=dt.date(2024, 1, 5), end=dt.date(2024, 1, 5), force=True)
    assert report.published == [dt.date(2024, 1, 5)]  # rewritten: its first version is retired
    with Watcher(cfg, interval=60.0) as w:
        assert w.cycle().deleted == ["2024-01-05"]
    assert raw_dates(cfg_dir) == (DATES_4 if keep else ["2024-01-04", "2024-01-05"])  # -05 is in the window
    assert all(other.exists() for other in others)


def test_raw_files_stay_through_the_grace_and_another_gc_is_refused_while_the_watcher_runs(cfg_dir):
    """Issue 54: one writer per store folder too: a `shardgen gc` beside a running watcher is
    refused (naming it); the watcher's own gc deletes what may go."""
    from shardgen.watch.watcher import Watcher

    cfg = load_config(write_config(cfg_dir, end="2024-01-05", window=2, grace=3600))
    with Watcher(cfg, interval=60.0) as w:
        w.cycle()
        w.cycle()
        assert published(cfg.store.dir) == ["2024-01-04", "2024-01-05"]
        assert raw_dates(cfg_dir) == DATES_4  # 2024-01-02 and -03 are retired, within their grace
        later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3601)  # `shardgen gc`, an hour on
        with pytest.raises(LockError, match=r"gc refused: the store has another writer \(watch on .*, pid \d+\)"):
            collect(cfg.store.dir, grace_s=3600, lease_ttl_s=60, now=later)
        w.cycle()
    assert raw_dates(cfg_dir) == DATES_4  # still within their grace: nothing was deleted


def test_raw_files_of_shards_gc_deleted_while_no_watcher_ran_go_when_one_starts_again(cfg_dir):
    """Found in review: a watcher knew only the dates it saw leave; after a restart, the raw files of
    dates `shardgen gc` deleted meanwhile stayed for ever. With the window full, a date older than its
    oldest shard is never produced again (``wanted``): its raw file goes."""
    from shardgen.watch.watcher import Watcher

    cfg = load_config(write_config(cfg_dir, end="2024-01-05", window=2, grace=3600))
    with Watcher(cfg, interval=60.0) as w:
        w.cycle()
        w.cycle()
    assert raw_dates(cfg_dir) == DATES_4  # two dates retired, within their grace
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3601)
    assert collect(cfg.store.dir, grace_s=3600, lease_ttl_s=60, now=later) == ["2024-01-02", "2024-01-03"]
    with Watcher(cfg, interval=60.0) as w:  # a new process: it never saw those dates leave
        w.cycle()
    assert raw_dates(cfg_dir) == ["2024-01-04", "2024-01-05"]
    assert published(cfg.store.dir) == ["2024-01-04", "2024-01-05"]


def test_due_dates_follow_the_clock(cfg_dir, watchers):
    cfg = write_config(cfg_dir, end=None)
    clock = cfg_dir / "today.txt"
    clock.write_text("2024-01-03")
    w = watchers(cfg, "--interval", "0.3", "--today", clock)
    store = cfg_dir / "shards"
    wait_for(lambda: published(store) == ["2024-01-02", "2024-01-03"], what="first dates")
    clock.write_text("2024-01-08")
    wait_for(lambda: published(store) == ["2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05", "2024-01-08"],
             what="dates up to the new today")
    before = dt.date.today()
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "-c", str(cfg), "--json"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    info = json.loads(r.stdout)
    lag = {(day - dt.date(2024, 1, 8)).days for day in (before, dt.date.today())}  # midnight may pass
    assert info["newest_raw"] == "2024-01-08" and info["raw_lag_days"] in lag, info
    assert w.stop()[0] == 0


def test_failing_date_is_retried_with_backoff_and_does_not_block(cfg_dir, watchers):
    cfg = write_config(cfg_dir, end="2024-01-04", modes={"2024-01-03": "flaky:2"})
    w = watchers(cfg, "--interval", "0.2")
    store = cfg_dir / "shards"
    wait_for(lambda: "2024-01-04" in published(store), what="newer date despite the failure")
    wait_for(lambda: "2024-01-03" in published(store), what="failing date after retries")
    code, out, err = w.stop()
    assert code == 0 and len([ln for ln in err.splitlines() if "2024-01-03: generator exited with code 4" in ln]) == 2
    assert "will retry in" in err


def test_a_due_date_whose_generator_leaves_a_truncated_file_is_regenerated(cfg_dir):
    """Measured: while the date waited for its retry, its truncated output was read as a dropped file,
    failed, and was then ignored for ever: the generator never ran for that date again."""
    from shardgen.watch.state import WATCH_STATE
    from shardgen.watch.watcher import Watcher

    cfg_path = write_config(cfg_dir, end="2024-01-03", modes={"2024-01-02": "truncated:2"})
    cfg_path.write_text(cfg_path.read_text().replace("backoff_s = 0.0", "backoff_s = 0.0\nsettle_s = 0.2"))
    cfg = load_config(cfg_path)
    store = cfg.store.dir
    statuses = []
    with Watcher(cfg, interval=1.0) as w:  # backoff 1 s, 2 s: several cycles while the date waits
        for _ in range(40):
            w.cycle()
            if "2024-01-02" in published(store):
                break
            r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "-c", str(cfg_path), "--json"],
                               capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
            statuses.append(json.loads(r.stdout)["failing"])
            time.sleep(0.1)
    assert published(store) == ["2024-01-02", "2024-01-03"]
    assert runs(cfg_dir).count("2024-01-02") == 3  # two truncated files, then a good one
    failing = [f for f in statuses if f]
    assert max(f[0]["attempts"] for f in failing) == 2
    assert failing[0][0]["date"] == "2024-01-02" and failing[0][0]["kind"] == "due"
    assert "not a readable .npy array" in failing[0][0]["error"] and failing[0][0]["next_retry"].endswith("Z")
    assert json.loads((store / WATCH_STATE).read_text())["failing"] == []  # healthy again
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "-c", str(cfg_path)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "0 failing dates" in r.stdout


def test_retry_delay_doubles_up_to_the_cap_for_any_count():
    from shardgen.backoff import retry_delay

    assert [retry_delay(n, base=60.0, cap=3600.0) for n in (1, 2, 3, 6, 7)] == [60, 120, 240, 1920, 3600]
    assert retry_delay(10**6, base=60.0, cap=3600.0) == 3600.0  # 60 * 2**999999 was an OverflowError
    assert retry_delay(10**100, base=0.5, cap=3600.0) == 3600.0


def test_a_date_failing_a_million_times_keeps_the_watcher_and_its_state(cfg_dir):
    """Measured: a date's ~1,025th failure raised OverflowError in the retry delay and killed the watcher."""
    from shardgen.watch.state import load_state
    from shardgen.watch.watcher import Watcher, _Failure

    cfg = load_config(write_config(cfg_dir, end="2024-01-02", modes={"2024-01-02": "fail"}))
    with Watcher(cfg, interval=60.0) as w:
        w._failures[dt.date(2024, 1, 2)] = _Failure(10**6, "earlier failures", 0.0)  # due again now
        t0 = time.time()
        report = w.cycle()
    assert [d.isoformat() for d, _ in report.failed] == ["2024-01-02"]
    [failing] = load_state(cfg.store.dir)["failing"]
    assert failing["attempts"] == 10**6 + 1 and "generator exited with code 3" in failing["error"]
    retry = dt.datetime.fromisoformat(failing["next_retry"].replace("Z", "+00:00")).timestamp()
    assert t0 + 3600 - 5 <= retry <= time.time() + 3600 + 5  # capped at an hour


def test_status_lists_failing_dates_of_a_running_watcher(cfg_dir, watchers):
    cfg = write_config(cfg_dir, end="2024-01-03", modes={"2024-01-03": "fail"})
    cfg.write_text(cfg.read_text().replace("backoff_s = 0.0", "backoff_s = 0.0\nsettle_s = 0.3"))
    drop_raw(cfg_dir, "2024-01-04")
    (cfg_dir / "raw" / "2024-01-09.npy").write_bytes(b"not an npy")  # dropped, not due
    w = watchers(cfg, "--interval", "0.2")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def failing():
        r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "-c", str(cfg), "--json"],
                           capture_output=True, text=True, timeout=60, env=env)
        return {f["date"]: f for f in json.loads(r.stdout)["failing"]}

    wait_for(lambda: set(failing()) == {"2024-01-03", "2024-01-09"} and failing()["2024-01-03"]["attempts"] >= 2,
             what="two failing dates in status")
    f = failing()
    assert f["2024-01-03"]["kind"] == "due" and "exited with code 3" in f["2024-01-03"]["error"]
    assert f["2024-01-09"]["kind"] == "dropped" and f["2024-01-09"]["next_retry"] is None
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "-c", str(cfg)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert "failing 2024-01-03 (due, " in r.stdout and "failing 2024-01-09 (dropped, 1 attempt, retried when" \
        in r.stdout
    assert r.returncode == 1  # a cron monitor: status exits 1 while dates are failing
    code, out, err = w.stop()
    assert code == 0
    assert "2024-01-09: " in err and "will read it again when it changes" in err


@pytest.mark.parametrize("how", ["SIGTERM", "kill -9"])
def test_status_tells_whether_the_watcher_is_alive(cfg_dir, watchers, how):
    """Measured: after SIGTERM or kill -9, status still printed "watcher: last cycle ..., 0 failing dates"."""
    import socket

    cfg = write_config(cfg_dir, end="2024-01-03")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def status(*args):
        r = subprocess.run([sys.executable, "-m", "shardgen.cli", "status", "-c", str(cfg), *args],
                           capture_output=True, text=True, timeout=60, env=env)
        return json.loads(r.stdout)["watcher"] if args else r.stdout

    w = watchers(cfg, "--interval", "0.2")
    wait_for(lambda: status("--json")["alive"], what="status: the watcher is alive")
    info = status("--json")
    assert info["pid"] == w.proc.pid and info["host"] == socket.gethostname() and info["why"] is None
    assert 0 <= info["heartbeat_age_s"] < 60
    assert f"watcher: alive (pid {w.proc.pid} on {socket.gethostname()}, heartbeat " in status()
    if how == "SIGTERM":
        assert w.stop()[0] == 0
    else:
        w.kill()
        assert w.proc.returncode == -signal.SIGKILL
    wait_for(lambda: not status("--json")["alive"], what="status: the watcher is not alive")
    info = status("--json")
    if how == "SIGTERM":  # it removed its heartbeat file as it stopped
        assert info["pid"] is None and info["why"] == "no heartbeat file (stopped, or never started)"
        assert "watcher: NOT RUNNING (no heartbeat file (stopped, or never started)); last cycle" in status()
    else:  # the file stays; its pid, of this host, pid namespace and boot, is gone
        assert info["pid"] == w.proc.pid and info["why"] == f"process {w.proc.pid} is gone"
        assert f"watcher: NOT RUNNING (pid {w.proc.pid} on {socket.gethostname()}, process {w.proc.pid} is gone)" \
            in status()


def test_the_watchers_heartbeat_is_kept_fresh_and_judged_by_the_store_clock(tmp_path, monkeypatch):
    """A status on another host cannot check the pid: the heartbeat's age by the store's clock decides."""
    from shardgen.store import open_store
    from shardgen.watch.alive import WATCH_HEARTBEAT, WatcherHeartbeat, watcher_status

    store = open_store(tmp_path / "s")
    store.dir.mkdir()
    path = store.dir / WATCH_HEARTBEAT
    beat = WatcherHeartbeat(store, ttl_s=0.6)  # a beat every 0.1 s
    beat.start()
    beats, last = 0, path.stat().st_mtime_ns
    deadline = time.monotonic() + 10
    while beats < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
        mtime = path.stat().st_mtime_ns
        beats, last = beats + (mtime != last), mtime
    assert beats == 3, "the watcher's heartbeat never refreshed its file"
    assert watcher_status(store, 60)["alive"]
    beat.stop()
    assert not path.exists() and watcher_status(store, 60)["alive"] is False

    path.write_text(json.dumps({"generation": 0, "host": "elsewhere", "pid": 1, "pidns": "", "boot_id": ""}))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # this host's clock is an hour ahead
    assert watcher_status(store, 60) == {"alive": True, "pid": 1, "host": "elsewhere",
                                         "heartbeat_age_s": pytest.approx(0, abs=5), "why": None}
    old = path.stat().st_mtime - 90  # 90 s old by the store's clock
    os.utime(path, (old, old))
    info = watcher_status(store, 60)
    assert info["alive"] is False and info["why"].startswith("no heartbeat for 9")


def test_second_watcher_exits_2_naming_lock_and_pid(cfg_dir, watchers):
    cfg = write_config(cfg_dir)
    first = watchers(cfg, "--interval", "0.5")
    wait_for(lambda: (cfg_dir / "shards" / "manifest.json").exists(), what="first watcher")
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "watch", "-c", str(cfg), "--once"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2
    assert ".watch.lock" in r.stderr and f"pid {first.proc.pid}" in r.stderr
    assert f"held by another watch (watch on {socket.gethostname()}, pid {first.proc.pid})" in r.stderr  # the host
    assert first.stop()[0] == 0


def test_sigterm_during_a_build_stops_cleanly(cfg_dir, watchers):
    # Generators run in loky worker processes, which never see the watcher's STOP event: they must
    # still be abandoned at once, with their process groups (the "hang" one has a child), instead
    # of running until their timeout. That timeout (900 s) and "slow:600" outlast the 40 s the stop
    # may take: a watcher that waited for its generators fails here, however loaded the machine.
    cfg = write_config(cfg_dir, end="2024-01-05", jobs=2, timeout=900,
                       modes={"*": "slow:600", "2024-01-03": "hang"})
    w = watchers(cfg, "--interval", "0.5")
    modes = f"{cfg_dir}/modes.json"
    wait_for(lambda: len(runs(cfg_dir)) >= 2, what="generators running")
    wait_for(lambda: processes_with("time.sleep(600)", modes), what="the hanging generator's child")
    assert len(processes_with("fake_gen.py", modes)) == 2  # both generators still running
    w.wait_ready()
    try:
        code, out, err = w.stop(signal.SIGTERM, timeout=40)  # measured: 0.2 s
    except subprocess.SubprocessError:  # it did not exit in time
        code = err = None
    assert err is not None, "still running 40 s after SIGTERM: it waited for its generators"
    assert code == 0, err
    assert "Traceback" not in err and "timed out" not in err
    left = processes_with(modes)
    assert not left, f"generators (or their children) outlived the watcher: {left} {err}"
    store = cfg_dir / "shards"
    assert not [p for p in store.iterdir() if p.suffix == ".rec"]  # nothing partial, nothing published
    # The lock was released: another watcher starts at once.
    (cfg_dir / "modes.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "watch", "-c", str(cfg), "--once"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and len(published(store)) == 4


def test_kill_9_at_several_points_converges(tmp_path, watchers):
    ref_cfg = write_config(tmp_path / "ref", end="2024-01-12", window=5, jobs=2)
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "watch", "-c", str(ref_cfg), "--once"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    ref = Manifest.load(tmp_path / "ref" / "shards" / "manifest.json")
    cfg = write_config(tmp_path / "run", end="2024-01-12", window=5, jobs=2, modes={"*": "slow:0.3"})
    store = tmp_path / "run" / "shards"

    def sidecars():
        return {p.name[:10] for p in store.glob("20??-??-??.json")}

    # kill -9 at observed progress: a generator running, then a shard written but not yet published
    for what, reached in [("a generator running", lambda r0, s0: len(runs(tmp_path / "run")) > r0),
                          ("a new shard on disk", lambda r0, s0: len(sidecars()) > s0)]:
        r0, s0 = len(runs(tmp_path / "run")), len(sidecars())
        w = watchers(cfg, "--interval", "0.2")
        wait_for(lambda: reached(r0, s0) or w.proc.poll() is not None, timeout=60, what=what)  # noqa: B023
        w.kill()
        assert w.proc.returncode == -signal.SIGKILL
        done = published(store) if (store / "manifest.json").exists() else []
        assert done != [s.date for s in ref.shards], f"the killed run had finished at {what}"
        if done:
            assert verify_store(store)[1] == []
    assert sidecars(), "the killed runs left nothing to converge from"  # partial: some shards, not all
    w = watchers(cfg, "--interval", "0.2")
    wait_for(lambda: published(store) == [s.date for s in ref.shards], timeout=60, what="convergence")
    assert w.stop()[0] == 0
    m = Manifest.load(store / "manifest.json")
    assert m.shards == ref.shards and m.window == ref.window  # same files, same checksums
    # Dates older than a window the killed runs had already filled are not produced at all
    # (they would be retired at once), so `retired` may list fewer: never others.
    assert {r.date for r in m.retired} <= {r.date for r in ref.retired}
    assert verify_store(store)[1] == []
    assert not [p for p in store.iterdir() if ".tmp-" in p.name]


# -- garbage collection and leases ---------------------------------------------------------


def test_reader_mid_epoch_keeps_its_files_through_gc(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 30, "2024-01-03": 30}, window=2)
    it = ShardIter(store, 4, shuffle=True, cache_dir=tmp_path / "c")
    ids = batch_ids(it.next())
    assert live_lease_generations(store, 60) == [1]
    make_store(store, {"2024-01-04": 5, "2024-01-05": 5}, window=2, base_id=100)  # both old dates retire
    assert collect(store, grace_s=0, lease_ttl_s=60) == []  # the reader still uses generation 1
    assert (store / "2024-01-02.rec").exists()
    for b in it:
        ids += batch_ids(b)
    assert sorted(ids) == list(range(60))  # the epoch completed with every record
    # Between epochs the reader still holds generation 1 (its next epoch is being prepared).
    assert collect(store, grace_s=0, lease_ttl_s=60) == []
    it.reset()  # the next epoch: the newest generation, and the lease moves with it
    assert live_lease_generations(store, 60) == [2]
    assert collect(store, grace_s=0, lease_ttl_s=60) == ["2024-01-02", "2024-01-03"]
    assert not (store / "2024-01-02.rec").exists() and (store / "2024-01-04.rec").exists()
    assert Manifest.load(store / "manifest.json").retired == ()
    assert sorted(i for b in it for i in batch_ids(b)) == list(range(100, 110))
    it.close()
    assert live_lease_generations(store, 60) == []  # released when the reader closes


def test_gc_in_a_watcher_process_while_a_reader_reads(tmp_path, watchers):
    """The real thing: watcher subprocess with grace_s = 0 retiring and collecting under a reader."""
    cfg = write_config(tmp_path / "p", end="2024-01-03", window=2, grace=0, rows=400)
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    store = tmp_path / "p" / "shards"
    it = ShardIter(store, 16, cache_dir=tmp_path / "c")
    first = it.next()
    cfg.write_text(cfg.read_text().replace('end = "2024-01-03"', 'end = "2024-01-05"'))
    w = watchers(cfg, "--interval", "0.2")
    wait_for(lambda: published(store) == ["2024-01-04", "2024-01-05"], what="new window")
    wait_cycles(store, 3)  # three more cycles, each with a gc pass, while the reader is mid-epoch
    assert (store / "2024-01-02.rec").exists()
    n = 16 - first.pad + sum(16 - b.pad for b in it)
    assert n == 2 * 396
    it.close()
    wait_for(lambda: not (store / "2024-01-02.rec").exists(), what="gc once the reader is done")
    assert w.stop()[0] == 0


def test_dead_and_stale_leases_do_not_count(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 10}, window=1)  # generation 1 lists 2024-01-02
    make_store(store, {"2024-01-03": 10}, window=1, base_id=10)  # generation 2 retires it
    (store / LEASE_DIR).mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket

    from shardgen.fsutil import boot_id, pid_namespace

    (store / LEASE_DIR / "dead.json").write_text(json.dumps({"generation": 1, "host": socket.gethostname(),
                                                              "pid": dead.pid, "pidns": pid_namespace(),
                                                              "boot_id": boot_id()}))
    stale = store / LEASE_DIR / "stale.json"
    stale.write_text(json.dumps({"generation": 1, "host": "elsewhere", "pid": 1}))
    old = time.time() - 600
    os.utime(stale, (old, old))
    live = store / LEASE_DIR / "live.json"
    live.write_text(json.dumps({"generation": 1, "host": "elsewhere", "pid": 1}))
    assert collect(store, grace_s=0, lease_ttl_s=60) == []  # the live one (another host) protects
    assert not (store / LEASE_DIR / "dead.json").exists() and not stale.exists()
    live.unlink()
    assert collect(store, grace_s=0, lease_ttl_s=60) == ["2024-01-02"]


def test_grace_period_and_gc_command(tmp_path):
    cfg_path = write_config(tmp_path / "p", end="2024-01-05", window=2, grace=3600)
    cfg = load_config(cfg_path)
    from shardgen.produce.build import build

    build(cfg)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "gc", "-c", str(cfg_path)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0 and "deleted 0 retired shards" in r.stdout
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3601)
    assert collect(cfg.store.dir, grace_s=3600, lease_ttl_s=60, now=later) == ["2024-01-02", "2024-01-03"]
    # Gone from disk and from the manifest; a later build does not bring them back.
    report = build(cfg)
    assert not report.published and published(cfg.store.dir) == ["2024-01-04", "2024-01-05"]


def test_adopts_complete_shards_from_other_producers(tmp_path, caplog):
    from shardgen.produce.build import build
    from shardgen.watch.watcher import Watcher

    other = load_config(write_config(tmp_path / "other", end="2024-01-04"))
    build(other)
    mine = load_config(write_config(tmp_path / "mine", start="2024-01-02", end="2024-01-02"))
    build(mine)
    for name in ("2024-01-03", "2024-01-04"):
        for ext in ("rec", "idx", "json"):
            shutil.copy(other.store.dir / f"{name}.{ext}", mine.store.dir / f"{name}.{ext}")
    with open(mine.store.dir / "2024-01-04.rec", "r+b") as fh:  # corrupt one, same size
        fh.seek(40)
        fh.write(b"\xff\xff\xff\xff")
    with Watcher(mine) as w:
        with caplog.at_level("WARNING"):
            report = w.cycle()
        assert [e.date for e in report.adopted] == ["2024-01-03"]
        assert "2024-01-04: not adopting" in caplog.text and "record 0 of 2024-01-04 is damaged" in caplog.text
        assert w.cycle().adopted == []  # the bad one is reported once, left alone
    assert published(mine.store.dir) == ["2024-01-02", "2024-01-03"]


def test_a_complete_shard_of_another_schema_is_never_adopted(tmp_path):
    """Shard files in the store for a due date, complete and whole but written for another schema
    (another producer's config): the date is built again for this one, never adopted."""
    from shardgen.produce.build import build
    from shardgen.store.sidecar import Sidecar
    from shardgen.watch.watcher import Watcher

    path = write_config(tmp_path / "other", start="2024-01-03", end="2024-01-03")
    path.write_text(path.read_text().replace("time_steps = 5", "time_steps = 6"))
    other = load_config(path)
    build(other)
    mine = load_config(write_config(tmp_path / "mine", start="2024-01-02", end="2024-01-03"))
    assert other.schema.fingerprint != mine.schema.fingerprint
    mine.store.dir.mkdir(parents=True)
    for ext in ("rec", "idx", "json"):
        shutil.copy(other.store.dir / f"2024-01-03.{ext}", mine.store.dir / f"2024-01-03.{ext}")
    with Watcher(mine) as w:
        report = w.cycle()
    assert report.adopted == []
    assert published(mine.store.dir) == ["2024-01-02", "2024-01-03"]
    # Its files are never written over (issue 54): this schema's shard is version 2 beside them.
    assert Manifest.load(mine.store.dir / "manifest.json").shards[-1].rec == "2024-01-03.v2.rec"
    assert Sidecar.load(mine.store.dir / "2024-01-03.v2.json").fingerprint == mine.schema.fingerprint
    assert Sidecar.load(mine.store.dir / "2024-01-03.json").fingerprint == other.schema.fingerprint
    with ShardIter(mine.store.dir, 4, cache_dir=tmp_path / "c") as it:
        assert sum(b.data[0].shape[0] - b.pad for b in it) == it.records_per_epoch > 0

"""Reader leases and ownership by pid: other pid namespaces, clock skew, deleted and dropped leases.

The pid-namespace tests run real processes in a new pid namespace (``unshare --pid --fork
--mount-proc``, needs root); where that is not possible they are skipped and the unit tests that
fake the namespace fields still run.
"""

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, make_store, shardgen_cli, write_config

from shardgen import fsutil
from shardgen.fsutil import HOST_TOKEN, clean_temp_files, pid_alive
from shardgen.store import lease_file
from shardgen.store.gc import collect
from shardgen.store.lease import LEASE_DIR, Lease, live_lease_generations, store_clock


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return r.returncode == 0


other_pid_ns = pytest.mark.skipif(not _unshare_works(), reason="unshare --pid not permitted here")


def pid_free_here() -> int:
    """A pid no process of this namespace has (to be given to a process in another namespace)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1000
    return next(p for p in range(top, top - 1000, -1) if not pid_alive(p))


def in_other_pid_ns(code: str, *, pid: int = 0, **kw) -> subprocess.Popen:
    """Run ``code`` with python in a new pid namespace, as pid ``pid`` of that namespace (0: any)."""
    outer = (
        "import subprocess, sys\n"
        f"if {pid}: open('/proc/sys/kernel/ns_last_pid', 'w').write('{pid - 1}')\n"
        f"sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", outer],
                            env=env, text=True, start_new_session=True, **kw)


def retired_store(tmp_path: Path) -> Path:
    """A store whose generation 2 retired 2024-01-02 (listed by generation 1)."""
    store = tmp_path / "proj" / "shards"
    make_store(store, {"2024-01-02": 10}, window=1)
    make_store(store, {"2024-01-03": 10}, window=1, base_id=10)
    return store


def write_lease(store: Path, name: str, **info) -> Path:
    path = store / LEASE_DIR / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"generation": 1, "host": lease_file.HOST, "pid": os.getpid(),
                                "pidns": lease_file.PIDNS, "boot_id": lease_file.BOOT, **info}))
    return path


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# -- liveness ----------------------------------------------------------------------------------


@other_pid_ns
def test_lease_from_another_pid_namespace_lives_while_its_heartbeat_is_fresh(tmp_path):
    store = retired_store(tmp_path)
    pid = pid_free_here()
    reader = in_other_pid_ns(
        "import os, sys, time\n"
        "from shardgen.store.lease import Lease\n"
        f"lease = Lease({str(store)!r}, refresh_s=0.2)\n"
        "lease.renew(1)\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(60)\n", pid=pid, stdout=subprocess.PIPE)
    try:
        assert int(reader.stdout.readline()) == pid  # a pid that does not exist in this namespace
        [path] = (store / LEASE_DIR).glob("*.json")
        info = json.loads(path.read_text())
        assert info["host"] == lease_file.HOST and info["pid"] == pid and not pid_alive(pid)
        assert info["pidns"] != lease_file.PIDNS and info["boot_id"] == lease_file.BOOT
        beats, first = 0, path.stat().st_mtime_ns
        last, deadline = first, time.monotonic() + 10
        while beats < 3 and time.monotonic() < deadline:  # the heartbeat (every 0.2 s) moves the mtime
            time.sleep(0.05)
            mtime = path.stat().st_mtime_ns
            beats, last = beats + (mtime != last), mtime
        assert beats == 3, "the lease's heartbeat never refreshed it"
        # Fresh under a TTL shorter than its life so far (>= 0.4 s), judged 0.1 s after its last beat
        # by the store's clock (no sleep: a loaded machine may delay a beat, never this judgement).
        assert (last - first) / 1e9 >= 0.4
        assert live_lease_generations(store, 0.3, now=last / 1e9 + 0.1, remove_dead=False) == [1]
        assert collect(store, grace_s=0, lease_ttl_s=60) == []
        assert (store / "2024-01-02.rec").exists()
    finally:
        os.killpg(reader.pid, 9)
        reader.wait()
    # Killed, so the lease file stays behind; it dies by heartbeat age only (store clock).
    assert live_lease_generations(store, 60) == [1]
    assert live_lease_generations(store, 60, now=store_clock(store) + 61) == []
    assert collect(store, grace_s=0, lease_ttl_s=60) == ["2024-01-02"]


@other_pid_ns
def test_shardgen_gc_in_another_pid_namespace_keeps_a_live_readers_shards(tmp_path):
    cfg = write_config(tmp_path / "proj", grace=0)
    store = retired_store(tmp_path)
    reader = Lease(store)  # this process, this namespace: its pid does not exist in gc's namespace
    reader.renew(1)
    probe = in_other_pid_ns(f"import os\ntry:\n    os.kill({os.getpid()}, 0)\nexcept ProcessLookupError:\n"
                            "    print('absent')\n", stdout=subprocess.PIPE)
    assert probe.communicate(timeout=30)[0].strip() == "absent"
    gc_run = in_other_pid_ns(f"from shardgen.cli import main\nraise SystemExit(main(['gc', '-c', {str(cfg)!r}]))",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = gc_run.communicate(timeout=60)
    assert gc_run.returncode == 0, err
    assert "deleted 0 retired shards" in out
    assert (store / "2024-01-02.rec").exists() and reader.path.exists()
    reader.release()
    r = shardgen_cli("gc", "-c", cfg)
    assert r.returncode == 0 and "2024-01-02" in r.stdout


def test_pid_of_another_namespace_or_boot_is_not_trusted(tmp_path):
    """The same as above with the namespace fields faked: only the heartbeat decides."""
    store = retired_store(tmp_path)
    pid = dead_pid()
    write_lease(store, "other-ns.json", pid=pid, pidns="pid:[4026530000]")
    write_lease(store, "other-boot.json", pid=pid, boot_id="00000000-0000-0000-0000-000000000000")
    write_lease(store, "old-format.json", pid=pid, pidns=None, boot_id=None)  # written before pidns existed
    assert live_lease_generations(store, 60) == [1, 1, 1]
    dead = write_lease(store, "same-ns-dead.json", pid=pid)
    assert live_lease_generations(store, 60) == [1, 1, 1] and not dead.exists()
    leases = sorted((store / LEASE_DIR).glob("*.json"))
    assert len(leases) == 3
    old = time.time() - 600
    for path in leases:  # their heartbeat stops: by age they die
        os.utime(path, (old, old))
    assert live_lease_generations(store, 60) == [] and not any(p.exists() for p in leases)


@pytest.mark.parametrize("skew_s", [3600, -3600])
def test_lease_age_is_measured_by_the_store_clock(tmp_path, monkeypatch, skew_s):
    store = retired_store(tmp_path)
    fresh = write_lease(store, "fresh.json", host="elsewhere")
    stale = write_lease(store, "stale.json", host="elsewhere", generation=2)
    old = os.stat(fresh).st_mtime - 600  # stale by the store's clock
    os.utime(stale, (old, old))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)  # this host's clock is wrong
    assert live_lease_generations(store, 60) == [1]
    assert fresh.exists() and not stale.exists()
    assert abs(os.stat(store / LEASE_DIR / ".clock").st_mtime - real_time()) < 5



@pytest.mark.parametrize("last_gc_s", [None, 3600])
def test_a_dead_readers_lease_ages_out_by_the_store_clock_alone(tmp_path, last_gc_s):
    """Issue 64 contract 5: the store folder's clock moves by itself. A reader on another host
    (its pid cannot be checked) stopped beating 10 minutes ago, and nothing but gc touches the
    store: ``shardgen gc`` judges the lease by the store's "now", not by the clock file's mtime
    from the last gc (an hour ago) or by nothing (a store no gc ran on), and collects what only
    that reader's generation kept."""
    cfg = write_config(tmp_path / "proj", grace=0)
    store = retired_store(tmp_path)
    lease = write_lease(store, "elsewhere-1-0000abcd.json", host="elsewhere", pid=1)
    now = time.time()
    os.utime(lease, (now - 600, now - 600))  # beyond the TTL (60 s) by any clock
    clock = store / LEASE_DIR / ".clock"
    if last_gc_s is not None:
        clock.touch()
        os.utime(clock, (now - last_gc_s, now - last_gc_s))  # the last gc ran an hour ago
    r = shardgen_cli("gc", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "2024-01-02" in r.stdout and not (store / "2024-01-02.rec").exists()
    assert not lease.exists()
    assert abs(clock.stat().st_mtime - time.time()) < 60  # gc set the store's "now"

# -- the heartbeat ------------------------------------------------------------------------------


def test_a_deleted_lease_is_written_again_within_a_refresh_period(tmp_path, caplog):
    store = tmp_path / "s"
    store.mkdir()
    lease_ = Lease(store, refresh_s=0.1)
    lease_.renew(3)
    lease_.path.unlink()
    deadline = time.monotonic() + 2
    while not lease_.path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(lease_.path.read_text())["generation"] == 3
    assert "was deleted; writing it again" in caplog.text
    assert live_lease_generations(store, 60) == [3]
    thread = lease_._thread
    lease_.release()
    thread.join(timeout=10)  # the heartbeat has ended: nothing can write the lease again
    assert not thread.is_alive() and not lease_.path.exists()


def test_a_dropped_lease_removes_its_file_and_stops_its_thread(tmp_path):
    store = tmp_path / "s"
    store.mkdir()
    before = set(threading.enumerate())  # earlier tests' iterators may still hold leases
    lease_ = Lease(store, refresh_s=0.05)
    lease_.renew(1)
    path, thread = lease_.path, lease_._thread
    time.sleep(0.2)
    del lease_
    gc.collect()
    deadline = time.monotonic() + 10  # removed by a thread of its own (see the next test)
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not path.exists()
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "shardgen-lease" and t not in before]


def test_a_dropped_lease_is_removed_off_the_thread_that_collects_it(tmp_path, monkeypatch):
    """Garbage collection runs a dropped Lease's finalizer in whatever thread allocates at that
    moment (a trainer's, inside a botocore call: seen with SHARDGEN_TEST_SHUFFLE=1): its removal,
    a request with retries against a store that may be gone, runs in a thread of its own."""
    removing, go, where = threading.Event(), threading.Event(), []

    def slow_remove(self):
        where.append(threading.current_thread().name)
        removing.set()
        go.wait(8)  # in the collecting thread (the bug), gc.collect() takes this long
        self.path.unlink()

    monkeypatch.setattr(lease_file.FileHeartbeat, "remove", slow_remove)
    lease_ = Lease(tmp_path, refresh_s=60)
    lease_.renew(1)
    path = lease_.path
    del lease_
    started = time.monotonic()
    gc.collect()
    assert time.monotonic() - started < 4 and removing.wait(10) and path.exists()  # not waited for here
    assert where == ["shardgen-lease-release"]
    go.set()
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not path.exists()


def test_a_released_lease_is_not_removed_again_when_collected(tmp_path, monkeypatch):
    """release() with the store gone fails its removal once (the lease ages out); collecting the
    Lease later sends no second request. Renewed after release, it is placed again and removed again."""
    calls = []

    def gone(self):
        calls.append(threading.current_thread().name)
        raise OSError("the store is gone")

    before = set(threading.enumerate())  # an earlier test's removal may still be retrying
    lease_ = Lease(tmp_path, refresh_s=60)
    lease_.renew(1)
    monkeypatch.setattr(lease_file.FileHeartbeat, "remove", gone)
    lease_.release()
    lease_.release()
    assert len(calls) == 1
    lease_.renew(2)  # placed again: the next release removes it again
    lease_.release()
    assert len(calls) == 2
    del lease_
    gc.collect()
    time.sleep(0.3)  # a removal thread, had one been started, has called remove by now
    assert len(calls) == 2
    assert not [t for t in threading.enumerate() if t.name == "shardgen-lease-release" and t not in before]


_EXIT_SCRIPT = """
import gc, sys, time
from shardgen.store import lease_file
from shardgen.store.lease import Lease
real = lease_file.FileHeartbeat.remove
def slow(self):  # an S3 DELETE or an NFS unlink takes a while
    import threading
    print("removed in", threading.current_thread().name, flush=True)
    time.sleep(0.05)
    real(self)
lease_file.FileHeartbeat.remove = slow
lease = Lease(sys.argv[1], refresh_s=60)
lease.renew(1)
if sys.argv[2] == "dropped":
    del lease
    gc.collect()  # its removal starts in a thread of its own, and the interpreter exits at once
elif sys.argv[2] == "forked":
    import os
    pid = os.fork()
    if pid == 0:  # the child drops the Lease it inherited, waits for any removal, exits normally
        del lease
        gc.collect()
        time.sleep(0.5)
        sys.exit(0)
    os.waitpid(pid, 0)
    print("parent's lease after the child:", sorted(p.name for p in lease.path.parent.iterdir()))
    lease.release()
"""


@pytest.mark.parametrize("how", ["dropped", "held"])
def test_a_lease_left_to_the_exit_is_removed_before_the_process_ends(tmp_path, how):
    """Found in review: a Lease dropped just before exit (its removal in a daemon thread, killed
    with the interpreter), or still held at exit (weakref.finalize's exit hook runs before it sets
    ``_shutdown``: the "in place" branch never ran), left its lease behind when removing takes 50 ms."""
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), how], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert not list((tmp_path / LEASE_DIR).iterdir()), r.stderr
    if how == "held":  # at exit, in place (Python 3.12 refuses to start a thread then)
        assert r.stdout.splitlines() == ["removed in MainThread"], r.stdout


def test_a_forked_child_leaves_its_parents_lease_alone(tmp_path):
    """A child forked from a reader inherits its Lease and, exiting normally, runs its finalizer:
    it must not remove the parent's live lease (gc would not see the reader until its next beat)."""
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), "forked"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "parent's lease after the child: ['" in r.stdout, r.stdout + r.stderr
    assert not list((tmp_path / LEASE_DIR).iterdir())


def test_a_write_the_store_took_before_failing_is_still_removed(tmp_path, monkeypatch):
    """An S3 PUT applied whose response was lost raises, yet the lease is there: release() removes it."""
    real = lease_file.atomic_write

    def took_then_failed(path, data, **kw):
        real(path, data, **kw)
        raise OSError("connection reset")

    lease_ = Lease(tmp_path, refresh_s=60)
    monkeypatch.setattr(lease_file, "atomic_write", took_then_failed)
    lease_.renew(1)
    assert lease_.path.exists()
    lease_.release()
    assert not lease_.path.exists()


def test_a_lease_can_be_renewed_after_release(tmp_path):
    lease_ = Lease(tmp_path, refresh_s=0.05)
    lease_.renew(1)
    lease_.release()
    lease_.renew(2)
    lease_.path.unlink()
    deadline = time.monotonic() + 10  # the renewed lease's heartbeat (every 0.05 s) writes it again
    while not lease_.path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(lease_.path.read_text())["generation"] == 2
    lease_.release()


def test_renewing_the_same_generation_writes_nothing_and_a_failed_write_is_retried(tmp_path, monkeypatch):
    """A reader renews at every reset(): the lease is written when its generation changes (or the
    last write failed), not every epoch; the heartbeat keeps it fresh meanwhile."""
    lease_ = Lease(tmp_path, refresh_s=60)
    writes = []
    real = lease_file.atomic_write

    def counted(path, data, **kw):
        writes.append(data)
        real(path, data, **kw)

    monkeypatch.setattr(lease_file, "atomic_write", counted)
    lease_.renew(1)
    lease_.renew(1)
    assert len(writes) == 1
    lease_.renew(2)
    assert len(writes) == 2 and json.loads(lease_.path.read_text())["generation"] == 2

    def failing(path, data, **kw):
        writes.append(data)
        raise OSError("disk full")

    monkeypatch.setattr(lease_file, "atomic_write", failing)
    lease_.renew(3)  # fails (a warning): the file still says 2
    monkeypatch.setattr(lease_file, "atomic_write", counted)
    lease_.renew(3)  # not skipped: the lease never said 3
    assert len(writes) == 4 and json.loads(lease_.path.read_text())["generation"] == 3
    lease_.release()
    lease_.renew(3)  # released: written again
    assert len(writes) == 5 and lease_.path.exists()
    lease_.release()


def test_a_deleted_lease_is_written_again_at_the_next_renew(tmp_path):
    """Found in review: renew() skipped the write for the same generation even when the file was
    gone, so a reader's reset() no longer put back a deleted lease (gc had up to a refresh period)."""
    lease_ = Lease(tmp_path, refresh_s=60)
    lease_.renew(4)
    lease_.path.unlink()
    lease_.renew(4)  # the heartbeat is 60 s away: renew itself writes it again
    assert json.loads(lease_.path.read_text())["generation"] == 4
    lease_.release()


def test_a_process_whose_main_thread_exited_is_alive_while_its_threads_run(tmp_path):
    """Found in review: a process whose main thread called pthread_exit shows ``State: Z`` while its
    other threads run; pid_alive called it dead and its live temp file was deleted."""
    script = ("import ctypes, threading, time\n"
              "threading.Thread(target=time.sleep, args=(30,)).start()\n"
              "ctypes.CDLL(None).pthread_exit(None)\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while "Z" not in Path(f"/proc/{proc.pid}/status").read_text().split("State:")[1].split()[0]:
            assert time.monotonic() < deadline, "the main thread did not exit"
            time.sleep(0.01)
        assert pid_alive(proc.pid)
        live = tmp_path / f".2024-01-08.rec.tmp-{HOST_TOKEN}-{proc.pid}-0123abcd"
        live.write_bytes(b"in progress")
        assert clean_temp_files(tmp_path) == [] and live.exists()
    finally:
        proc.kill()
        proc.wait()


# -- temp files and loader folders --------------------------------------------------------------


@other_pid_ns
def test_temp_files_of_a_writer_in_another_pid_namespace_survive(tmp_path):
    pid = pid_free_here()
    writer = in_other_pid_ns(
        "from pathlib import Path\nfrom shardgen.fsutil import temp_name\n"
        f"t = temp_name(Path({str(tmp_path)!r}) / '2024-01-02.rec')\nt.write_bytes(b'half')\nprint(t.name)\n",
        pid=pid, stdout=subprocess.PIPE)
    name = writer.communicate(timeout=30)[0].strip()
    assert f"-{pid}-" in name and not pid_alive(pid) and HOST_TOKEN not in name
    assert clean_temp_files(tmp_path) == []
    assert (tmp_path / name).exists()


def test_temp_files_are_judged_by_pid_only_in_our_namespace(tmp_path, monkeypatch):
    pid = dead_pid()
    other = tmp_path / f".2024-01-02.rec.tmp-{fsutil.host_token(lease_file.HOST)}_0badc0de-{pid}-0123abcd"
    mine = tmp_path / f".2024-01-03.rec.tmp-{HOST_TOKEN}-{pid}-0123abcd"
    other.write_bytes(b"x")
    mine.write_bytes(b"x")
    assert clean_temp_files(tmp_path) == [mine]
    assert other.exists()


def test_loader_folders_are_judged_by_pid_only_in_our_namespace(tmp_path):
    from loader.source.plan import _clean_dead_processes

    pid = dead_pid()
    other = tmp_path / f"{fsutil.host_token(lease_file.HOST)}_0badc0de-{pid}"
    mine, alive = tmp_path / f"{HOST_TOKEN}-{pid}", tmp_path / f"{HOST_TOKEN}-{os.getpid()}"
    for folder in (other, mine, alive):
        (folder / "plan").mkdir(parents=True)
    _clean_dead_processes(tmp_path)
    assert other.exists() and alive.exists() and not mine.exists()


def test_a_new_lease_removes_the_leases_of_dead_processes_of_this_host_only(tmp_path):
    """kill -9 leaves a reader's lease behind; the next lease taken on this host removes it at once.
    A live process's lease, and any lease named for another host or pid namespace, stay (gc and
    the TTL judge those)."""
    leases = tmp_path / LEASE_DIR
    leases.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone
    names = {"dead": f"{HOST_TOKEN}-{dead.pid}-0123abcd.json",
             "live": f"{HOST_TOKEN}-{os.getpid()}-0123abcd.json",
             "other namespace": f"otherhost_0123abcd-{dead.pid}-0123abcd.json"}
    for name in names.values():
        (leases / name).write_text('{"generation": 1}')
    lease_ = Lease(tmp_path)
    try:
        assert {p.name for p in leases.glob("*.json")} == {names["live"], names["other namespace"]}
    finally:
        lease_.release()


def test_no_lease_is_judged_by_pid_when_the_pid_namespace_is_unknown(tmp_path, monkeypatch):
    """Without /proc's namespace and boot id (the token ends in ``_nons``) a pid could be another
    namespace's: a new lease removes nothing then."""
    import re

    from shardgen.store import FolderStore, lease, naming

    monkeypatch.setattr(lease, "HOST_TOKEN", "host_nons")
    monkeypatch.setattr(naming, "_THIS_HOSTS_LEASE", re.compile(r"^host_nons-(?P<pid>\d+)-[0-9a-f]{8}\.json$"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LEASE_DIR).mkdir()
    stale = tmp_path / LEASE_DIR / f"host_nons-{dead.pid}-0123abcd.json"
    stale.write_text('{"generation": 1}')
    assert lease.remove_dead_leases_of_this_host(FolderStore(tmp_path)) == []
    assert stale.exists()


# -- gc's rules at their edges (issue 56) -----------------------------------------------------------


def _edit(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def test_a_retired_shard_of_unknown_generation_stays_while_any_reader_lives(tmp_path):
    """A retired entry without ``retired_generation`` (written before it was recorded): which
    generations listed it is unknown, so any live reader may read it; it goes once none lives."""
    store = retired_store(tmp_path)
    for path in (store / "manifest.json", store / "generations" / "2.json"):
        _edit(path, lambda obj: [e.pop("retired_generation") for e in obj["retired"]])
    reader = Lease(store)
    reader.renew(2)  # the newest generation (it does not list the shard, as far as anyone knows)
    try:
        assert collect(store, grace_s=0, lease_ttl_s=60) == []
        assert (store / "2024-01-02.rec").exists()
    finally:
        reader.release()
    assert collect(store, grace_s=0, lease_ttl_s=60) == ["2024-01-02"]
    assert not (store / "2024-01-02.rec").exists()


@pytest.mark.parametrize("snapshots", ["unreadable", "gone"])
def test_a_kept_snapshot_that_cannot_be_read_keeps_every_retired_shard(tmp_path, snapshots):
    """Generation 1 lists 2024-01-02, generation 2 retired it long ago (past grace), generation 3 came
    just now. With the snapshots of 1 and 2 unreadable, nothing says when 1 was superseded: it is
    kept (grace) and what it lists is unknown, so no retired file goes. Without them (deleted), the
    shard is past grace and listed by nothing kept: it goes."""
    store = retired_store(tmp_path)
    make_store(store, {"2024-01-04": 10}, window=2, base_id=20)  # generation 3: nothing more retired
    assert json.loads((store / "manifest.json").read_text())["generation"] == 3
    for path in (store / "manifest.json", store / "generations" / "3.json"):
        _edit(path, lambda obj: [e.update(retired_at="2020-01-01T00:00:00Z") for e in obj["retired"]])
    for n in (1, 2):
        if snapshots == "unreadable":
            (store / "generations" / f"{n}.json").write_text("{bad")
        else:
            (store / "generations" / f"{n}.json").unlink()
    gone = collect(store, grace_s=3600, lease_ttl_s=60)
    assert gone == ([] if snapshots == "unreadable" else ["2024-01-02"])
    assert (store / "2024-01-02.rec").exists() == (snapshots == "unreadable")

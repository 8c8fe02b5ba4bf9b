"""The store side on a real S3-compatible server (``rclone serve s3`` on loopback, the ``s3``
fixture): build, verify, status, watch and gc through the CLI, in subprocesses; faults of the
endpoint, of the credentials, a second writer, kill -9 mid-build, reader leases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, runs, write_config

from shardgen.config import load_config
from shardgen.errors import LockError
from shardgen.produce.build import build
from shardgen.store.manifest import Manifest
from shardgen.store.objstore import ObjectStore

pytestmark = pytest.mark.slow

DATES_4 = ["2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05"]
DATES_14 = DATES_4 + ["2024-01-08", "2024-01-09", "2024-01-10", "2024-01-11", "2024-01-12",
                      "2024-01-15", "2024-01-16", "2024-01-17", "2024-01-18", "2024-01-19"]


# -- helpers --------------------------------------------------------------------------------------

def s3_config(folder: Path, url: str, *, lease_ttl_s=None, **kw) -> Path:
    """``write_config`` with ``[store] dir = url`` (and optionally ``lease_ttl_s``)."""
    path = write_config(folder, **kw)
    text = path.read_text().replace('dir = "shards"', f'dir = "{url}"')
    if lease_ttl_s is not None:
        text = text.replace("grace_s =", f"lease_ttl_s = {lease_ttl_s}\ngrace_s =")
    path.write_text(text)
    assert load_config(path).store.remote == url
    return path


def env(**override) -> dict:
    """This process's environment (the fixture's AWS_* variables included) for a subprocess."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **override}


def cli(*args, timeout=60, **override) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardgen.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env(**override))


def start_cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardgen.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=10)


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def objects(s3, prefix: str) -> Path:
    """The server's folder holding the objects of ``s3://data/<prefix>``."""
    return s3.root / s3.bucket / prefix


def files(folder: Path) -> dict[str, bytes]:
    """Relative name -> bytes of every file under ``folder``, dot-files (locks, state, clock) left out."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}


def manifest_of(folder: Path, name: str = "manifest.json") -> Manifest:
    return Manifest.load(folder / name)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """stderr is exactly one 'shardgen: error:' line, no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("shardgen: error: "), r.stderr
    return lines[0]


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def age(path: Path, seconds: float) -> None:
    """Make an object look ``seconds`` old to the server (rclone reports a file's mtime as Last-Modified)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


# -- 1, 2: build, status, verify ------------------------------------------------------------------

def test_build_to_s3_matches_a_local_build_and_status_verify_work(s3, tmp_path):
    local_cfg = write_config(tmp_path / "local")
    build(load_config(local_cfg))
    local = tmp_path / "local" / "shards"

    cfg = s3_config(tmp_path / "remote", s3.url("st"))
    r = cli("build", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "published 4 dates" in r.stdout
    remote = objects(s3, "st")

    got, want = files(remote), files(local)
    assert sorted(got) == sorted(want)
    shard_files = [n for n in want if n.startswith("20")]
    assert len(shard_files) == 12  # rec, idx, json of 4 dates
    for name in shard_files:
        assert got[name] == want[name], f"{name} differs from the local build"
    snapshots = [n for n in want if n.startswith("generations/")]
    assert snapshots
    for name in ["manifest.json", *snapshots]:
        g, w = manifest_of(remote, name), manifest_of(local, name)
        assert (g.generation, g.shards, g.retired, g.window) == (w.generation, w.shards, w.retired, w.window)
    assert [s.date for s in manifest_of(remote).shards] == DATES_4
    assert not (remote / ".writer.lock").exists()  # released

    staging = load_config(cfg).store.dir
    assert staging == (tmp_path / "remote" / ".shardgen-staging" / "data" / "st").resolve()
    assert [p for p in staging.rglob("*") if p.is_file()] == []

    st = cli("status", "--json", "-c", cfg)
    assert st.returncode == 0, st.stderr
    info = json.loads(st.stdout)
    assert info["manifest"] == "s3://data/st/manifest.json"
    assert (info["shards"], info["first_date"], info["last_date"]) == (4, DATES_4[0], DATES_4[-1])
    assert info["windows"] == manifest_of(local).samples
    assert info["snapshots"] == [1] and info["watch_updated"] is None

    v = cli("verify", "-c", cfg)
    assert v.returncode == 0, v.stderr
    assert "verified 4 shards of generation 1: 0 bad" in v.stdout


def test_verify_detects_a_flipped_byte_in_a_rec_object(s3, tmp_path):
    cfg = s3_config(tmp_path / "p", s3.url("st"))
    assert cli("build", "-c", cfg).returncode == 0
    flip_byte(objects(s3, "st") / "2024-01-04.rec")
    v = cli("verify", "-c", cfg)
    assert v.returncode == 1, (v.stdout, v.stderr)
    assert "Traceback" not in v.stderr
    assert "2024-01-04" in v.stderr
    assert not any(d in v.stderr for d in ("2024-01-02", "2024-01-03", "2024-01-05")), v.stderr
    assert "1 bad" in v.stdout


# -- 3, 4: an unreachable endpoint, refused credentials ------------------------------------------

@pytest.mark.parametrize("how", ["server killed", "nothing listens"])
def test_endpoint_down_is_one_line_exit_3_in_bounded_time(s3, tmp_path, how):
    from s3server import free_port

    cfg = s3_config(tmp_path / "p", s3.url("st"))
    if how == "server killed":
        s3.kill()
        endpoint = s3.endpoint
    else:
        endpoint = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = cli("build", "-c", cfg, timeout=60, AWS_ENDPOINT_URL=endpoint)
    took = time.monotonic() - t0
    assert r.returncode == 3, (r.stdout, r.stderr)  # the environment failed (docs/config.md)
    line = one_error_line(r)
    assert endpoint in line and "s3://data/st" in line, line
    assert took < 30, f"took {took:.1f}s"
    assert not (tmp_path / "p" / "raw").exists()  # nothing was generated for a store we cannot reach


def test_wrong_credentials_are_refused_in_one_line(s3, tmp_path):
    cfg = s3_config(tmp_path / "p", s3.url("st"))
    t0 = time.monotonic()
    r = cli("build", "-c", cfg, AWS_SECRET_ACCESS_KEY="not-the-secret")
    assert r.returncode != 0
    line = one_error_line(r)
    assert "refused our credentials" in line and "AWS_SECRET_ACCESS_KEY" in line, line
    assert time.monotonic() - t0 < 30
    assert not (objects(s3, "st") / "manifest.json").exists()
    # the right credentials then work
    assert cli("build", "-c", cfg).returncode == 0


# -- 5: one writer ----------------------------------------------------------------------------------

def test_a_second_writer_is_refused_while_a_watcher_runs(s3, tmp_path):
    url = s3.url("st")
    lock = objects(s3, "st") / ".writer.lock"
    watch_cfg = s3_config(tmp_path / "machine-a", url)
    build_cfg = s3_config(tmp_path / "machine-b", url)
    watcher = start_cli("watch", "-c", watch_cfg, "--interval", "1")
    try:
        wait_for(lambda: lock.exists() or watcher.poll() is not None, "the watcher's .writer.lock")
        assert watcher.poll() is None, watcher.communicate(timeout=10)
        holder = json.loads(lock.read_text())
        assert holder["pid"] == watcher.pid and holder["what"] == "watch"

        r = cli("build", "-c", build_cfg)
        assert r.returncode == 2, (r.stdout, r.stderr)
        line = one_error_line(r)
        assert "another writer" in line and f"pid {watcher.pid}" in line and "watch" in line, line
        assert not (tmp_path / "machine-b" / "raw").exists()  # refused before generating anything

        # the watcher publishes meanwhile, undisturbed (each date as it is done)
        def all_published():
            path = objects(s3, "st") / "manifest.json"
            return path.exists() and [s.date for s in manifest_of(objects(s3, "st")).shards] == DATES_4

        wait_for(all_published, "the watcher to publish every due date")
        watcher.send_signal(signal.SIGTERM)
        out, err = watcher.communicate(timeout=30)
        assert watcher.returncode == 0, err
    finally:
        if watcher.poll() is None:
            kill_group(watcher)
    assert not lock.exists()
    assert [s.date for s in manifest_of(objects(s3, "st")).shards] == DATES_4
    # with the watcher gone, the other machine may write
    r = cli("build", "-c", build_cfg)
    assert r.returncode == 0, r.stderr


# -- 6: kill -9 mid-build ---------------------------------------------------------------------------

def test_kill_9_mid_build_converges_after_the_stale_lock_expires(s3, tmp_path):
    cfg = s3_config(tmp_path / "p", s3.url("st"), end="2024-01-19", jobs=2, modes={"*": "slow:0.3"},
                    lease_ttl_s=30)
    remote = objects(s3, "st")
    lock = remote / ".writer.lock"

    def sidecars():
        return sorted(p.name for p in remote.glob("20??-??-??.json")) if remote.exists() else []

    first = start_cli("build", "-c", cfg)
    try:
        wait_for(lambda: len(sidecars()) >= 4 or first.poll() is not None, "4 sidecar objects", timeout=60)
    finally:
        kill_group(first)
    assert first.returncode == -signal.SIGKILL, "the build ended before it was killed"
    assert 4 <= len(sidecars()) < len(DATES_14)
    assert lock.exists() and json.loads(lock.read_text())["pid"] == first.pid  # the killed build's lock
    if (remote / "manifest.json").exists():  # whatever was published is whole
        assert cli("verify", "-c", cfg).returncode == 0

    # Its heartbeat is fresh: a rerun at once is refused, saying why and by whom.
    r = cli("build", "-c", cfg)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = one_error_line(r)
    assert "another writer" in line and f"pid {first.pid}" in line and "heartbeat" in line, line

    # Once no heartbeat came for lease_ttl_s (aged on the server rather than waited for), it is taken over.
    age(lock, 31)
    r = cli("build", "-c", cfg, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "taking over a stale writer lock" in r.stderr and f"pid {first.pid}" in r.stderr
    assert "Traceback" not in r.stderr
    assert not lock.exists()
    assert [s.date for s in manifest_of(remote).shards] == DATES_14
    v = cli("verify", "-c", cfg)
    assert v.returncode == 0, v.stderr
    assert f"verified {len(DATES_14)} shards" in v.stdout
    staging = load_config(cfg).store.dir
    assert [p.name for p in staging.rglob("*") if p.is_file()] == []


def test_a_shard_left_in_staging_by_a_killed_run_is_adopted_and_removed_from_staging(s3, tmp_path):
    """A worker killed after uploading a shard but before removing its staging copy: the next
    build adopts the shard from the store and the staging copy goes (it used to stay forever)."""
    other = write_config(tmp_path / "other")
    build(load_config(other))
    made = tmp_path / "other" / "shards"
    cfg = s3_config(tmp_path / "p", s3.url("st"))
    staging = load_config(cfg).store.dir
    remote = objects(s3, "st")
    for folder in (remote, staging):
        folder.mkdir(parents=True)
        for ext in ("rec", "idx", "json"):
            (folder / f"2024-01-05.{ext}").write_bytes((made / f"2024-01-05.{ext}").read_bytes())
    r = cli("build", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "2024-01-05" not in runs(tmp_path / "p")  # adopted, not generated again
    assert [s.date for s in manifest_of(remote).shards] == DATES_4
    assert [p.name for p in staging.rglob("*") if p.is_file()] == []


# -- 7: gc, grace and reader leases -----------------------------------------------------------------

def reader_lease(store: ObjectStore, generation: int):
    """A reader lease on ``generation`` in the store: ``shardgen.store.lease.Lease`` if it takes an
    ObjectStore, else the lease object written directly. Returns a function that releases it."""
    from shardgen.store.lease import Lease

    try:
        lease = Lease(store)
    except TypeError:  # Lease only knows store folders
        lease = None
    if lease is not None:
        lease.renew(generation)
        if any(n.startswith("leases/") and n.endswith(".json") for n in store.list("leases/")):
            return lease.release
        lease.release()
    name = "leases/test-reader.json"
    store.put(name, json.dumps({"generation": generation, "host": "reader-host", "pid": 1}).encode())
    return lambda: store.delete(name)


def test_gc_keeps_files_within_grace_or_read_by_a_live_lease_and_deletes_them_after(s3, tmp_path):
    cfg = s3_config(tmp_path / "p", s3.url("st"), window=2, grace=0)
    remote = objects(s3, "st")
    assert cli("build", "-c", cfg, "--end", "2024-01-03").returncode == 0
    assert cli("build", "-c", cfg).returncode == 0
    m = manifest_of(remote)
    assert [s.date for s in m.shards] == DATES_4[2:]
    assert [r.date for r in m.retired] == DATES_4[:2]
    old = manifest_of(remote, "generations/1.json")
    assert [s.date for s in old.shards] == DATES_4[:2]
    retired_files = sorted(n for r in m.retired for n in (r.rec, r.idx))
    assert all((remote / n).exists() for n in retired_files)

    # Within grace_s (the same store, from a config that says grace_s = 3600), nothing goes.
    patient = s3_config(tmp_path / "patient", s3.url("st"), window=2, grace=3600)
    r = cli("gc", "-c", patient)
    assert r.returncode == 0 and "deleted 0 retired shards" in r.stdout, (r.stdout, r.stderr)
    assert all((remote / n).exists() for n in retired_files)

    release = reader_lease(ObjectStore(s3.url("st")), 1)
    r = cli("gc", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "deleted 0 retired shards" in r.stdout
    assert all((remote / n).exists() for n in retired_files)
    assert (remote / "generations" / "1.json").exists()  # the lease's generation keeps its snapshot
    assert [r.date for r in manifest_of(remote).retired] == DATES_4[:2]
    assert cli("verify", "-c", cfg).returncode == 0

    release()
    r = cli("gc", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "deleted 2 retired shards: 2024-01-02, 2024-01-03" in r.stdout
    assert not any((remote / n).exists() for n in retired_files)
    assert not (remote / "2024-01-02.json").exists() and not (remote / "2024-01-03.json").exists()
    after = manifest_of(remote)
    assert after.retired == () and [s.date for s in after.shards] == DATES_4[2:]
    assert not (remote / "generations" / "1.json").exists()  # superseded, past grace 0, no lease
    assert not (remote / ".writer.lock").exists()
    v = cli("verify", "-c", cfg)
    assert v.returncode == 0, v.stderr
    # a later build does not bring the retired dates back
    r = cli("build", "-c", cfg)
    assert r.returncode == 0 and "published 0 dates" in r.stdout
    assert [s.date for s in manifest_of(remote).shards] == DATES_4[2:]


# -- 8: watch --once ------------------------------------------------------------------------------

def test_watch_once_publishes_due_dates_and_adopts_only_good_shards(s3, tmp_path):
    # Shards "from another producer", made by a local build of the same config.
    other = write_config(tmp_path / "other", start="2024-01-08", end="2024-01-09")
    build(load_config(other))
    made = tmp_path / "other" / "shards"
    remote = objects(s3, "st")
    remote.mkdir(parents=True)
    for date in ("2024-01-08", "2024-01-09"):
        for ext in ("rec", "idx", "json"):
            (remote / f"{date}.{ext}").write_bytes((made / f"{date}.{ext}").read_bytes())
    flip_byte(remote / "2024-01-09.rec")  # same size: only a check of its bytes finds it
    (remote / "2024-01-10.json").write_bytes(b"not a sidecar")

    cfg = s3_config(tmp_path / "p", s3.url("st"))
    r = cli("watch", "--once", "-c", cfg, "--interval", "1")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    m = manifest_of(remote)
    assert [s.date for s in m.shards] == DATES_4 + ["2024-01-08"]
    assert "not adopting the shard in the store" in r.stderr and "2024-01-09" in r.stderr
    assert (remote / ".watch-state.json").exists()
    assert not (remote / ".writer.lock").exists()
    v = cli("verify", "-c", cfg)
    assert v.returncode == 0, v.stderr

    st = cli("status", "--json", "-c", cfg)
    assert st.returncode == 0, st.stderr
    info = json.loads(st.stdout)
    assert info["watch_updated"] and info["failing"] == []
    assert info["shards"] == 5
    text = cli("status", "-c", cfg)
    assert text.returncode == 0 and "watcher: NOT RUNNING (no heartbeat file" in text.stdout, text.stdout
    assert "; last cycle " in text.stdout


def test_status_tells_whether_the_watcher_of_an_s3_store_is_alive(s3, tmp_path):
    """Alive while it runs; after kill -9 its pid (this host's) is gone; a status on another host,
    which cannot check the pid, judges the heartbeat object's age by the store's clock."""
    cfg = s3_config(tmp_path / "p", s3.url("wa"), end="2024-01-03")

    def watcher() -> dict:
        r = cli("status", "--json", "-c", cfg)
        return json.loads(r.stdout)["watcher"] if r.returncode == 0 else {"alive": None}

    proc = start_cli("watch", "-c", cfg, "--interval", "0.5")
    try:
        wait_for(lambda: watcher()["alive"] is True, "status: the watcher is alive")
        assert watcher()["pid"] == proc.pid
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        wait_for(lambda: watcher()["alive"] is False, "status: the killed watcher is not alive")
        assert watcher()["why"] == f"process {proc.pid} is gone"
    finally:
        kill_group(proc)
    beat = objects(s3, "wa") / ".watch-heartbeat.json"
    info = json.loads(beat.read_text())
    beat.write_text(json.dumps({**info, "host": "elsewhere"}))  # as a status on another host sees it: fresh
    assert watcher()["alive"] is True
    age(beat, 120)  # its heartbeat stopped two minutes ago (store.lease_ttl_s: 60)
    w = watcher()
    assert w["alive"] is False and w["why"].startswith("no heartbeat for 1") and w["heartbeat_age_s"] >= 110
    text = cli("status", "-c", cfg)
    assert f"watcher: NOT RUNNING (pid {proc.pid} on elsewhere, no heartbeat for 1" in text.stdout, text.stdout


def test_a_watcher_that_lost_the_writer_lock_stops_and_uploads_nothing(s3, tmp_path):
    import json as _json

    from shardgen.config import load_config
    from shardgen.store.objstore import ObjectStore
    from shardgen.watch.watcher import Watcher

    cfg = load_config(s3_config(tmp_path / "a", s3.url("st")))
    remote = ObjectStore(s3.url("st"))
    with Watcher(cfg, interval=0.1, today=lambda: __import__("datetime").date(2024, 1, 5)) as watcher:
        foreign = _json.dumps({"token": "someone-else", "host": "other", "pid": 1}).encode()
        for _ in range(50):  # the watcher's first heartbeat, at once after taking the lock, may land over it
            remote.put(".writer.lock", foreign, verify=False)
            time.sleep(0.2)
            if remote.get(".writer.lock") == foreign:
                break
        with pytest.raises(LockError, match="another writer"):
            watcher.run(sleep=lambda s: False)
    assert not [n for n in remote.list() if n.endswith(".rec")]  # nothing generated or uploaded after that


def test_a_build_removes_the_empty_staging_folders_it_made_when_it_exits(s3, tmp_path):
    """``.shardgen-staging/<bucket>/<prefix>``: the folders the build created go when it exits;
    the one that was there before stays."""
    path = s3_config(tmp_path / "a", s3.url("st/sub"), jobs=2)
    (tmp_path / "a" / ".shardgen-staging").mkdir()
    r = cli("build", "-c", path)
    assert r.returncode == 0 and "published 4 dates" in r.stdout, r.stderr
    assert list((tmp_path / "a" / ".shardgen-staging").iterdir()) == []
    assert {p.name for p in objects(s3, "st/sub").glob("*.rec")} == {f"{d}.rec" for d in DATES_4}


def test_only_empty_folders_that_make_dirs_created_are_removed(tmp_path):
    from shardgen.fsutil import make_dirs, remove_empty_dirs

    (tmp_path / "a").mkdir()
    made = make_dirs(tmp_path / "a" / "b" / "c")
    assert made == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    (tmp_path / "a" / "b" / "c" / "left.rec").write_bytes(b"data")
    remove_empty_dirs(made)
    assert (tmp_path / "a" / "b" / "c" / "left.rec").read_bytes() == b"data"
    (tmp_path / "a" / "b" / "c" / "left.rec").unlink()
    remove_empty_dirs(made)
    assert list((tmp_path / "a").iterdir()) == []


@pytest.mark.slow
def test_build_to_s3_on_the_dask_backend(s3, tmp_path):
    from dask.distributed import LocalCluster

    from shardgen.config import load_config
    from shardgen.produce.build import build
    from shardgen.produce.cluster import _close_clients

    path = s3_config(tmp_path / "a", s3.url("dk"), jobs=2)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        path.write_text(path.read_text().replace(
            'backend = "loky"', f'backend = "dask"\nscheduler = "{cluster.scheduler_address}"'))
        cfg = load_config(path)
        report = build(cfg)
        _close_clients()
    assert not report.failed and len(report.published) == 4
    assert {p.name for p in objects(s3, "dk").glob("*.rec")} == {f"2024-01-0{d}.rec" for d in range(2, 6)}
    assert not [p for p in cfg.store.dir.iterdir() if p.suffix in (".rec", ".idx")]
    assert cli("verify", "-c", path).returncode == 0


def test_open_store_picks_one_implementation_and_a_lease_lives_in_that_store(s3, tmp_path):
    """The loader's path, without a config: ``open_store(url)`` and a ``Lease`` built from the Store."""
    from shardgen.store import FolderStore, S3Store, open_store
    from shardgen.store.lease import Lease, live_lease_generations

    store = open_store(s3.url("st"))
    assert isinstance(store, S3Store) and open_store(store) is store
    assert isinstance(open_store(tmp_path / "folder"), FolderStore)
    lease = Lease(store)
    lease.renew(5)
    assert [n for n in store.objects.list("leases/") if n.endswith(".json")]
    assert live_lease_generations(store, 60) == [5]
    lease.release()
    assert live_lease_generations(store, 60) == []


# -- uploads are verified: bytes changed on the way, or held otherwise than acknowledged ------------

@pytest.fixture
def tamper(s3, monkeypatch):
    """A ``TamperingProxy`` between this process's client and the server."""
    from s3server import TamperingProxy

    from shardgen.store import objstore

    with TamperingProxy(s3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        objstore.forget_clients()
        yield proxy
    objstore.forget_clients()


def _flip(data: bytes, at: int = 5) -> bytes:
    changed = bytearray(data)
    changed[at] ^= 0xFF
    return bytes(changed)


@pytest.mark.parametrize("how", ["put", "upload"])
def test_bytes_changed_on_the_way_to_the_server_are_refused_and_never_stored(s3, tamper, tmp_path, how):
    """Content-MD5: the server refuses a body that differs from what we hashed, so the object it
    held before (here a manifest) is never replaced by damaged bytes."""
    from shardgen.store.objstore import ObjectMismatch

    store = ObjectStore(s3.url("store"))
    store.put("manifest.json", b'{"generation": 1}')
    tamper.on_put = lambda key, body: _flip(body)
    new = b'{"generation": 2, "shards": []}'
    (tmp_path / "new.json").write_bytes(new)
    with pytest.raises(ObjectMismatch, match=r"s3://data/store/manifest.json: the server received other bytes "
                                             r"than were sent \(Content-MD5 mismatch\)"):
        store.put("manifest.json", new) if how == "put" else store.upload("manifest.json", tmp_path / "new.json")
    assert (objects(s3, "store") / "manifest.json").read_bytes() == b'{"generation": 1}'
    tamper.on_put = lambda key, body: body
    store.put("manifest.json", new)  # the same bytes, unchanged on the way: accepted
    assert store.get("manifest.json") == new


def test_an_object_held_otherwise_than_acknowledged_is_caught_after_upload(s3, tamper, tmp_path):
    """The HEAD after each upload: a server that acknowledged the PUT but holds other bytes (a
    faulty disk, a buggy gateway) is caught by the ETag (the MD5 of what it holds)."""
    from shardgen.store.objstore import ObjectMismatch

    local = tmp_path / "2024-01-02.rec"
    local.write_bytes(bytes(range(256)) * 40)

    def held_otherwise(key):
        path = s3.root / s3.bucket / key
        path.write_bytes(_flip(path.read_bytes(), 1000))

    tamper.after_put = held_otherwise
    with pytest.raises(ObjectMismatch, match=r"s3://data/store/2024-01-02.rec: ETag [0-9a-f]{32} after upload, "
                                             r"expected MD5 [0-9a-f]{32}"):
        ObjectStore(s3.url("store")).upload("2024-01-02.rec", local)


def test_an_object_of_another_size_after_upload_is_caught(s3, tamper, tmp_path):
    """The HEAD's size: an object the server holds shorter than sent (its ETag as sent) is refused."""
    from shardgen.store.objstore import ObjectMismatch

    local = tmp_path / "2024-01-02.rec"
    local.write_bytes(bytes(range(256)) * 40)
    tamper.on_head = lambda key, headers: {**headers, "Content-Length": str(int(headers["Content-Length"]) - 1)}
    with pytest.raises(ObjectMismatch, match=r"s3://data/store/2024-01-02.rec: 10239 bytes after upload, "
                                             r"expected 10240"):
        ObjectStore(s3.url("store")).upload("2024-01-02.rec", local)


def test_the_retry_budget_is_the_standard_aws_max_attempts(s3, tmp_path, monkeypatch):
    """``AWS_MAX_ATTEMPTS`` (or ``max_attempts`` in the AWS profile) counts our tries of a request
    and of a download; the backoff doubles from 0.5 s up to 8 s."""
    import threading
    import types

    from shardgen.store import objfetch, objstore
    from shardgen.store.objstore import ObjectStoreError, StoreUnreachable

    slept, me = [], threading.get_ident()

    def sleep(s):  # this thread's waits are recorded, not slept; another thread's (an earlier test's) sleep
        slept.append(s) if threading.get_ident() == me else time.sleep(s)

    for module in (objstore, objfetch):  # their waits between tries
        monkeypatch.setattr(module, "time", types.SimpleNamespace(sleep=sleep, time=time.time))
    s3.stop()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    objstore.forget_clients()
    store = ObjectStore(s3.url("store"))
    with pytest.raises(StoreUnreachable, match=r"s3://data/store/manifest.json: GET failed 7 times; cannot reach"):
        store.get("manifest.json")
    assert slept == [0.5, 1, 2, 4, 8, 8]
    slept.clear()
    with pytest.raises(StoreUnreachable, match=r"2024-01-02.rec: download failed 7 times; cannot reach"):
        store.download("2024-01-02.rec", tmp_path / "2024-01-02.rec")
    assert slept == [0.5, 1, 2, 4, 8, 8]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "0")
    objstore.forget_clients()
    with pytest.raises(ObjectStoreError, match=r"AWS_MAX_ATTEMPTS .*: expected a whole number >= 1, got '0'"):
        store.get("manifest.json")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    objstore.forget_clients()
    slept.clear()
    with pytest.raises(StoreUnreachable, match="GET failed 4 times"):  # the default
        store.get("manifest.json")
    assert slept == [0.5, 1, 2]


def test_gc_removes_the_lease_of_a_reader_killed_9_once_its_heartbeat_aged(s3, tmp_path):
    """A training process killed with -9 leaves its reader lease in the bucket (issue 44). While
    its heartbeat is younger than lease_ttl_s, gc keeps it (the reader may be alive elsewhere);
    once it aged past, `shardgen gc` removes it (the watcher runs the same collection)."""
    cfg = s3_config(tmp_path / "p", s3.url("st"), lease_ttl_s=30)
    assert cli("build", "-c", cfg, timeout=120).returncode == 0
    remote = objects(s3, "st")
    script = (f"import time\nfrom loader import ShardIter\nit = ShardIter({s3.url('st')!r}, 4, "
              f"cache_dir={str(tmp_path / 'cache')!r})\nit.next()\nprint('reading', flush=True)\ntime.sleep(600)\n")
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(), start_new_session=True, cwd=ROOT)
    try:
        assert reader.stdout.readline().strip() == "reading", reader.stderr.read()[-2000:]
        leases = sorted((remote / "leases").glob("*.json"))
        assert leases, "the reader holds a lease in the bucket"
    finally:
        kill_group(reader)
    assert reader.returncode == -signal.SIGKILL
    # The same reader as if it ran on another host: this host cannot tell whether its pid lives.
    from shardgen.store import open_store

    store = open_store(s3.url("st"))
    other = [p.with_name(p.stem + "-elsewhere.json") for p in leases]
    bodies = [json.dumps({**json.loads(p.read_text()), "host": "another-host", "pidns": "x", "boot_id": "y"})
              for p in leases]
    for q, body in zip(other, bodies):  # through the server (it lists what it was sent)
        store.objects.put(f"leases/{q.name}", body.encode())
    assert cli("gc", "-c", cfg).returncode == 0
    assert not any(p.exists() for p in leases), "this host's dead process: its lease goes at once"
    assert all(q.exists() for q in other), "a fresh heartbeat of another host is kept: that reader may live"
    from shardgen.store.s3client import client as _client

    for q, body in zip(other, bodies):  # its last heartbeat 40 s ago: rclone keeps the mtime a PUT says
        _client().put_object(Bucket=s3.bucket, Key=f"st/leases/{q.name}", Body=body.encode(),
                             Metadata={"mtime": f"{time.time() - 40:.3f}"})
    r = cli("gc", "-c", cfg, "-v")
    assert r.returncode == 0, r.stderr
    assert not any(q.exists() for q in other), ("its heartbeat aged past lease_ttl_s: gc removed the lease", r.stderr)


def test_an_upload_never_replaces_an_object_there_it_takes_the_next_version(s3, tmp_path):
    """The review's repro: a killed build's worker outlived it (its writer lock taken over) and
    uploaded ``2024-01-05.rec`` over the object the next build had published. ``put_shard`` now
    looks before it uploads: a taken name moves the shard to the next version, and the published
    bytes never change under their manifest entry."""
    from shardgen.store import open_store
    from shardgen.store.sidecar import Sidecar

    cfg = s3_config(tmp_path / "p", s3.url("st"))
    assert cli("build", "-c", cfg).returncode == 0
    remote = objects(s3, "st")
    before = files(remote)
    other = write_config(tmp_path / "other", rows=40)  # another run's windows for the same dates
    build(load_config(other))
    store = open_store(s3.url("st"))
    for ext in ("rec", "idx", "json"):  # the orphan's version 1, staged as its worker left it
        (store.stage() / f"2024-01-05.{ext}").write_bytes((tmp_path / "other" / "shards" / f"2024-01-05.{ext}")
                                                          .read_bytes())
    late = Sidecar.parse((store.stage() / "2024-01-05.json").read_bytes(), "staged sidecar")
    assert late.sha256 != manifest_of(remote).shards[3].sha256
    assert late.rec == "2024-01-05.rec"
    published = store.put_shard(late, "2024-01-05.json")
    assert (published.rec, published.idx) == ("2024-01-05.v2.rec", "2024-01-05.v2.idx")
    after = files(remote)
    assert {k: after[k] for k in before} == before  # every object published before: unchanged
    assert json.loads(after["2024-01-05.v2.json"])["rec"] == "2024-01-05.v2.rec"
    assert cli("verify", "-c", cfg).returncode == 0
    assert not [p for p in store.stage().iterdir() if p.is_file()]  # staging emptied

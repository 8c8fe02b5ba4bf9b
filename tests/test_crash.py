"""Real processes: kill -9 mid-build then re-run, and concurrent builds on one store."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, runs, write_config

from shardgen.config import load_config
from shardgen.fsutil import HOST_TOKEN, clean_temp_files, host_token, temp_name
from shardgen.manifest import Manifest
from shardgen.verify import verify_store

pytestmark = pytest.mark.slow
DATES_8 = ["2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05",
           "2024-01-08", "2024-01-09", "2024-01-10", "2024-01-11"]


def start_build(cfg, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def temp_files(store):
    return [p.name for p in store.iterdir() if ".tmp-" in p.name]


def sidecars(store):
    """Dates whose shard is complete on disk (its sidecar, written last, exists)."""
    return sorted(p.name[:10] for p in store.glob("20??-??-??.json"))


def wait_until(predicate, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_kill_9_mid_build_then_rerun(cfg_dir):
    """kill -9 at observed points of a build (generators running, shards written but not yet
    published): the published manifest stays intact, the killed run leaves partial state, and a
    re-run finishes the job."""
    cfg_path = write_config(cfg_dir, end="2024-01-11", jobs=2, modes={"*": "slow:0.25"}, rows=400)
    store = cfg_dir / "shards"
    first = start_build(cfg_path, "--end", "2024-01-03")
    assert first.wait(timeout=120) == 0
    published = Manifest.load(store / "manifest.json")
    assert [s.date for s in published.shards] == DATES_8[:2]
    stages = [("a generator running", lambda r0, s0: len(runs(cfg_dir)) > r0),
              ("a shard written, not published", lambda r0, s0: len(sidecars(store)) > s0),
              ("two more shards written", lambda r0, s0: len(sidecars(store)) > s0 + 1)]
    for what, reached in stages:
        r0, s0 = len(runs(cfg_dir)), len(sidecars(store))
        proc = start_build(cfg_path)
        try:
            wait_until(lambda: reached(r0, s0) or proc.poll() is not None, what)  # noqa: B023 - waited on here
        finally:
            kill_group(proc)  # the coordinator and its workers, at once
        assert proc.returncode == -signal.SIGKILL, f"the build ended before {what}"
        assert Manifest.load(store / "manifest.json") == published  # intact: nothing half-published
        assert verify_store(store)[1] == []
        if what != stages[0][0]:
            assert set(sidecars(store)) - set(DATES_8[:2]), "no shard left on disk by the killed run"
    assert len(runs(cfg_dir)) > 2  # the killed runs generated dates
    rerun = start_build(cfg_path)
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    m = Manifest.load(store / "manifest.json")
    assert [s.date for s in m.shards] == DATES_8  # every date once
    assert verify_store(store)[1] == []
    assert temp_files(store) == []


def test_dead_writers_temp_files_are_cleaned(cfg_dir):
    cfg = load_config(write_config(cfg_dir))
    cfg.store.dir.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = cfg.store.dir / f".2024-01-02.rec.tmp-{HOST_TOKEN}-{dead.pid}-0123abcd"
    live = cfg.store.dir / f".2024-01-03.rec.tmp-{HOST_TOKEN}-{os.getpid()}-0123abcd"
    stale.write_bytes(b"half")
    live.write_bytes(b"in progress")
    assert clean_temp_files(cfg.store.dir) == [stale]
    assert live.exists()


def test_a_killed_writer_not_yet_reaped_counts_as_dead(cfg_dir):
    """A worker killed with its build can stay a zombie (or take a while to exit) when the re-run
    starts: kill(pid, 0) still answers for it, but its temp file is a dead writer's all the same."""
    store = load_config(write_config(cfg_dir)).store.dir
    store.mkdir(parents=True)
    zombie = subprocess.Popen(["true"])
    try:
        wait_until(lambda: open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z",
                   "the child to exit unreaped", timeout=10)
        stale = store / f".2024-01-08.rec.tmp-{HOST_TOKEN}-{zombie.pid}-0123abcd"
        stale.write_bytes(b"half")
        assert clean_temp_files(store) == [stale]
    finally:
        zombie.wait()


def test_temp_names_parse_whatever_the_host_name(tmp_path, monkeypatch):
    """A host like gpu-node-3.example.com must still get its dead writers' temp files cleaned."""
    import shardgen.fsutil as fsutil

    token = host_token("gpu-node-3.example.com")
    assert token == "gpu_node_3_example_com"
    monkeypatch.setattr(fsutil, "HOST_TOKEN", token)
    dead = subprocess.Popen(["true"])
    dead.wait()
    monkeypatch.setattr(os, "getpid", lambda: dead.pid)
    tmp = temp_name(tmp_path / "2024-01-02.rec")
    monkeypatch.undo()
    monkeypatch.setattr(fsutil, "HOST_TOKEN", token)
    tmp.write_bytes(b"half")
    assert clean_temp_files(tmp_path) == [tmp]


def test_concurrent_builds_serialise_on_the_lock(cfg_dir):
    cfg_path = write_config(cfg_dir, end="2024-01-11", jobs=1, modes={"*": "slow:0.1"})
    a = start_build(cfg_path, "--end", "2024-01-09")
    b = start_build(cfg_path, "--start", "2024-01-04")
    c = start_build(cfg_path)
    for p in (a, b, c):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    store = cfg_dir / "shards"
    m = Manifest.load(store / "manifest.json")
    assert [s.date for s in m.shards] == DATES_8
    assert verify_store(store)[1] == [] and temp_files(store) == []


def _generator_pids(cfg_dir):
    """Pids of fake generators running with this test's modes file (``hang`` mode: they sleep)."""
    marker = str(cfg_dir / "modes.json").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv and any(a.endswith(b"fake_gen.py") for a in argv):
                pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("launch", ["setpriv", "preexec_fn"])
def test_a_generator_dies_with_a_build_killed_by_sigkill(cfg_dir, launch):
    """kill -9 of the build process alone (jobs=1: the generator is its child, in a session of its
    own, so no group kill reaches it): the generator gets SIGKILL from the kernel (parent-death
    signal), whether it was started through ``setpriv --pdeathsig`` or a ``preexec_fn``."""
    cfg_path = write_config(cfg_dir, modes={"*": "hang"}, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if launch == "preexec_fn":
        env["PATH"] = str(cfg_dir / "nobin")  # no setpriv on PATH: the fallback (argv[0] is absolute)
    proc = subprocess.Popen([sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg_path), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    children = cfg_dir / "modes.json.children"
    try:
        wait_until(lambda: children.exists() and _generator_pids(cfg_dir), "the generator running")
        gen = _generator_pids(cfg_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until(lambda: not any(Path(f"/proc/{p}").exists() and b"Z" not in _state(p) for p in gen),
                   "the generator killed with its parent", timeout=10)
    finally:
        kill_group(proc)
        for pid in _generator_pids(cfg_dir) + [int(p) for p in (children.read_text().split()
                                                              if children.exists() else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return b"Z"


@pytest.mark.parametrize("command", ["no-such-generator-xyz", "./missing/gen.sh"])
def test_a_generator_that_cannot_start_is_one_clear_error(cfg_dir, command):
    cfg_path = write_config(cfg_dir, end="2024-01-02")
    text = cfg_path.read_text()
    cfg_path.write_text(text.replace(f'command = ["{sys.executable}"', f'command = ["{command}"'))
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg_path)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "2024-01-02: cannot start generator '" in r.stderr, r.stderr  # a relative path is named resolved
    assert f"{command.lstrip('.')}' (No such file or directory)" in r.stderr, r.stderr

"""What any local user may put in a store folder's world-writable ``leases/`` (mode 1777, issue 62)
must not hang or misdirect the store owner's ``gc`` and ``watch``: a FIFO named ``*.json`` is
skipped with a warning (never read: it would block holding the writer lock), a symlink is never
followed (``leases/.clock``, a lease). And only ``leases/`` is opened to every user: the store
folder keeps its mode whatever the watcher and the readers write there. The planted files are
made as root here: what matters is what the owner's processes do with them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, shardgen_cli, write_config

from shardgen.store.lease import LEASE_DIR, Lease

pytestmark = pytest.mark.slow
BOUND_S = 30.0  # gc or watch --once on a one-date store takes a few seconds, beside two CPU hogs too


@pytest.fixture()
def built(tmp_path) -> tuple[Path, Path]:
    """A built store (one date) and its config."""
    cfg = write_config(tmp_path / "proj", start="2024-01-02", end="2024-01-02")
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 0, r.stderr
    return cfg, tmp_path / "proj" / "shards"


def test_watch_and_a_reader_leave_the_store_folders_mode_alone(built):
    cfg, store = built
    os.chmod(store, 0o755)
    r = shardgen_cli("watch", "--once", "-c", cfg, timeout=90)
    assert r.returncode == 0, r.stderr
    lease = Lease(store)
    lease.renew(1)
    lease.release()
    assert stat.S_IMODE(store.stat().st_mode) == 0o755
    assert stat.S_IMODE((store / LEASE_DIR).stat().st_mode) == 0o1777  # only leases/ is everyone's


@pytest.mark.parametrize("command", [("gc",), ("watch", "--once")])
def test_a_fifo_in_leases_is_skipped_not_read(built, command):
    cfg, store = built
    (store / LEASE_DIR).mkdir(exist_ok=True)
    os.mkfifo(store / LEASE_DIR / "zz-planted.json")
    proc = subprocess.Popen([sys.executable, "-m", "shardgen.cli", *command, "-c", str(cfg)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.SubprocessError:  # before: blocked in read() for ever, holding the writer lock
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{' '.join(command)} still blocked after {BOUND_S:g} s") from None
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0, r.stderr
    assert "zz-planted.json: not a regular file" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_symlinked_lease_is_not_followed(built, tmp_path):
    cfg, store = built
    elsewhere = tmp_path / "elsewhere.json"  # a lease anyone could write, pinning generation 1 for ever
    elsewhere.write_text(json.dumps({"generation": 1, "host": "h", "pid": 1, "pidns": "", "boot_id": ""}))
    (store / LEASE_DIR).mkdir(exist_ok=True)
    (store / LEASE_DIR / "zz-link.json").symlink_to(elsewhere)
    r = shardgen_cli("gc", "-c", cfg, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "zz-link.json: not a regular file (a symlink)" in r.stderr


@pytest.mark.parametrize("target_exists", [False, True])
def test_gc_never_touches_through_a_planted_clock_symlink(built, tmp_path, target_exists):
    cfg, store = built
    target = tmp_path / "target-of-the-link"
    if target_exists:
        target.write_text("keep")
        os.utime(target, (1000, 1000))
    leases = store / LEASE_DIR
    leases.mkdir(exist_ok=True)
    (leases / ".clock").unlink(missing_ok=True)
    (leases / ".clock").symlink_to(target)
    r = shardgen_cli("gc", "-c", cfg, timeout=60)
    assert r.returncode == 0, r.stderr
    assert target.exists() == target_exists  # before: root's gc made the file the link named
    if target_exists:
        assert target.stat().st_mtime == 1000 and target.read_text() == "keep"
    assert stat.S_ISREG(os.lstat(leases / ".clock").st_mode)  # replaced by a clock of its own
    assert "not a regular file" in r.stderr


def test_a_lease_heartbeat_does_not_touch_through_a_symlink(built, tmp_path):
    _cfg, store = built
    lease = Lease(store, refresh_s=3600)
    lease.renew(1)
    try:
        target = tmp_path / "target-of-the-link"
        target.write_text("keep")
        os.utime(target, (1000, 1000))
        lease.path.unlink()
        lease.path.symlink_to(target)
        lease._state.beat()
        assert target.stat().st_mtime == 1000
    finally:
        lease.release()

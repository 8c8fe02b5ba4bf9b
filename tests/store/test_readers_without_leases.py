"""Readers that share a store without owning it (issue 62, item 4): a training job running as another
OS user, or reading through a read-only mount. gc must not delete what such a reader still reads
where it can be seen (its lease in ``leases/``, writable by every reader), and a reader that cannot
write a lease is told what protects it (store.grace_s)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import shardgen_cli, write_config
from osaccess import PYTHON, as_user, other_user, read_only_view, shared_folder, writable_by_all

from shardgen.store.lease import Lease

pytestmark = pytest.mark.slow

# Reads every window of generation 1 once, says so, waits for a line on stdin (gc runs meanwhile),
# then reads the next epoch of the same generation: what gc deleted under it shows here.
READER = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
from loader import ShardIter
store, cache = sys.argv[1:3]
it = ShardIter(store, 8, cache_dir=cache, generation=1)
def epoch():
    return sum(b.data[0].shape[0] - b.pad for b in it)
print("epoch", epoch(), flush=True)
sys.stdin.readline()
it.reset()
print("epoch", epoch(), flush=True)
it.close()
"""


def _two_generations(folder: Path, *, grace: int) -> tuple[Path, Path]:
    """A store built by ``shardgen build`` (root, files 644/755) whose generation 1 holds
    2024-01-02 and whose later generations retired it (window 1)."""
    cfg = write_config(folder / "proj", start="2024-01-02", end="2024-01-02", window=1, grace=grace)
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    return cfg, folder / "proj" / "shards"


def _retire(cfg: Path) -> None:
    cfg.write_text(cfg.read_text().replace('end = "2024-01-02"', 'end = "2024-01-03"'))
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 0, r.stderr


def _read_across_gc(reader: subprocess.Popen, cfg: Path) -> tuple[str, str, subprocess.CompletedProcess]:
    try:
        first = reader.stdout.readline()
        assert first.startswith("epoch "), reader.communicate(timeout=30)
        _retire(cfg)
        gc = shardgen_cli("gc", "-c", cfg)
        out, err = reader.communicate("go\n", timeout=90)
        return first + out, err, gc
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)


def test_a_reader_running_as_another_user_is_seen_by_gc(tmp_path):
    user = other_user()
    with shared_folder() as folder:
        cfg, store = _two_generations(folder, grace=0)
        cache = writable_by_all(folder / "cache")
        reader = as_user(user, READER, [store, cache], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err, gc = _read_across_gc(reader, cfg)
        assert "cannot write a reader lease" not in err, err
        assert gc.returncode == 0 and "deleted 0 retired shards" in gc.stdout, gc.stdout + gc.stderr
        assert reader.returncode == 0, err
        first, second = [line for line in out.splitlines() if line.startswith("epoch")]
        assert first == second == "epoch 26", out  # the same generation, whole, after gc
        assert (store / "2024-01-02.rec").exists()
        assert stat.S_IMODE((store / "leases").stat().st_mode) == 0o1777  # made by the build, for every reader
        r = shardgen_cli("gc", "-c", cfg)  # the reader is gone: now they go
        assert r.returncode == 0 and "2024-01-02" in r.stdout, r.stdout + r.stderr


def test_an_old_stores_owner_only_lease_folder_is_opened_up_by_its_writer(tmp_path):
    """A store whose ``leases/`` an earlier version made 0755: the next build (its owner) opens it up;
    a folder a site gave a group mode (2770) is left as it is; a missing one the first reader makes
    open, whatever its umask."""
    cfg = write_config(tmp_path / "proj", end="2024-01-02")
    leases = tmp_path / "proj" / "shards" / "leases"
    leases.mkdir(parents=True)
    os.chmod(leases, 0o755)
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    assert stat.S_IMODE(leases.stat().st_mode) == 0o1777
    os.chmod(leases, 0o2770)
    assert shardgen_cli("gc", "-c", cfg).returncode == 0
    assert stat.S_IMODE(leases.stat().st_mode) == 0o2770
    shutil.rmtree(leases)  # the first reader makes it anew: open from the start, whatever the umask
    old_umask = os.umask(0o077)
    try:
        lease = Lease(leases.parent)
        lease.renew(1)
        lease.release()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(leases.stat().st_mode) == 0o1777


def test_a_reader_on_a_read_only_mount_is_told_what_protects_it(tmp_path):
    """No lease can be written through a read-only mount: the reader reads on, its warning says that
    only store.grace_s keeps what it reads, and gc (grace 3600 s) keeps the shard it reads."""
    with shared_folder() as folder:
        cfg, store = _two_generations(folder, grace=3600)
        with read_only_view(store, folder / "ro") as ro:
            reader = subprocess.Popen([PYTHON, "-c", READER, ro, tmp_path / "cache"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err, gc = _read_across_gc(reader, cfg)
        assert "cannot write a reader lease" in err and "only store.grace_s protects" in err, err
        assert "Read-only file system" in err and "readers without write access" in err, err
        assert gc.returncode == 0 and "deleted 0 retired shards" in gc.stdout
        assert reader.returncode == 0 and out.count("epoch 26") == 2, out + err


def test_a_reader_on_a_read_only_mount_with_its_leases_folder_writable_is_seen_by_gc(tmp_path):
    """docs/reliability.md's recipe: the store read-only, its ``leases/`` folder mounted writable on
    top: the reader's lease is there and gc (grace 0) keeps the shard it reads."""
    with shared_folder() as folder:
        cfg, store = _two_generations(folder, grace=0)
        with read_only_view(store, folder / "ro") as ro:
            r = subprocess.run(["mount", "--bind", str(store / "leases"), str(ro / "leases")], capture_output=True,
                               text=True)
            if r.returncode != 0:
                pytest.skip(f"mount --bind is not allowed here: {r.stderr.strip()}")
            try:
                reader = subprocess.Popen([PYTHON, "-c", READER, ro, tmp_path / "cache"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                out, err, gc = _read_across_gc(reader, cfg)
            finally:
                subprocess.run(["umount", "-l", str(ro / "leases")], capture_output=True)
        assert "cannot write a reader lease" not in err, err
        assert gc.returncode == 0 and "deleted 0 retired shards" in gc.stdout, gc.stdout
        assert reader.returncode == 0 and out.count("epoch 26") == 2, out + err


def test_build_on_a_read_only_store_is_an_environment_failure(tmp_path):
    """Exit 3 (the table's environment failures), one line naming the lock file; not 2 (usage)."""
    with shared_folder() as folder:
        cfg, store = _two_generations(folder, grace=0)
        with read_only_view(store, folder / "ro") as ro:
            cfg.write_text(cfg.read_text().replace('dir = "shards"', f'dir = "{ro}"'))
            _retire_text = cfg.read_text().replace('end = "2024-01-02"', 'end = "2024-01-03"')
            cfg.write_text(_retire_text)
            r = shardgen_cli("build", "-c", cfg)
        assert r.returncode == 3, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert str(ro / ".writer.lock") in r.stderr and "Read-only file system" in r.stderr, r.stderr

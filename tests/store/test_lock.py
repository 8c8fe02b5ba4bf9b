"""Store locks: never opened through a planted symlink; a store folder's one writer."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, make_store, shardgen_cli, write_config

from shardgen.errors import LockError
from shardgen.store.lock import MANIFEST_LOCK, WATCH_LOCK, StoreLock
from shardgen.store.writer_lock import WRITER_LOCK


@pytest.mark.parametrize("name", [MANIFEST_LOCK, WATCH_LOCK, WRITER_LOCK])
def test_a_symlinked_lock_file_is_refused_and_its_target_kept(tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / name).symlink_to(victim)
    with pytest.raises(LockError, match=f"{name}: .* lock file is a symlink"):
        StoreLock(tmp_path / name).acquire()
    assert victim.read_text() == "precious\n"


def test_cli_with_a_planted_manifest_lock_symlink_says_so_in_one_line(tmp_path):
    cfg = write_config(tmp_path / "proj", end="2024-01-02")
    store = tmp_path / "proj" / "shards"
    make_store(store, {"2024-01-02": 10})
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (store / MANIFEST_LOCK).unlink()
    (store / MANIFEST_LOCK).symlink_to(victim)
    r = shardgen_cli("gc", "-c", cfg)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "lock file is a symlink" in r.stderr and "Traceback" not in r.stderr
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("cut", [0, 1])
def test_a_publish_cut_between_its_writes_never_names_a_generation_without_its_snapshot(tmp_path, monkeypatch, cut):
    """A generation is published as its snapshot first, then ``manifest.json``: a writer killed
    after either write leaves a manifest whose generation has its snapshot (a reader pinned to it,
    or a kvstore worker told to open it, still can once the manifest moves on)."""
    from shardgen.store import FolderStore
    from shardgen.store.manifest import Manifest
    from shardgen.store.publish import publish

    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 10})
    manifest = Manifest.load(store / "manifest.json")
    entry = manifest.shards[0]
    calls = []
    real = FolderStore.write

    def killed_after(self, name, data, *, durable=True):
        if len(calls) == cut:
            raise OSError("killed")
        calls.append(name)
        return real(self, name, data, durable=durable)

    monkeypatch.setattr(FolderStore, "write", killed_after)
    with pytest.raises(OSError, match="killed"):
        publish(store, manifest.schema, 1, [entry.__class__(**{**entry.__dict__, "date": "2024-01-03"})])
    monkeypatch.undo()
    now = Manifest.load(store / "manifest.json")
    assert (store / "generations" / f"{now.generation}.json").is_file()


HOLDER = """
import sys
from shardgen.store import open_store
lock = open_store(sys.argv[1]).writer_lock("watch").acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_folder_store_has_one_writer_and_a_killed_one_frees_it_at_once(tmp_path):
    """Issue 54: the folder store's writer lock holds (it held nothing: every writer shared the
    store). A second writer is refused at once naming the first (what, host, pid), in this
    process as in another; a holder killed with -9 leaves no lock to wait out."""
    from shardgen.store import open_store

    store = open_store(tmp_path / "s")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "s")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(LockError, match=rf"\.writer\.lock: gc refused: the store has another writer "
                                            rf"\(watch on \S+, pid {holder.pid}\); one writer per store"):
            store.writer_lock("gc").acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    with store.writer_lock("build") as mine:
        assert mine.lost is None
        with pytest.raises(LockError, match=rf"publish refused: .*\(build on \S+, pid {os.getpid()}\)"):
            store.writer_lock("publish").acquire()
    store.writer_lock("gc").acquire().release()  # released: free again

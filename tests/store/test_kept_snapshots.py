"""verify and gc see every kept snapshot (issue 64 contract 8), through the CLI.

A reader pinned to an older kept generation reads what that snapshot lists: whatever makes it fail
there makes ``shardgen verify`` fail too, naming the file. A writer killed after it wrote the
snapshot of its new generation and before ``manifest.json`` named it leaves a snapshot newer than
the manifest: never published, ``verify`` does not hold it against the store, and ``shardgen gc``
collects it, even within the grace period and with a reader's live lease on an older generation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, shardgen_cli, write_config

from loader import LoaderError, ShardIter
from shardgen.store.lease import Lease
from shardgen.store.manifest import Manifest


def rebuilt_store(tmp_path):
    """Generation 1 lists 2024-01-02.rec; generation 2 rebuilt that date as 2024-01-02.v2.rec, so
    2024-01-02.rec is listed by the older kept snapshot only."""
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-03")
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    r = shardgen_cli("build", "-c", cfg, "--force", "--start", "2024-01-02", "--end", "2024-01-02")
    assert r.returncode == 0, r.stderr
    store = tmp_path / "p" / "shards"
    m = Manifest.load(store / "manifest.json")
    assert m.generation == 2 and [r.rec for r in m.retired] == ["2024-01-02.rec"]
    assert (store / "generations" / "1.json").exists()
    return cfg, store


def _flip_record(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_snapshot(path):
    snap = json.loads(path.read_text())
    [entry] = [s for s in snap["shards"] if s["date"] == "2024-01-02"]
    entry["windows"] = entry["windows"] + 1  # the snapshot rewritten: it says one window more
    path.write_text(json.dumps(snap, sort_keys=True, indent=1) + "\n")


REWRITES = {
    "a record of the retired .rec": ("2024-01-02.rec", _flip_record),
    "the older snapshot itself": ("generations/1.json", _edit_snapshot),
}


@pytest.mark.parametrize("what", sorted(REWRITES))
def test_a_file_rewritten_under_an_older_kept_snapshot_fails_verify_as_it_fails_a_pinned_reader(tmp_path, what):
    cfg, store = rebuilt_store(tmp_path)
    assert shardgen_cli("verify", "-c", cfg).returncode == 0
    with ShardIter(store, 4, generation=1, cache_dir=tmp_path / "c0") as it:  # sound: the pinned reader reads
        assert sum(4 - b.pad for b in it) == Manifest.load(store / "generations" / "1.json").samples
    name, rewrite = REWRITES[what]
    rewrite(store / name)
    with pytest.raises(LoaderError):
        with ShardIter(store, 4, generation=1, cache_dir=tmp_path / "c1") as it:
            sum(1 for _ in it)
    with ShardIter(store, 4, cache_dir=tmp_path / "c2") as it:  # the newest generation does not list it
        assert sum(4 - b.pad for b in it) == Manifest.load(store / "manifest.json").samples
    r = shardgen_cli("verify", "-c", cfg)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "2024-01-02.rec" in r.stdout + r.stderr


KILLED_BEFORE_THE_MANIFEST = """
import os, signal, sys
from shardgen.cli import main
from shardgen.store.folder import FolderStore

real = FolderStore.write


def write(self, name, data, *a, **kw):
    if name == "manifest.json":  # its snapshot is written: killed before the manifest names it
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, name, data, *a, **kw)


FolderStore.write = write
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_writers_snapshot_newer_than_the_manifest_is_collected(tmp_path):
    cfg, store = rebuilt_store(tmp_path)
    cfg.write_text(cfg.read_text().replace('end = "2024-01-03"', 'end = "2024-01-04"'))
    writer = subprocess.run([sys.executable, "-c", KILLED_BEFORE_THE_MANIFEST, "build", "-c", str(cfg)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert writer.returncode == -signal.SIGKILL, writer.stderr
    assert Manifest.load(store / "manifest.json").generation == 2
    assert Manifest.load(store / "generations" / "3.json").generation == 3  # never published
    r = shardgen_cli("verify", "-c", cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    reader = Lease(store)
    reader.renew(1)  # a live reader of generation 1: it keeps generations 1 and 2, never 3
    try:
        r = shardgen_cli("gc", "-c", cfg)  # grace_s 3600: every published snapshot is recent
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in (store / "generations").iterdir()) == ["1.json", "2.json"]
        with ShardIter(store, 4, generation=1, cache_dir=tmp_path / "c") as it:
            assert sum(4 - b.pad for b in it) == Manifest.load(store / "generations" / "1.json").samples
    finally:
        reader.release()
    r = shardgen_cli("build", "-c", cfg)  # the next build publishes 2024-01-04
    assert r.returncode == 0, r.stderr
    m = Manifest.load(store / "manifest.json")
    assert m.generation >= 3 and "2024-01-04" in [s.date for s in m.shards]
    assert shardgen_cli("verify", "-c", cfg).returncode == 0


def test_the_snapshot_of_a_first_build_killed_before_its_manifest_is_collected(tmp_path):
    """No generation was ever published: the store has a snapshot and no manifest.json. verify
    says there is no manifest; gc removes the snapshot; the next build publishes."""
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-03")
    store = tmp_path / "p" / "shards"
    writer = subprocess.run([sys.executable, "-c", KILLED_BEFORE_THE_MANIFEST, "build", "-c", str(cfg)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert writer.returncode == -signal.SIGKILL, writer.stderr
    assert not (store / "manifest.json").exists() and (store / "generations" / "1.json").exists()
    r = shardgen_cli("verify", "-c", cfg)
    assert r.returncode == 1 and "no manifest" in r.stderr, r.stdout + r.stderr
    r = shardgen_cli("gc", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert list((store / "generations").iterdir()) == []
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    assert shardgen_cli("verify", "-c", cfg).returncode == 0
    with ShardIter(store, 4, cache_dir=tmp_path / "c") as it:
        assert sum(4 - b.pad for b in it) == Manifest.load(store / "manifest.json").samples

"""Issue 54, defence in depth: a shard file is published by linking it to its name, never by
replacing a file there, so even a writer without the store's writer lock never changes the bytes
under a published manifest entry; what a killed run left without a sidecar is removed by the next
build (which holds the lock)."""

import datetime as dt
import hashlib

import numpy as np
from conftest import write_config

from shardgen.config import load_config
from shardgen.format import LabelSpec, Schema
from shardgen.produce.build import build
from shardgen.produce.pipeline import produce
from shardgen.produce.writer import write_marker, write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.verify import verify_store

DAY = dt.date(2024, 1, 2)
SCHEMA = Schema.create(time_steps=3, num_inputs=2, data_name="seq_var", labels=[LabelSpec("a", 1)])


def windows(value: float, n: int = 6):
    return np.full((n, 3, 2), value, np.float32), {"a": np.arange(n, dtype=np.float32)}


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


def test_an_exclusive_write_takes_the_next_version_and_never_touches_a_file_there(tmp_path):
    first = write_shard(tmp_path, DAY, *windows(1.0), SCHEMA, fsync=False, exclusive=True)
    assert (first.rec, first.idx) == ("2024-01-02.rec", "2024-01-02.idx")
    before = digests(tmp_path)
    second = write_shard(tmp_path, DAY, *windows(2.0), SCHEMA, fsync=False, exclusive=True)
    assert (second.rec, second.idx) == ("2024-01-02.v2.rec", "2024-01-02.v2.idx")
    assert second.sha256 != first.sha256
    after = digests(tmp_path)
    assert {k: after[k] for k in before} == before  # version 1's bytes unchanged
    assert after["2024-01-02.v2.rec"] == second.sha256
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_name_of_the_version_taken_moves_the_whole_shard_on(tmp_path):
    """Another writer's ``.idx`` (or sidecar) of version 1 without its ``.rec``: the shard goes to
    version 2 whole, and the ``.rec`` it had linked as version 1 is removed again."""
    (tmp_path / "2024-01-02.idx").write_bytes(b"someone else's")
    side = write_shard(tmp_path, DAY, *windows(1.0), SCHEMA, fsync=False, exclusive=True)
    assert side.rec == "2024-01-02.v2.rec"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2024-01-02.idx", "2024-01-02.v2.idx",
                                                           "2024-01-02.v2.json", "2024-01-02.v2.rec"]
    assert (tmp_path / "2024-01-02.idx").read_bytes() == b"someone else's"
    (tmp_path / "2024-01-05.json").write_bytes(b"someone else's sidecar")
    assert write_shard(tmp_path, dt.date(2024, 1, 5), *windows(1.0), SCHEMA, fsync=False,
                       exclusive=True).rec == "2024-01-05.v2.rec"
    assert (tmp_path / "2024-01-05.json").read_bytes() == b"someone else's sidecar"
    assert not (tmp_path / "2024-01-05.rec").exists() and not (tmp_path / "2024-01-05.idx").exists()
    (tmp_path / "2024-01-03.json").write_bytes(b"{}")
    assert write_marker(tmp_path, dt.date(2024, 1, 3), SCHEMA, exclusive=True) == "2024-01-03.v2.json"
    assert (tmp_path / "2024-01-03.json").read_bytes() == b"{}"


def test_a_non_exclusive_write_replaces_as_before(tmp_path):
    write_shard(tmp_path, DAY, *windows(1.0), SCHEMA, fsync=False)
    side = write_shard(tmp_path, DAY, *windows(2.0), SCHEMA, fsync=False)
    assert side.rec == "2024-01-02.rec" and digests(tmp_path)["2024-01-02.rec"] == side.sha256


def test_produce_never_writes_over_another_writers_file(cfg_dir):
    """A writer without the lock (an older shardgen, a notebook) has written ``<date>.rec`` and not
    yet its sidecar: ``produce`` leaves those bytes alone and writes the date as version 2."""
    cfg = load_config(write_config(cfg_dir, end="2024-01-02"))
    cfg.store.dir.mkdir(parents=True)
    theirs = cfg.store.dir / "2024-01-02.rec"
    theirs.write_bytes(b"another writer's shard")
    res = produce(cfg, DAY)
    assert res.status == "written" and res.entry.rec == "2024-01-02.v2.rec"
    assert theirs.read_bytes() == b"another writer's shard"


def test_a_build_removes_what_a_killed_run_left_without_a_sidecar(cfg_dir):
    """A killed run's ``<date>.rec``/``.idx`` without their sidecar (never published) go at the next
    build once older than ``store.grace_s``; younger ones (maybe another producer's shard, its
    sidecar to come) stay and the date takes the next version; listed files stay."""
    path = write_config(cfg_dir, end="2024-01-04", grace=3600)
    cfg = load_config(path)
    store = cfg.store.dir
    build(cfg, end=DAY)
    listed = digests(store)
    (store / "2024-01-03.rec").write_bytes(b"half")
    (store / "2024-01-02.json").rename(store / "kept.json")  # a listed file whose sidecar went: kept
    report = build(cfg, end=dt.date(2024, 1, 3))
    assert [d.isoformat() for d in report.published] == ["2024-01-03"]
    assert (store / "2024-01-03.rec").read_bytes() == b"half"  # younger than the grace: kept
    assert Manifest.load(store / "manifest.json").shards[-1].rec == "2024-01-03.v2.rec"
    (store / "2024-01-04.rec").write_bytes(b"half")
    (store / "2024-01-04.idx").write_bytes(b"half")
    (store / "2024-01-04.v3.rec").write_bytes(b"half")
    path.write_text(path.read_text().replace("grace_s = 3600", "grace_s = 0"))
    cfg = load_config(path)
    report = build(cfg)
    assert [d.isoformat() for d in report.published] == ["2024-01-04"]
    m = Manifest.load(store / "manifest.json")
    assert [s.rec for s in m.shards] == ["2024-01-02.rec", "2024-01-03.v2.rec", "2024-01-04.rec"]
    assert not (store / "2024-01-04.v3.rec").exists() and not (store / "2024-01-03.rec").exists()
    assert digests(store)["2024-01-02.rec"] == listed["2024-01-02.rec"]
    (store / "kept.json").rename(store / "2024-01-02.json")
    assert verify_store(store)[1] == []


def test_write_store_never_writes_over_a_published_file_and_reuses_identical_bytes(tmp_path):
    """``write_store`` (tests, notebooks) writes exclusively too: the same windows again reuse the
    published files (no new version, no new generation); other windows for a date take the next
    version, and the bytes a reader of the old generation holds never change."""
    from shardgen.produce.writer import write_store

    first = write_store(tmp_path, SCHEMA, [(DAY, *windows(1.0))], fsync=False)
    before = digests(tmp_path)
    assert write_store(tmp_path, SCHEMA, [(DAY, *windows(1.0))], fsync=False) is None  # nothing changed
    assert digests(tmp_path) == before
    third = write_store(tmp_path, SCHEMA, [(DAY, *windows(3.0))], fsync=False)
    assert third.generation == first.generation + 1
    assert [s.rec for s in third.shards] == ["2024-01-02.v2.rec"] and third.retired[0].rec == "2024-01-02.rec"
    after = digests(tmp_path)
    assert {k: after[k] for k in before if k != "manifest.json"} == {k: v for k, v in before.items()
                                                                     if k != "manifest.json"}
    assert verify_store(tmp_path)[1] == []


def test_write_store_refused_by_the_writer_lock_leaves_nothing_a_build_would_adopt(tmp_path):
    """The review's repro: a notebook's ``write_store`` beside a running build was refused at publish,
    after writing a complete shard, which the build then adopted as the date's data. The lock is
    now taken before any file is written."""
    import pytest

    from shardgen.errors import LockError
    from shardgen.produce.writer import write_store
    from shardgen.store.folder import FolderStore

    with FolderStore(tmp_path).writer_lock("build"):
        with pytest.raises(LockError, match="publish refused: the store has another writer"):
            write_store(tmp_path, SCHEMA, [(DAY, *windows(7.0))], fsync=False)
        assert FolderStore(tmp_path).complete_shard(DAY, SCHEMA.fingerprint) is None
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("2024-")]
    assert write_store(tmp_path, SCHEMA, [(DAY, *windows(7.0))], fsync=False).generation == 1

"""Immutable generations: snapshots, pinned readers, dist_sync agreement, rewrites under a new name,
and manifest names that would escape the store."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import mxnet as mx
import proctree
import pytest
from conftest import ROOT, batch_ids, make_store, write_config

from loader import LoaderError, ShardIter
from loader.source.generations import agree
from shardgen.config import load_config
from shardgen.errors import ManifestError, ShardError
from shardgen.produce.build import build
from shardgen.store import FolderStore
from shardgen.store.gc import collect
from shardgen.store.lease import live_lease_generations
from shardgen.store.manifest import Manifest
from shardgen.store.naming import snapshot_generations, snapshot_path
from shardgen.store.sidecar import Sidecar
from shardgen.store.status import status
from shardgen.store.verify import verify_store

COUNTS = {"2024-01-02": 50, "2024-01-03": 37, "2024-01-04": 44}  # 131 records


def ids_of_epoch(it):
    ids = [i for b in it for i in batch_ids(b)]
    return sorted(ids)


# -- snapshots ------------------------------------------------------------------------------------


def test_every_generation_is_a_snapshot_and_manifest_json_is_the_newest(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 5})
    make_store(store, {"2024-01-03": 5}, base_id=5)
    assert snapshot_generations(store) == [1, 2]
    assert (store / "manifest.json").read_bytes() == snapshot_path(store, 2).read_bytes()
    m1 = FolderStore(store).load_generation(1)
    assert m1.generation == 1 and [s.date for s in m1.shards] == ["2024-01-02"]
    assert json.loads((store / "manifest.json").read_text())["format"] == "shardgen/2"
    info = status(store)
    assert info["snapshots"] == [1, 2] and info["format"] == "shardgen/2"


def test_a_snapshot_left_by_a_killed_writer_is_never_reused(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 5})
    orphan = snapshot_path(store, 2)
    orphan.write_text("{}")  # written, but the writer died before manifest.json named it
    make_store(store, {"2024-01-03": 5}, base_id=5)
    assert Manifest.load(store / "manifest.json").generation == 3 and orphan.read_text() == "{}"
    collect(store, grace_s=0, lease_ttl_s=60)
    assert not orphan.exists()  # never published: gc removes it


def test_old_store_opens_and_is_upgraded_on_the_next_publish(tmp_path):
    store = tmp_path / "s"
    make_store(store, COUNTS)
    obj = json.loads((store / "manifest.json").read_text())
    obj["format"] = "shardgen/1"
    (store / "manifest.json").write_text(json.dumps(obj))
    for p in (store / "generations").iterdir():
        p.unlink()
    (store / "generations").rmdir()
    with ShardIter(store, 8, cache_dir=tmp_path / "c") as it:
        assert ids_of_epoch(it) == list(range(131))
    with ShardIter(store, 8, cache_dir=tmp_path / "c", generation=1) as it:  # manifest.json is generation 1
        assert it.generation == 1
    make_store(store, {"2024-01-05": 3}, base_id=131)
    assert json.loads((store / "manifest.json").read_text())["format"] == "shardgen/2"
    assert snapshot_generations(store) == [2]


# -- pinned readers -------------------------------------------------------------------------------


def test_pinned_reader_keeps_its_generation_after_the_window_retires_it(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 30, "2024-01-03": 30}, window=2)  # generation 1
    it = ShardIter(store, 4, cache_dir=tmp_path / "c", generation=1)
    make_store(store, {"2024-01-04": 5, "2024-01-05": 5}, window=2, base_id=100)  # generation 2 retires both
    assert collect(store, grace_s=0, lease_ttl_s=60) == []
    for _ in range(2):  # epochs go on reading generation 1, its files and snapshot kept by the lease
        assert ids_of_epoch(it) == list(range(60)) and it.generation == 1
        it.reset()
        assert collect(store, grace_s=0, lease_ttl_s=60) == []
    assert it.state_dict()["pinned"] == 1 and snapshot_path(store, 1).exists()
    it.close()  # the lease ends: gc takes the snapshot and the files only it listed
    assert collect(store, grace_s=0, lease_ttl_s=60) == ["2024-01-02", "2024-01-03"]
    assert not snapshot_path(store, 1).exists() and not (store / "2024-01-02.rec").exists()
    with pytest.raises(LoaderError, match=r"cannot open generation 1 of .*generation 1 is gone"):
        ShardIter(store, 4, cache_dir=tmp_path / "c", generation=1)


def test_a_pinned_snapshot_that_vanishes_is_a_loader_error_at_reset(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 10})
    make_store(store, {"2024-01-03": 10}, base_id=10)
    it = ShardIter(store, 4, cache_dir=tmp_path / "c", generation=1)
    assert ids_of_epoch(it) == list(range(10))
    snapshot_path(store, 1).unlink()
    with pytest.raises(LoaderError, match=r"generation 1 is gone .*the newest is 2"):
        it.reset()
    it.close()


@pytest.mark.parametrize("bad", [0, -1, "3", 1.5])
def test_bad_generation_argument(store_small, tmp_path, bad):
    with pytest.raises(LoaderError, match="generation must be an integer"):
        ShardIter(store_small, 4, cache_dir=tmp_path / "c", generation=bad)


@pytest.fixture
def store_small(tmp_path):
    make_store(tmp_path / "small", {"2024-01-02": 10})
    return tmp_path / "small"


def test_local_kvstore_agreement_is_this_process(store_small, tmp_path):
    kv = mx.kv.create("local")
    assert agree(kv, 12345678901) == 12345678901
    with ShardIter.for_kvstore(kv, store_small, 4, cache_dir=tmp_path / "c") as it:
        make_store(store_small, {"2024-01-03": 6}, base_id=10)
        assert ids_of_epoch(it) == list(range(10))
        it.reset()
        assert it.generation == 2 and ids_of_epoch(it) == list(range(16))
    kv.init(0, mx.nd.zeros(1))  # the loader left the kvstore's key type to the model


# -- published files never change -----------------------------------------------------------------


def test_force_while_a_reader_is_mid_epoch(tmp_path):
    cfg_path = write_config(tmp_path / "p", end="2024-01-03", rows=30, grace=0)
    cfg = load_config(cfg_path)
    assert not build(cfg).failed
    store = cfg.store.dir
    old = {p.name: p.read_bytes() for p in store.glob("2024-01-02.*")}
    it = ShardIter(store, 4, shuffle=False, cache_dir=tmp_path / "c")
    first = it.next()
    gen_old = it.generation
    # The same date, rewritten from different raw data (40 rows: 36 windows instead of 26).
    cfg_path.write_text(cfg_path.read_text().replace('"--rows", "30"', '"--rows", "40"'))
    report = build(load_config(cfg_path), start=cfg.dates.start, end=cfg.dates.start, force=True)
    assert report.published == [cfg.dates.start] and not report.failed
    m = Manifest.load(store / "manifest.json")
    assert m.shards[0].rec == "2024-01-02.v2.rec" and m.shards[0].samples == 36
    assert [(r.date, r.rec) for r in m.retired] == [("2024-01-02", "2024-01-02.rec")]
    assert {p.name: p.read_bytes() for p in store.glob("2024-01-02.*") if ".v2." not in p.name} == old
    assert collect(store, grace_s=0, lease_ttl_s=60) == []  # the reader still reads the old files
    rows = [first] + list(it)  # the rest of the epoch: the old bytes, exactly
    n = sum(4 - b.pad for b in rows)
    assert n == 26 + 26 and it.generation == gen_old
    it.reset()
    assert it.generation == m.generation and sum(4 - b.pad for b in it) == 36 + 26
    assert collect(store, grace_s=0, lease_ttl_s=60) == ["2024-01-02"]
    assert not (store / "2024-01-02.rec").exists() and not (store / "2024-01-02.json").exists()
    assert (store / "2024-01-02.v2.rec").exists() and verify_store(store)[1] == []
    it.close()


def test_force_with_the_same_inputs_gives_the_same_bytes_under_a_new_name(tmp_path):
    cfg = load_config(write_config(tmp_path / "p", end="2024-01-02"))
    build(cfg)
    before = Manifest.load(cfg.store.dir / "manifest.json").shards[0]
    build(cfg, force=True)
    build(cfg, force=True)
    after = Manifest.load(cfg.store.dir / "manifest.json")
    assert after.shards[0].rec == "2024-01-02.v3.rec" and after.shards[0].sha256 == before.sha256
    assert [r.rec for r in after.retired] == ["2024-01-02.rec", "2024-01-02.v2.rec"]
    assert Sidecar.load(cfg.store.dir / "2024-01-02.v3.json").rec == "2024-01-02.v3.rec"


def test_verify_names_a_published_file_that_changed(tmp_path):
    cfg_path = write_config(tmp_path / "p", end="2024-01-03")
    cfg = load_config(cfg_path)
    build(cfg)
    build(cfg, start=cfg.dates.start, end=cfg.dates.start, force=True)  # v1 stays in snapshot 1
    with open(cfg.store.dir / "2024-01-02.rec", "r+b") as fh:  # a retired, still-kept file changes
        fh.seek(100)
        fh.write(b"\x01")
    problems = verify_store(cfg.store.dir)[1]
    assert len(problems) == 1 and problems[0][0] == "2024-01-02"  # the changed record is named (its CRC32)
    assert problems[0][1].startswith(f"{cfg.store.dir / '2024-01-02.rec'}: record 0 of 2024-01-02 is damaged "
                                     "(payload checksum differs")
    (cfg.store.dir / "2024-01-03.idx").write_bytes((cfg.store.dir / "2024-01-03.idx").read_bytes() + b"\n")
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "verify", "-c", str(cfg_path)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and "2024-01-03.idx: changed since publication" in r.stderr


# -- names that escape the store (issue 10, item 4) -----------------------------------------------


@pytest.mark.parametrize("name", ["../victim.txt", "/tmp/x", "..", ".hidden", "a/b.rec", "x\0y", "a;b.rec"])
def test_gc_refuses_a_manifest_naming_a_file_outside_the_store(tmp_path, name):
    cfg_path = write_config(tmp_path / "p", end="2024-01-02", grace=0)
    cfg = load_config(cfg_path)
    build(cfg)
    victim = tmp_path / "p" / "victim.txt"
    victim.write_text("keep me")
    path = cfg.store.dir / "manifest.json"
    obj = json.loads(path.read_text())
    obj["retired"] = [{"date": "2023-12-01", "rec": name, "idx": "2023-12-01.idx",
                       "retired_at": "2020-01-01T00:00:00Z", "retired_generation": 1}]
    path.write_text(json.dumps(obj))
    before = sorted(p.name for p in cfg.store.dir.iterdir())
    r = subprocess.run([sys.executable, "-m", "shardgen.cli", "gc", "-c", str(cfg_path)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and victim.exists() and sorted(p.name for p in cfg.store.dir.iterdir()) == before
    assert r.stderr.count("\n") == 1 and "not a plain file name inside the store" in r.stderr, r.stderr
    assert "retired shard 2023-12-01" in r.stderr


@pytest.mark.parametrize("field, value, match", [
    ("rec", "../x.rec", "not a plain file name"),
    ("idx", "/etc/passwd", "not a plain file name"),
    ("date", "2024-01-02/..", "is not YYYY-MM-DD"),
])
def test_bad_names_in_shard_entries_and_sidecars_are_refused(tmp_path, field, value, match):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 5})
    obj = json.loads((store / "manifest.json").read_text())
    obj["shards"][0][field] = value
    (store / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=match):
        Manifest.load(store / "manifest.json")
    with pytest.raises(LoaderError, match=match):
        ShardIter(store, 2, cache_dir=tmp_path / "c")
    side = json.loads((store / "2024-01-02.json").read_text())
    side[field] = value
    (store / "2024-01-02.json").write_text(json.dumps(side))
    with pytest.raises(ShardError, match=match):
        Sidecar.load(store / "2024-01-02.json")


# -- dist_sync: every worker reads the generation rank 0 picked ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("publish_round", [0, 1], ids=["during-construction", "between-resets"])
def test_dist_sync_workers_agree_when_a_date_lands_mid_race(tmp_path, publish_round):
    store, flags, out = tmp_path / "store", tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    out.mkdir()
    make_store(store, COUNTS)  # generation 1: 131 records
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "loader.tools.launch", "-n", "2", "-s", "1", "--timeout", "170", "--", sys.executable,
           str(ROOT / "tests" / "dist_race_worker.py"), "--store", str(store), "--flags", str(flags),
           "--out", str(out), "--publish-round", str(publish_round), "--epochs", "3"]
    with proctree.Tagged(cmd, cwd=ROOT, env=env) as job:  # every process it starts is killed at the end
        deadline = time.monotonic() + 120
        while not (flags / "proposed").exists():  # rank 0 has read generation 1 for this round
            assert job.proc.poll() is None, job.output
            assert time.monotonic() < deadline, "rank 0 never reached the round"
            time.sleep(0.02)
        make_store(store, {"2024-01-05": 20}, base_id=131)  # generation 2: 151 records
        (flags / "published").write_text("2")
        code = job.wait(180)
    output = job.output
    assert code == 0, output
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # Rank 1 saw generation 2 in the publish round, rank 0 had proposed 1: both read 1.
    assert ranks[0]["proposals"][publish_round] == 1 and ranks[1]["proposals"][publish_round] == 2
    expected = [1] * (publish_round + 1) + [2] * (2 - publish_round)
    for epoch, generation in enumerate(expected):
        e0, e1 = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert e0["generation"] == e1["generation"] == generation
        assert e0["batches"] == e1["batches"]
        records = 131 if generation == 1 else 151
        assert sorted(e0["ids"] + e1["ids"]) == list(range(records)), f"epoch {epoch}"
    assert ranks[0]["pinned"] is None
    assert live_lease_generations(store, 60) == []


def test_new_generations_mid_epoch_let_the_old_plans_go_once_their_readers_end(tmp_path):
    """reset() onto a new generation while the next epoch's stream fills on the old plan: every
    epoch reads the new generation, and no plan folder, descriptor or thread is left. (Letting that
    stream stop in the background instead of waiting ~20 ms for it crashed MXNet 1.9.1: its
    iterators freed while others are created in another thread segfault.)"""
    store, cache = tmp_path / "s", tmp_path / "c"
    counts = {"2024-01-02": 300, "2024-01-03": 300}
    make_store(store, counts)
    before = len(os.listdir("/proc/self/fd"))
    threads_before = set(threading.enumerate())  # other tests' iterators may still be running: not ours to count
    with ShardIter(store, 8, cache_dir=cache) as it:
        mine = next((cache / "plans").glob(f"*-{os.getpid()}"))
        for k in range(10):
            for _, _b in zip(range(it.batches_per_epoch // 2 + 2), it):  # past half: the next epoch is filling
                pass
            counts[f"2024-02-{k + 1:02d}"] = 40
            make_store(store, counts)  # a new generation with one more date
            it.reset()
            ids = sorted(i for b in it for i in batch_ids(b))
            assert ids == list(range(sum(counts.values())))
            it.reset()
        def plans() -> list:  # ("fd" holds the links to the open files, shared by the plans)
            return [p for p in mine.iterdir() if p.is_dir() and p.name != "fd"]

        deadline = time.monotonic() + 10
        while len(plans()) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(plans()) == 1  # this plan's only
        assert len(list((mine / "fd").iterdir())) == len(counts), "a link for each file the plan reads, no more"
    assert not mine.exists() or not [p for p in mine.iterdir() if p.is_dir()]
    assert len(os.listdir("/proc/self/fd")) <= before
    assert not [t.name for t in set(threading.enumerate()) - threads_before
                if t.name.startswith("shardgen-") and t.name != "shardgen-lease"]


def _wound_down(pipeline) -> bool:
    """Everything a pipeline held is let go: its threads ended, no plan, no batch or block queued."""
    return (pipeline.shut and pipeline.plan is None and not pipeline._plans and not pipeline._ready
            and pipeline._slot is None and not any(t.is_alive() for t in pipeline._threads))


def test_the_next_epoch_is_made_and_filled_by_the_loader_thread_and_reset_takes_it(tmp_path, monkeypatch):
    """One loader thread walks the epochs: once this epoch's blocks are filled it makes the next
    epoch's job (off the caller's thread) and fills its first block, and ``reset()`` takes that job
    as it is, batches and all; blocks are filled in order, epoch after epoch, never two at once."""
    from loader.pipeline.fill import Reading
    from loader.pipeline.job import EpochJob

    made, filled, busy = [], [], []
    real_successor, real_fill = EpochJob.successor, Reading.fill

    def successor(self):
        made.append((self.epoch + 1, threading.current_thread().name))
        return real_successor(self)

    def fill(self, v):
        busy.append(1)
        try:
            assert len(busy) == 1, "two blocks filled at once"
            filled.append((self.job.epoch, v))
            return real_fill(self, v)
        finally:
            busy.pop()

    monkeypatch.setattr(EpochJob, "successor", successor)
    monkeypatch.setattr(Reading, "fill", fill)
    store, cache = tmp_path / "s", tmp_path / "c"
    make_store(store, {"2024-01-02": 400, "2024-01-03": 400})
    with ShardIter(store, 8, cache_dir=cache, shuffle_buffer=200, prefetch_buffer=2) as it:
        pipeline = it.reader.pipeline
        for epoch in range(3):
            assert sorted(i for b in it for i in batch_ids(b)) == list(range(800))
            deadline = time.monotonic() + 30  # made once the last block is filled: maybe after the last next()
            while pipeline.ahead is None and time.monotonic() < deadline:
                time.sleep(0.01)
            ahead = pipeline.ahead
            assert ahead is not None and ahead.epoch == epoch + 1, "the next epoch's job was not made ahead"
            it.reset()
            assert pipeline.current is ahead, "reset() did not take the job the loader made"
    assert {name for _, name in made} == {"shardgen-loader"}
    assert [e for e, _ in made][:3] == [1, 2, 3]
    epochs = [e for e, _ in filled]
    assert epochs == sorted(epochs), f"blocks filled out of epoch order: {filled}"
    for e in range(3):
        assert [v for f, v in filled if f == e] == list(range(len([1 for f, _ in filled if f == e])))


def test_the_finalizer_run_by_a_thread_holding_the_epochs_lock_closes_later(tmp_path):
    """Garbage collection can run a dropped iterator's finalizer in any thread, also in a producer
    thread inside ``_half_way`` (holding the lock): it must not wait for that lock (a deadlock), and
    everything is still let go."""
    make_store(tmp_path / "s", {"2024-01-02": 100})
    it = ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
    next(it)
    pipeline = it.reader.pipeline
    with pipeline.lock:  # held here; the finalizer runs in another thread so a wrong wait fails in 5 s, not never
        finalizer = threading.Thread(target=pipeline.close_when_free, daemon=True)
        finalizer.start()
        finalizer.join(5)
        assert not finalizer.is_alive(), "close_when_free() waited for the pipeline's lock"
        assert pipeline.plan is not None
    deadline = time.monotonic() + 10
    while not _wound_down(pipeline) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _wound_down(pipeline)
    it.close()


def test_the_finalizer_run_by_gc_in_a_producer_holding_the_arena_lock_does_not_deadlock(tmp_path, monkeypatch):
    """Found in review: a dropped iterator in a reference cycle is collected at any allocation, e.g.
    in a producer thread inside ``Arena.hand_out`` (its non-reentrant lock held). Closing there
    joined the other stream's thread, which waited for that lock: both hung, files and buffers
    held for good. Simulated deterministically: gc.collect() inside hand_out, under the lock."""
    import gc

    import loader.pipeline.memory as memory

    make_store(tmp_path / "s", {"2024-01-02": 400, "2024-01-03": 400})
    armed, collected = threading.Event(), threading.Event()
    real = memory.Arena.hand_out

    def hand_out(self, flat, views):
        with self._lock:
            if armed.is_set() and threading.current_thread().name.startswith("shardgen"):
                armed.clear()
                gc.collect()
                collected.set()
        return real(self, flat, views)

    monkeypatch.setattr(memory.Arena, "hand_out", hand_out)
    before = set(threading.enumerate())  # an earlier test's iterator may still be alive
    it = ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c", prefetch_buffer=2)
    for _ in range(it.batches_per_epoch // 2 + 10):  # past half way: both threads run
        next(it)
    pipeline = it.reader.pipeline
    it.cycle = it  # only the cyclic collector can free it
    del it
    gc.disable()
    try:
        armed.set()
        # Take batches at a consumer's pace (from the stream: no reference to the iterator) so that a
        # producer refills: with both queues full before armed.set(), none assembled a batch again and
        # the trigger never ran (1 run in 6 beside two CPU hogs).
        for _ in range(20):
            if collected.wait(0.2):
                break
            with contextlib.suppress(LoaderError):
                pipeline.get()
        assert collected.wait(10), "no producer thread assembled a batch"
        deadline = time.monotonic() + 10
        while not _wound_down(pipeline) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gc.enable()
    assert _wound_down(pipeline), "deadlocked"
    assert not [t for t in set(threading.enumerate()) - before if t.name == "shardgen-batches"]


def test_the_exit_hook_waits_for_a_dropped_iterators_close_thread(tmp_path):
    """Found in review: an iterator dropped without close() is closed by a thread of its own; the
    exit hook's close_all() no longer sees it (collected), so MXNet's shutdown ran while its native
    threads still read: a segfault at exit, 1 run in 3-6. close_all() joins those threads."""
    from loader import lifecycle

    make_store(tmp_path / "s", {f"2024-01-{d:02d}": 500 for d in range(2, 10)})
    before = set(threading.enumerate())
    it = ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
    next(it)
    pipeline = it.reader.pipeline
    del it  # no cycle: the finalizer runs here and starts the close thread
    lifecycle.close_all()
    assert _wound_down(pipeline), "close_all() returned before the close thread ended"
    assert not [t for t in set(threading.enumerate()) - before if t.name in ("shardgen-batches", "shardgen-close")]


def test_a_process_that_drops_an_iterator_and_exits_ends_cleanly(tmp_path):
    store = tmp_path / "s"
    make_store(store, {f"2024-01-{d:02d}": 500 for d in range(2, 10)})
    script = ("import sys\nfrom loader import ShardIter\n"
              f"it = ShardIter({str(store)!r}, 8, cache_dir={str(tmp_path / 'c')!r})\n"
              "b = it.next()\ndel it\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(4):
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
    assert not list(store.glob("leases/*"))


def test_close_from_another_thread_racing_reset_leaves_nothing_running(tmp_path):
    """Found in review: close() from another thread while the caller's reset() was under way
    brought an epoch back (a stream, the plan's files, the lease) after close() had returned."""
    import random

    store, cache = tmp_path / "s", tmp_path / "c"
    make_store(store, {"2024-01-02": 200, "2024-01-03": 200})
    before = set(threading.enumerate())
    rng = random.Random(0)
    for _ in range(30):
        it = ShardIter(store, 8, cache_dir=cache)
        timer = threading.Timer(rng.uniform(0, 0.03), it.close)
        timer.start()
        try:
            for _ in range(20):
                for _, _b in zip(range(rng.randint(0, 3)), it):
                    pass
                it.reset()
        except LoaderError as exc:
            assert "closed" in str(exc)
        timer.join()
        it.close()
        assert _wound_down(it.reader.pipeline)
        assert not list(store.glob("leases/*")), "a lease outlived close()"
    def mine():
        return [t for t in set(threading.enumerate()) - before if t.name == "shardgen-batches"]

    deadline = time.monotonic() + 10
    while mine() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not mine()


def test_a_reset_that_fails_after_the_next_epoch_was_halted_keeps_its_files_until_it_ends(tmp_path):
    """Found in review of a change since reverted: a reset() whose new epoch cannot start (a part
    smaller than a batch) after the next-epoch stream was halted without waiting left that stream
    untracked; the next reset() let go of the plan under its running MXNet readers (segfault,
    double free) and close() returned with its threads alive."""
    store, cache = tmp_path / "s", tmp_path / "c"
    counts = {f"2024-01-{d:02d}": 300 for d in range(2, 5)}
    counts["2024-02-01"] = 5
    make_store(store, counts)
    threads_before = set(threading.enumerate())
    for _ in range(5):
        with ShardIter(store, 8, cache_dir=cache, dates=("2024-01-02", "2024-01-04"),
                       last_batch="discard") as it:
            for _, _b in zip(range(it.batches_per_epoch // 2 + 2), it):  # the next epoch is filling
                pass
            it.dates = ("2024-02-01", "2024-02-01")
            with pytest.raises(LoaderError, match="larger than"):
                it.reset()
            it.dates = None
            it.reset()
            ids = [i for b in it for i in batch_ids(b)]  # 'discard': the last partial batch is dropped
            total = sum(counts.values())
            assert len(ids) == len(set(ids)) == total // 8 * 8 and set(ids) <= set(range(total))
        assert not [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("shardgen-")
                    and t.name != "shardgen-lease"]

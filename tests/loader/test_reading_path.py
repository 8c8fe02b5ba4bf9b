"""The reading path (issue 53): what a one-block part reads each epoch, what it keeps, and how its
batches mix dates from the first one on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import batch_ids, make_store

import loader.pipeline.fill as fill
from loader import ShardIter
from loader.pipeline.shuffle_buffer import buffer_bytes

DATES = {f"2024-02-{d:02d}": 30 + d for d in range(1, 29)}  # 28 dates, 1,246 windows


@pytest.fixture
def counted(monkeypatch):
    """Native opens and native batches read, counted."""
    seen = {"opens": 0, "batches": 0}
    real_open, real_next = fill.open_record_iter, fill.next_label

    def open_record_iter(*a, **kw):
        seen["opens"] += 1
        return real_open(*a, **kw)

    def next_label(native):
        label = real_next(native)
        seen["batches"] += label is not None
        return label

    monkeypatch.setattr(fill, "open_record_iter", open_record_iter)
    monkeypatch.setattr(fill, "next_label", next_label)
    return seen


def _epoch(it) -> list:
    return [i for b in it for i in batch_ids(b)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_one_block_part_is_read_once_and_later_epochs_gather_from_the_block_kept(tmp_path, counted, shuffle):
    make_store(tmp_path / "s", DATES)
    with ShardIter(tmp_path / "s", 16, shuffle=shuffle, seed=3, cache_dir=tmp_path / "c") as it:
        first = _epoch(it)
        natively = -(-sum(DATES.values()) // it.reader.params.native_batch)  # native batches of every record
        assert counted["opens"] >= 1 and counted["batches"] >= natively
        counted.update(opens=0, batches=0)
        later = []
        for _ in range(3):
            it.reset()
            later.append(_epoch(it))
        assert counted == {"opens": 0, "batches": 0}, "later epochs of the same files read nothing natively"
    n = sum(DATES.values())
    for ids in [first] + later:
        assert sorted(ids) == list(range(n))
    if shuffle:
        assert len({tuple(ids) for ids in [first] + later}) == 4, "a new order every epoch"
    # the same batches as an iterator that read every epoch natively (a state resumed at epoch 3's start)
    with ShardIter(tmp_path / "s", 16, shuffle=shuffle, seed=3, cache_dir=tmp_path / "d") as it:
        for _ in range(3):
            it.reset()
        assert _epoch(it) == later[-1]


def test_a_file_changed_between_epochs_is_read_again_not_served_from_the_block_kept(tmp_path, counted):
    """A shard rewritten in place with other (sound) windows: reset() finds the change, lets the
    kept block and the native reads go, and the next epoch reads the files as they are now."""
    import os

    make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 40})
    make_store(tmp_path / "t", {"2024-01-02": 40, "2024-01-03": 40}, base_id=1000)
    with ShardIter(tmp_path / "s", 8, seed=1, cache_dir=tmp_path / "c") as it:
        assert sorted(_epoch(it)) == list(range(80))
        rec = next((tmp_path / "s").glob("2024-01-03.rec"))
        same = (tmp_path / "t" / rec.name).read_bytes()
        with open(rec, "r+b") as fh:  # in place, the same size: the plan's descriptor sees it
            fh.write(same)
        os.utime(rec, ns=(1, 1))
        counted.update(opens=0, batches=0)
        it.reset()
        got = sorted(_epoch(it))
        assert counted["opens"] >= 1, "read again"
    assert got == list(range(40)) + list(range(1040, 1080))


def test_every_batch_mixes_the_dates_of_the_part_from_the_first_one(tmp_path):
    """The default block is the whole part: even the first batches of an epoch span as many dates
    as an exact shuffle's (they came from one date while blocks ramped up)."""
    per, n_dates = 25, 60
    make_store(tmp_path / "s", {f"2023-{1 + d // 28:02d}-{1 + d % 28:02d}": per for d in range(n_dates)})
    with ShardIter(tmp_path / "s", 64, seed=0, cache_dir=tmp_path / "c", label_names=["date"]) as it:
        assert it.stats["dates_per_block"] == n_dates
        one = buffer_bytes(it.schema, it.reader.plan.records)  # the part's records
        held = it.memory["shuffle buffers"]
        assert held % 3 == 0 and one <= held // 3 <= 2 * one, "three buffers of the part (this and the next epoch's)"
        for epoch in range(2):
            if epoch:
                it.reset()
            spans = [len(np.unique(b.label[0].asnumpy()[:64 - b.pad])) for b in it][:-1]
            days = np.repeat(np.arange(n_dates), per)[np.random.default_rng(epoch).permutation(n_dates * per)]
            exact = np.mean([len(np.unique(days[i:i + 64])) for i in range(0, len(days) - 63, 64)])
            assert min(spans[:5]) >= 0.8 * exact and np.mean(spans) >= 0.95 * exact, (spans[:5], exact)


@pytest.mark.parametrize("shuffle_buffer", [300, 60, 17])
def test_a_part_larger_than_its_block_mixes_every_date_in_every_block(tmp_path, shuffle_buffer):
    """Blocks of a part larger than one are stripes (a piece of every date each): a block spans
    every date with at least as many records as the part has blocks, and the batches mix like an
    exact shuffle's from the first one (blocks of consecutive shard pieces held a third of the dates)."""
    make_store(tmp_path / "s", DATES)
    n = sum(DATES.values())
    with ShardIter(tmp_path / "s", 16, seed=3, cache_dir=tmp_path / "c", shuffle_buffer=shuffle_buffer,
                   label_names=["date"]) as it:
        blocks = -(-n // it.reader.params.block)
        assert blocks > 3
        assert it.stats["dates_per_block"] >= sum(1 for c in DATES.values() if c >= blocks)
        for epoch in range(2):
            if epoch:
                it.reset()
            spans = [len(np.unique(b.label[0].asnumpy()[:16 - b.pad])) for b in it][:-1]
            days = np.repeat(np.arange(len(DATES)), list(DATES.values()))
            days = days[np.random.default_rng(epoch).permutation(n)]
            exact = np.mean([len(np.unique(days[i:i + 16])) for i in range(0, n - 15, 16)])
            assert np.mean(spans) >= 0.9 * exact and min(spans[:20]) >= 0.6 * exact, (spans[:20], exact)
    with ShardIter(tmp_path / "s", 16, seed=3, cache_dir=tmp_path / "c", shuffle_buffer=shuffle_buffer) as it:
        assert sorted(_epoch(it)) == list(range(n))


def test_the_default_block_is_the_whole_part_with_room_to_grow_unless_it_is_larger_than_a_block(tmp_path):
    from loader.pipeline.settings import BLOCK_BYTES, buffer_records
    from shardgen.store.manifest import Manifest

    make_store(tmp_path / "s", DATES)
    m = Manifest.load(tmp_path / "s" / "manifest.json")
    records = sum(s.records for s in m.shards)
    assert buffer_records(m.schema, None, m.shards, 1) >= 1.25 * records, "a rolling window may grow a quarter"
    assert buffer_records(m.schema, None, m.shards, 4) >= 1.25 * records / 4
    assert buffer_records(m.schema, 100, m.shards, 1) == 100
    big = tuple(dataclasses.replace(s, records=s.records * 10**6) for s in m.shards)
    per = buffer_bytes(m.schema, 1)
    assert buffer_records(m.schema, None, big, 1) == BLOCK_BYTES // per, "blocks of BLOCK_BYTES (stripes)"


def test_under_a_cache_limit_the_block_kept_whole_spares_the_next_epochs_downloads(tmp_path, s3, counted):
    """The kept block is in memory, not in the cache: later epochs of the same generation read and
    download nothing, while the cache stays under its limit."""
    from test_s3_loader import upload_store

    make_store(tmp_path / "s", DATES)
    url = upload_store(s3, tmp_path / "s", "store")
    with ShardIter(url, 16, seed=3, cache_dir=tmp_path / "c", cache_limit="60KB") as it:
        first = _epoch(it)
        fetched = it.stats["downloaded_bytes"]
        assert fetched >= it.reader.plan.records, "the first epoch downloads the part"
        counted.update(opens=0, batches=0)
        it.reset()
        again = _epoch(it)
        assert counted == {"opens": 0, "batches": 0} and it.stats["downloaded_bytes"] == fetched
    assert sorted(first) == sorted(again) == list(range(sum(DATES.values()))) and first != again


def test_a_new_generation_lets_the_old_plans_kept_block_go(tmp_path):
    """The block kept whole belongs to a plan: after a reset() onto other shards only the new
    plan's block is kept (the old one held a buffer no stream could use). A window grown by a
    quarter is still one block (the default block's headroom)."""
    four = {f"2024-01-0{d}": 40 for d in range(2, 6)}
    make_store(tmp_path / "s", four)
    with ShardIter(tmp_path / "s", 8, seed=1, cache_dir=tmp_path / "c") as it:
        _epoch(it)
        old = it.plan.folder
        assert it.reader.pipeline.arena._whole[0][0] == old
        make_store(tmp_path / "s", {**four, "2024-01-08": 40})
        it.reset()
        assert it.plan.folder != old
        whole = it.reader.pipeline.arena._whole
        assert whole is None or whole[0][0] == it.plan.folder
        assert sorted(_epoch(it)) == list(range(200))
        assert it.stats["dates_per_block"] == 5
        assert it.reader.pipeline.arena._whole[0][0] == it.plan.folder


def test_a_state_loaded_after_a_shard_changed_in_place_reads_the_files_as_they_are(tmp_path):
    """load_state_dict() on the files read now checks them again (found by review): the block
    kept whole from before the rewrite is let go, and the batches are those a fresh iterator
    resuming the same state reads."""
    import os

    counts = {"2024-01-02": 40, "2024-01-03": 40, "2024-01-04": 40}
    make_store(tmp_path / "s", counts)
    make_store(tmp_path / "t", counts, base_id=1000)
    with ShardIter(tmp_path / "s", 8, seed=2, cache_dir=tmp_path / "c") as it:
        it.next(), it.next()
        state = it.state_dict()
        _epoch(it)
        rec = tmp_path / "s" / "2024-01-03.rec"
        with open(rec, "r+b") as fh:
            fh.write((tmp_path / "t" / rec.name).read_bytes())
        os.utime(rec, ns=(1, 1))
        it.load_state_dict(state)
        got = _epoch(it)
    with ShardIter(tmp_path / "s", 8, seed=2, cache_dir=tmp_path / "d") as fresh:
        fresh.load_state_dict(state)
        assert got == _epoch(fresh)
    assert any(i >= 1000 for i in got)


def test_an_in_order_state_of_version_4_resumes_its_order_is_todays(tmp_path):
    from loader.checkpoint import _digest

    make_store(tmp_path / "s", DATES)
    with ShardIter(tmp_path / "s", 16, shuffle=False, cache_dir=tmp_path / "c") as it:
        for _ in range(5):
            it.next()
        state = {**it.state_dict(), "version": 4}
        want = _epoch(it)
    with ShardIter(tmp_path / "s", 16, shuffle=False, cache_dir=tmp_path / "d") as it:
        it.load_state_dict({**state, "sha256": _digest(state)})
        assert _epoch(it) == want


def test_a_file_damaged_in_place_is_caught_by_the_next_generations_plan_too(tmp_path):
    """A new generation's plan takes the files it shares with the plan before from it: one that
    changed since it was found good (a payload bit flipped: MXNet would read it without a word)
    is checked again, and the epoch after the reset() onto the new generation says which record is
    damaged before its block is read."""
    from test_damage import flip, make

    from loader import LoaderError
    from shardgen.store.manifest import Manifest
    from shardgen.store.publish import publish

    make(tmp_path / "s", dates=4)
    m = Manifest.load(tmp_path / "s" / "manifest.json")
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:
        _epoch(it)
        flip(tmp_path / "s" / m.shards[2].rec, m.schema.record_bytes * 3 + 8 + 24 + 4 * m.schema.data_slice.start)
        publish(tmp_path / "s", m.schema, 3, [])  # a new generation: the window of 3 retires the first date
        assert len(Manifest.load(tmp_path / "s" / "manifest.json").shards) == 3
        with pytest.raises(LoaderError, match=f"record 3 of {m.shards[2].date} is damaged"):
            it.reset()
            _epoch(it)


def test_a_native_open_failing_after_a_new_generation_is_raised_by_the_next_next(tmp_path, monkeypatch):
    """reset() onto a store folder's new plan does not wait for its first native read to open
    (docs/internals.md, "Plan"): an MXNet error there is a LoaderError naming its reason, from the
    next() that needs the batch; the iterator goes on after a reset() once the reader opens."""
    import mxnet as mx

    from loader import LoaderError

    make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 40})
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:
        _epoch(it)
        make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 40, "2024-01-04": 40})
        real = fill.open_record_iter

        def failing(*_a, **_k):
            raise mx.base.MXNetError("Traceback (most recent call last):\nMXNetError: Check failed: injected")

        monkeypatch.setattr(fill, "open_record_iter", failing)
        it.reset()  # returns: the plan's files were all checked
        with pytest.raises(LoaderError, match="Check failed: injected"):
            it.next()
        assert it.reader.pipeline.ahead is None, "the loader went on to the next epoch after a failure"
        monkeypatch.setattr(fill, "open_record_iter", real)
        it.reset()
        assert sorted(_epoch(it)) == list(range(120))


def _runs_store(folder):
    """Three dates in the runs layout: every window is a start into its record's rows (``starts``)."""
    import datetime as dt

    from fake_gen import raw_for

    from shardgen.format import LabelSpec, Layout, Schema
    from shardgen.process import sliding_windows
    from shardgen.produce.writer import write_store

    t, c, labels = 5, 3, [LabelSpec("a", 1), LabelSpec("b", 2)]
    schema = Schema.create(time_steps=t, num_inputs=c, data_name="seq_var", labels=labels,
                           layout=Layout("runs", 8, t + 7))
    days = [dt.date(2024, 1, d) for d in (2, 3, 4)]
    write_store(folder, schema, [(d, sliding_windows(raw_for(d.isoformat(), 700 + 9 * i, c + 3), d, time_steps=t,
                                                     num_inputs=c, labels=labels), None)
                                 for i, d in enumerate(days)], fsync=False)


def test_a_buffer_grown_while_its_block_loads_keeps_every_window(tmp_path, monkeypatch):
    """A block holding more records than its estimate grows its buffer while it loads (issue 56: a
    grown buffer that lost the window starts gave other batches). With every estimate at one record
    the buffer grows at every native batch: the batches are those of an ordinary read."""
    _runs_store(tmp_path / "s")
    kw = dict(seed=5, cache_dir=tmp_path / "c")

    def epochs():
        with ShardIter(tmp_path / "s", 64, **kw) as it:
            return [[(b.data[0].asnumpy(), [lab.asnumpy() for lab in b.label], b.pad) for b in it]
                    for _ in range(2) if it.reset() or True]

    want = epochs()
    grown = []
    real_init, real_room = fill._Block.__init__, fill._Block.room

    def init(self, arena, estimate, nominal):
        real_init(self, arena, 1, nominal)  # every block estimated at one record

    def room(self, records):
        before = self.buffer
        out = real_room(self, records)
        if before is not None and out is not before:
            grown.append(records)
        return out

    monkeypatch.setattr(fill._Block, "__init__", init)
    monkeypatch.setattr(fill._Block, "room", room)
    got = epochs()
    assert grown, "no buffer grew"
    assert len(got) == len(want) == 2
    for g_epoch, w_epoch in zip(got, want):
        assert len(g_epoch) == len(w_epoch)
        for (gx, gl, gp), (wx, wl, wp) in zip(g_epoch, w_epoch):
            assert gp == wp
            np.testing.assert_array_equal(gx, wx)
            for a, b in zip(gl, wl):
                np.testing.assert_array_equal(a, b)


def test_no_more_native_reads_are_open_than_it_memory_counts(tmp_path, monkeypatch):
    """``it.memory`` counts two native reads (``memory.NATIVES``): the one being read and the next,
    opened ahead; never more are open at once (issue 56: one read more queued ahead survived), and
    with many reads a block the next one is open while one is read."""
    from loader.pipeline.memory import NATIVES

    make_store(tmp_path / "s", {f"2024-01-{d:02d}": 30 + d for d in range(2, 22)})
    live, most = [0], [0]
    real_open, real_free = fill.open_record_iter, fill.free

    def opened(*args, **kw):
        native = real_open(*args, **kw)
        live[0] += 1
        most[0] = max(most[0], live[0])
        return native

    def freed(native):
        live[0] -= 1
        return real_free(native)

    monkeypatch.setattr(fill, "open_record_iter", opened)
    monkeypatch.setattr(fill, "free", freed)
    real_reading = fill.Reading.__init__

    def small_tapes(self, *a, **k):
        real_reading(self, *a, **k)
        self.tape_records = 3

    monkeypatch.setattr(fill.Reading, "__init__", small_tapes)
    with ShardIter(tmp_path / "s", 8, seed=1, shuffle_buffer=40, cache_dir=tmp_path / "c") as it:
        assert it.reader.params.block * 3 < sum(30 + d for d in range(2, 22))  # many blocks, many reads
        for _ in range(3):
            assert sum(8 - b.pad for b in it) == sum(30 + d for d in range(2, 22))
            it.reset()
    assert most[0] == NATIVES, most[0]
    assert live[0] == 0

"""The rebuilt reading core (issue 65 item 1) through ``ShardIter``: how the loader fills blocks
(native reads, the slot, the block kept whole, the fetch ahead) and how the producer's ready queue
refills. Each test was written for a mutation of ``tests/mutations`` that no other test noticed."""

from __future__ import annotations

import threading

import pytest
from conftest import batch_ids, make_store
from test_core_jobs import _bounded_ids, _ids, _until
from test_reading_path import counted  # noqa: F401 (a fixture: native opens and batches, counted)

import loader.pipeline.fill as fill
from loader import ShardIter

TWO = {"2024-01-02": 300, "2024-01-03": 300}  # one block of 600 records: more than a native batch (256)


def test_a_read_longer_than_a_native_batch_puts_each_native_batch_in_its_own_slots(tmp_path, counted):  # noqa: F811
    """A read of 600 records comes in native batches of 256: each batch's rows go to the slots
    after the previous batch's (rows put at the read's first slots again lose every window past
    the first batch's)."""
    make_store(tmp_path / "s", TWO)
    with ShardIter(tmp_path / "s", 8, seed=2, cache_dir=tmp_path / "c") as it:
        for _ in range(2):
            assert sorted(_ids(it)) == list(range(600))
            it.reset()
    assert counted["opens"] >= 1 and counted["batches"] > counted["opens"], \
        f"no read took several native batches: {counted}"


def test_every_native_read_is_run_to_its_end_before_it_is_freed(tmp_path, monkeypatch):
    """MXNet 1.9.1's iterator holds no batch once ``iter_next()`` said it ended, so freeing it
    then leaks nothing: every native read of whole epochs is asked once more after its last record."""
    ended, freed = {}, []
    real_open, real_free = fill.open_record_iter, fill.free

    def open_record_iter(*a, **kw):
        native = real_open(*a, **kw)
        step = native.iter_next

        def iter_next():
            ended[id(native)] = not step()
            return not ended[id(native)]

        native.iter_next = iter_next
        ended[id(native)] = False
        return native

    def free(native):
        if native is not None:
            freed.append(ended.get(id(native)))
        return real_free(native)

    monkeypatch.setattr(fill, "open_record_iter", open_record_iter)
    monkeypatch.setattr(fill, "free", free)
    make_store(tmp_path / "s", {"2024-01-02": 70, "2024-01-03": 50})
    with ShardIter(tmp_path / "s", 8, seed=1, cache_dir=tmp_path / "c") as it:
        assert sorted(_ids(it)) == list(range(120))  # one block, read once: later epochs gather from it kept
        it.reset()
        assert sorted(_ids(it)) == list(range(120))
    assert freed and all(freed), f"natives freed before their end: {freed}"


def test_a_generation_published_while_the_loader_fills_this_epoch_is_fetched_ahead(s3, tmp_path):
    """An epoch of many blocks: a generation published after the iterator started is fetched ahead
    once the loader has this epoch's blocks (and their files), before reset() asks for it; the
    next epoch then downloads nothing more."""
    from test_s3_loader import COUNTS, store_with, upload_store

    local, url = store_with(s3, tmp_path)
    with ShardIter(url, 8, shuffle_buffer=16, cache_dir=tmp_path / "cache") as it:
        cache = it.reader.store
        make_store(local, {**COUNTS, "2024-01-05": 20})  # a new generation, published mid-epoch
        upload_store(s3, local)
        for _ in it:
            if cache._ahead is not None:
                break
        assert cache._ahead is not None, "no fetch ahead was asked for in the epoch"
        _until(lambda: (cache.folder / "2024-01-05.rec").is_file(), "the new date was not fetched ahead")
        before = cache.downloads
        for _ in it:
            pass
        it.reset()
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(151))
        assert cache.downloads == before


def test_a_part_of_several_blocks_keeps_none_of_them_whole(tmp_path):
    """Only a canonical part's one block is kept whole for the next epoch: a part of several blocks
    keeps none (its next epoch's blocks differ; the one kept would be held beside those the memory
    counts)."""
    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 60})
    with ShardIter(tmp_path / "s", 8, seed=3, shuffle_buffer=40, cache_dir=tmp_path / "c") as it:
        arena = it.reader.pipeline.arena
        for _ in range(2):
            assert sorted(_ids(it)) == list(range(120))
            assert arena._whole is None, "a block of a part of several blocks was kept whole"
            it.reset()


@pytest.mark.parametrize("prefetch_buffer", [1, 2, 3, 4, 7])
def test_every_ready_queue_size_refills_as_the_caller_takes(tmp_path, prefetch_buffer):
    """The producer sleeps with the ready queue full and is woken once the caller has taken it down
    to its low mark (0 for a queue of up to 3 batches): whatever the size, epochs are read whole
    (a low mark never reached leaves the caller waiting for good: bounded here)."""
    make_store(tmp_path / "s", {"2024-01-02": 70, "2024-01-03": 50})
    with ShardIter(tmp_path / "s", 8, seed=1, prefetch_buffer=prefetch_buffer, cache_dir=tmp_path / "c") as it:
        for _ in range(2):
            got: list = []
            reading = threading.Thread(target=lambda out=got: out.extend(_ids(it)), daemon=True)
            reading.start()
            reading.join(60)
            if reading.is_alive():
                it.close()  # ends the wait (IteratorClosed in that thread)
                pytest.fail(f"prefetch_buffer={prefetch_buffer}: next() still waited after 60 s")
            assert sorted(got) == list(range(120))
            it.reset()


def test_the_loader_waits_for_the_slot_while_the_caller_holds_back(tmp_path):
    """The slot is a queue of one: with the caller taking nothing, the producer's queue full and the
    producer asleep, the loader waits with the next block in hand (a block put over one not taken
    yet is lost: the producer would find block v + 2 where v + 1 was due)."""
    make_store(tmp_path / "s", {"2024-01-02": 90, "2024-01-03": 70})
    with ShardIter(tmp_path / "s", 8, seed=2, shuffle_buffer=40, prefetch_buffer=1, cache_dir=tmp_path / "c") as it:
        pipeline = it.reader.pipeline
        first = _bounded_ids(it, 1)
        _until(lambda: len(pipeline._loader_cv._waiters) > 0, "the loader thread never waited")
        assert sorted(first + _bounded_ids(it)) == list(range(160))

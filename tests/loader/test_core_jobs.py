"""The rebuilt reading core (issue 65 item 1) through ``ShardIter``: which job ``reset()`` and
``load_state_dict()`` take, how a native read fills its block, and how a closed iterator ends a
loop. Each test was written for a mutation of ``tests/mutations`` that no other test noticed."""

from __future__ import annotations

import time

import pytest
from conftest import batch_ids, make_store

import loader.pipeline.fill as fill
from loader import LoaderError, ShardIter
from loader.errors import IteratorClosed

TWO = {"2024-01-02": 300, "2024-01-03": 300}  # one block of 600 records: more than a native batch (256)


def _until(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _ids(it) -> list:
    return [i for b in it for i in batch_ids(b)]


def test_a_read_longer_than_a_native_batch_puts_each_native_batch_in_its_own_slots(tmp_path, monkeypatch):
    """A read of 600 records comes in native batches of 256: each batch's rows go to the slots
    after the previous batch's (rows put at the read's first slots again lose every window past
    the first batch's)."""
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
    make_store(tmp_path / "s", TWO)
    with ShardIter(tmp_path / "s", 8, seed=2, cache_dir=tmp_path / "c") as it:
        for _ in range(2):
            assert sorted(_ids(it)) == list(range(600))
            it.reset()
    assert seen["opens"] >= 1 and seen["batches"] > seen["opens"], f"no read took several native batches: {seen}"


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


def test_reset_reads_the_next_epoch_again_when_the_job_made_ahead_failed(tmp_path, monkeypatch):
    """The loader made the next epoch's job and its fill failed (a store out of reach for a moment):
    ``reset()`` starts that epoch afresh instead of taking the failed job and raising its error."""
    real_fill, failed = fill.Reading.fill, []

    def fill_once_failing(self, v):
        if self.job.epoch == 1 and not failed:
            failed.append(v)
            raise LoaderError("a store out of reach for a moment")
        return real_fill(self, v)

    monkeypatch.setattr(fill.Reading, "fill", fill_once_failing)
    make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 40})
    with ShardIter(tmp_path / "s", 8, seed=4, cache_dir=tmp_path / "c") as it:
        pipeline = it.reader.pipeline
        assert sorted(_ids(it)) == list(range(80))
        _until(lambda: pipeline.ahead is not None and pipeline.ahead.error is not None,
               "the next epoch's job was not made and failed ahead")
        it.reset()
        assert sorted(_ids(it)) == list(range(80))
    assert failed == [0]


def test_a_state_inside_the_next_epoch_is_not_read_from_the_job_made_ahead_from_its_start(tmp_path):
    """An iterator whose loader made the next epoch's job (from its first batch) loads a state saved
    a few batches into that epoch: it reads on from the state's batch, not the job's."""
    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 44})
    kw = dict(seed=7, cache_dir=tmp_path / "c")
    with ShardIter(tmp_path / "s", 8, **kw) as it:
        _ids(it)
        it.reset()
        head = [batch_ids(it.next()) for _ in range(3)]
        state = it.state_dict()
        rest = _ids(it)
    assert head and rest
    with ShardIter(tmp_path / "s", 8, **kw) as it:
        pipeline = it.reader.pipeline
        _ids(it)
        _until(lambda: pipeline.ahead is not None and pipeline.ahead.epoch == 1, "the next epoch's job was not made")
        it.load_state_dict(state)
        assert _ids(it) == rest


def test_a_loop_over_a_closed_iterator_raises_a_loader_error_never_ends_quietly(tmp_path):
    """``for`` and ``next(it)`` on an iterator closed mid-epoch raise a plain LoaderError (an epoch
    cut short must not pass for a whole one); ``it.next()`` raises ``IteratorClosed``, the
    StopIteration MXNet's ``PrefetchingIter`` takes as the end."""
    make_store(tmp_path / "s", {"2024-01-02": 40})
    it = ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
    got = [batch_ids(next(it))]
    it.close()
    with pytest.raises(LoaderError, match="this ShardIter is closed") as exc:
        for b in it:
            got.append(batch_ids(b))
    assert not isinstance(exc.value, StopIteration) and len(got) == 1
    with pytest.raises(LoaderError, match="this ShardIter is closed") as exc:
        next(it)
    assert not isinstance(exc.value, StopIteration)
    with pytest.raises(IteratorClosed):
        it.next()

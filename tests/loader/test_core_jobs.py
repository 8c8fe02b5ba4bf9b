"""The rebuilt reading core (issue 65 item 1) through ``ShardIter``: which job ``reset()`` and
``load_state_dict()`` take, what a failed fill and close() end, and how a closed iterator ends a
loop (the loader's reading: ``test_core_reading.py``). Each test was written for a mutation of
``tests/mutations`` that no other test noticed."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import batch_ids, make_store

import loader.pipeline.fill as fill
from loader import LoaderError, ShardIter
from loader.errors import IteratorClosed


def _until(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _ids(it) -> list:
    return [i for b in it for i in batch_ids(b)]


def _bounded_ids(it, n: int = -1, bound: float = 60) -> list:
    """The ids of ``n`` batches (-1: the rest of the epoch), read in a thread; what ended the read
    is raised here. A read still waiting after ``bound`` seconds closes the iterator and fails."""
    out: list = []

    def read():
        try:
            for k, b in enumerate(it):
                out.append(batch_ids(b))
                if k + 1 == n:
                    break
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            out.append(exc)

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    reading.join(bound)
    if reading.is_alive():
        it.close()
        pytest.fail(f"next() still waited after {bound} s")
    if out and isinstance(out[-1], BaseException):
        raise out[-1]
    return [i for ids in out for i in ids]


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


def _blocking_fill(monkeypatch, when) -> threading.Event:
    """``Reading.fill`` of the visits ``when(job, v)`` picks waits until its job is halted, then
    takes a while to stop (a native read ending its batch); returns the event set once one waits."""
    real_fill, entered = fill.Reading.fill, threading.Event()

    def blocking(self, v):
        if when(self.job, v):
            entered.set()
            self.job.halt.wait()
            threading.Event().wait(1.0)  # what the halted loader still has to do
            raise fill.Halted
        return real_fill(self, v)

    monkeypatch.setattr(fill.Reading, "fill", blocking)
    return entered


def test_close_returns_only_once_the_loader_thread_has_stopped(tmp_path, monkeypatch):
    """close() halts the loader mid-block and joins it: when close() returns no thread of the
    iterator reads on (a native read left running would read files close() let go of)."""
    entered = _blocking_fill(monkeypatch, lambda job, v: v == 1)
    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 60})
    it = ShardIter(tmp_path / "s", 8, seed=3, shuffle_buffer=40, cache_dir=tmp_path / "c")
    threads = it.reader.pipeline._threads
    try:
        it.next()
        assert entered.wait(60), "the loader never reached the second block"
        closing = threading.Thread(target=it.close)
        closing.start()
        closing.join(60)
        assert not closing.is_alive(), "close() did not return"
        assert threads and not [t.name for t in threads if t.is_alive()], "close() returned with its threads running"
    finally:
        it.close()


def test_a_load_state_dict_woken_by_close_from_another_thread_raises_that_the_iterator_closed(tmp_path,
                                                                                          monkeypatch):
    """load_state_dict() waits for its epoch's first read; close() from another thread wakes it, and
    it says the iterator was closed rather than return as if the state were loaded."""
    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 60})
    kw = dict(seed=3, cache_dir=tmp_path / "c")
    with ShardIter(tmp_path / "s", 8, **kw) as it:
        it.next(), it.next()
        state = it.state_dict()
    entered = _blocking_fill(monkeypatch, lambda job, v: job.skip > 0)
    it = ShardIter(tmp_path / "s", 8, **kw)
    try:
        outcome: list = []

        def load():
            try:
                it.load_state_dict(state)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                outcome.append(exc)

        loading = threading.Thread(target=load, daemon=True)
        loading.start()
        assert entered.wait(60), "the state's first read never started"
        it.close()
        loading.join(60)
        assert not loading.is_alive(), "load_state_dict() went on waiting after close()"
        assert isinstance(outcome[0], LoaderError) and "closed" in str(outcome[0]), outcome
    finally:
        it.close()


def test_a_failed_epoch_makes_no_next_epoch_job_until_reset(tmp_path, monkeypatch):
    """The loader goes on with the next epoch only once the current one's blocks are filled: after a
    fill failed it makes no next epoch's job (reset() starts the next epoch, on the files as they are)."""
    real_fill, failed = fill.Reading.fill, []

    def failing(self, v):
        if self.job.epoch == 0 and v == 1 and not failed:
            failed.append(v)
            raise LoaderError("a shard unreadable for a moment")
        return real_fill(self, v)

    monkeypatch.setattr(fill.Reading, "fill", failing)
    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 60})
    with ShardIter(tmp_path / "s", 8, seed=3, shuffle_buffer=40, cache_dir=tmp_path / "c") as it:
        pipeline = it.reader.pipeline
        with pytest.raises(LoaderError, match="unreadable for a moment"):
            _bounded_ids(it)  # the loader's error comes through the slot: never a wait for good
        with pytest.raises(LoaderError, match="unreadable for a moment"):  # every next() says it, not another
            it.next()
        # The error reached the caller through the slot: the loader's next wait is for a job to fill.
        _until(lambda: len(pipeline._loader_cv._waiters) > 0, "the loader thread never waited again")
        assert pipeline.ahead is None, "the loader made the next epoch's job after this epoch's fill failed"
        it.reset()
        assert sorted(_ids(it)) == list(range(120))


def test_reset_and_load_state_dict_mid_epoch_read_exactly_what_is_asked(tmp_path):
    """reset() and load_state_dict() in the middle of an epoch of several blocks halt the job read
    so far (its loader and producer stop, its blocks and batches are dropped): what follows is
    exactly the next epoch, or the rest of the state's, and never a wait for good."""
    make_store(tmp_path / "s", {"2024-01-02": 90, "2024-01-03": 70})
    kw = dict(seed=9, shuffle_buffer=40, prefetch_buffer=3, cache_dir=tmp_path / "c")
    with ShardIter(tmp_path / "s", 8, **kw) as ref:
        epochs = [_bounded_ids(ref)]
        ref.reset()
        head = _bounded_ids(ref, 4)
        state = ref.state_dict()
        epochs.append(head + _bounded_ids(ref))
    with ShardIter(tmp_path / "s", 8, **kw) as it:
        for k in (1, 5, 13):
            assert len(_bounded_ids(it, k)) == 8 * k
            it.reset()  # mid-epoch: the job and its batches go
            assert _bounded_ids(it) == epochs[1] if k == 1 else sorted(_bounded_ids(it)) == list(range(160))
            _bounded_ids(it, 2)
            it.load_state_dict(state)  # mid-epoch again, to the state's position
            assert _bounded_ids(it) == epochs[1][len(head):]
            it.reset()


def test_a_state_of_a_later_epoch_is_not_read_from_the_next_epochs_job(tmp_path):
    """The loader made epoch 1's job; a state saved at the start of epoch 2 is loaded: epoch 2's
    order is read (another permutation), not the job made ahead for epoch 1."""
    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 44})
    kw = dict(seed=11, cache_dir=tmp_path / "c")
    with ShardIter(tmp_path / "s", 8, **kw) as ref:
        epochs = []
        for _ in range(2):
            epochs.append(_ids(ref))
            ref.reset()
        state = ref.state_dict()  # epoch 2, before its first batch
        epochs.append(_ids(ref))
    assert epochs[2] != epochs[1]
    with ShardIter(tmp_path / "s", 8, **kw) as it:
        pipeline = it.reader.pipeline
        assert _ids(it) == epochs[0]
        _until(lambda: pipeline.ahead is not None and pipeline.ahead.epoch == 1, "the next epoch's job was not made")
        it.load_state_dict(state)
        assert _ids(it) == epochs[2]


def test_an_error_after_the_first_read_opened_reaches_next_after_the_batches_before_it(tmp_path, monkeypatch):
    """``ShardIter()`` (and ``load_state_dict()``, an object store's ``reset()``) raise what stops an
    epoch before its first read is open; a fill that fails after it (here the second block) comes to
    ``next()`` behind the batches before it, even when the loader met it before the caller looked."""
    import loader.pipeline.job as job_module

    class LateLook(threading.Event):  # the caller looks late, after its first read opened
        def wait(self, timeout=None):
            out = super().wait(timeout)
            time.sleep(0.5)  # the loader fills the first block and fails on the second meanwhile
            return out

    real_fill, failed = fill.Reading.fill, []

    def failing(self, v):
        if v == 1:
            failed.append(v)
            raise LoaderError("a shard unreadable for a moment")
        return real_fill(self, v)

    make_store(tmp_path / "s", {"2024-01-02": 60, "2024-01-03": 60})
    monkeypatch.setattr(fill.Reading, "fill", failing)
    monkeypatch.setattr(job_module, "threading", type("T", (), {"Event": LateLook}))
    with ShardIter(tmp_path / "s", 8, shuffle=False, shuffle_buffer=8, cache_dir=tmp_path / "c") as it:
        assert failed == [1]  # before the constructor returned
        assert batch_ids(it.next()) == list(range(8))
        with pytest.raises(LoaderError, match="unreadable for a moment"):
            it.next()

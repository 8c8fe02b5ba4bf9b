"""Batches lent to MXNet without a copy (``loader.pipeline.zerocopy``): a buffer is written again only
after MXNet gave it back (every array and view of it dropped, every pending operation on it done),
and giving it back runs no Python (no GIL taken behind the trainer's back)."""

import threading

import mxnet as mx
import numpy as np
import pytest
from conftest import batch_ids, make_store

from loader import ShardIter
from loader.pipeline import zerocopy
from loader.pipeline.memory import Arena

VIEWS = [(0, 12, (2, 3, 2)), (12, 14, (2,))]


def test_libc_gives_buffers_back_without_python():
    assert zerocopy.give_back_available(), "no C deleter: every dropped batch would take the GIL"


def test_dropping_a_batch_frees_its_arrays_without_releasing_the_gil(tmp_path):
    """Every array a batch holds, and every view MXNet makes of one, is a LentNDArray:
    dropped, it queues its handle, and frees the queue itself (past _PENDING_MAX) through a call that
    keeps the GIL (a dropped batch is no chance for the producer thread to take it in the middle of
    the trainer's next())."""
    import ctypes

    assert zerocopy._FREE_HOLDING_GIL._flags_ & ctypes._FUNCFLAG_PYTHONAPI, "a free that releases the GIL"
    make_store(tmp_path / "s", {"2024-01-02": 40})
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:
        b = it.next()
        arrays = list(b.data) + list(b.label)
        assert {type(a) for a in arrays} == {zerocopy.LentNDArray}
        assert type(arrays[0][1:3].reshape((-1,))) is zerocopy.LentNDArray
        del b, arrays
        assert sum(batch_ids(b) != [] for b in it) == 4  # the rest reads on as before


def test_dropping_arrays_makes_no_mxnet_call_the_next_lend_frees_them():
    """The trainer's thread only queues a dropped array's handle (freeing it there was ~13 us a
    batch, a ctypes call that lets go of the GIL each time); the next lend, or a look at a loan,
    frees the queue; past _PENDING_MAX handles, the dropping thread frees them. With no lender
    open (every iterator closed), a dropped array is freed at once."""
    zerocopy.free_pending()
    lone = zerocopy.Loan(np.arange(14, dtype=np.float32), VIEWS)
    dropped = lone.lend()
    open_lenders = zerocopy._LENDERS[0]
    zerocopy._LENDERS[0] = 0  # as if no iterator were open (an earlier test's may be)
    try:
        del dropped
        assert len(zerocopy._PENDING) == 0, "queued with nobody lending"
        mx.nd.waitall()
        _until(lambda: not lone.out, "not given back")
        zerocopy._LENDERS[0] = 1  # one open iterator
        _queued_until_the_next_lend()
    finally:
        zerocopy._LENDERS[0] = open_lenders


def _queued_until_the_next_lend():
    flat = np.arange(14, dtype=np.float32)
    loan = zerocopy.Loan(flat, VIEWS)
    x, y = loan.lend()
    view = x[1:2]
    del x, y, view
    assert len(zerocopy._PENDING) == 3, "a dropped array's handle was freed on the trainer's thread"
    other = zerocopy.Loan(np.arange(14, dtype=np.float32), VIEWS)
    kept = other.lend()  # the producer's next lend frees what was dropped
    assert len(zerocopy._PENDING) == 0
    mx.nd.waitall()
    _until(lambda: not loan.out, "not given back once its freed handles' chunk was deleted")
    loans = [zerocopy.Loan(np.full(14, i + 1, np.float32), VIEWS) for i in range(zerocopy._PENDING_MAX)]
    arrays = [a for one in loans for a in one.lend()]
    del arrays  # 2 x _PENDING_MAX handles dropped with nobody lending
    assert len(zerocopy._PENDING) <= zerocopy._PENDING_MAX
    mx.nd.waitall()
    _until(lambda: not any(one.out for one in loans), "dropped arrays never freed")
    del kept


def test_a_loan_is_out_until_mxnet_drops_every_array_and_view():
    flat = np.arange(14, dtype=np.float32)
    loan = zerocopy.Loan(flat, VIEWS)
    x, y = loan.lend()
    assert x.shape == (2, 3, 2) and y.shape == (2,)
    assert x.asnumpy().ravel().tolist() == list(range(12)) and y.asnumpy().tolist() == [12, 13]
    view = x[1:2]  # a view MXNet made: it shares the buffer, and Python cannot count it
    del x, y
    mx.nd.waitall()
    assert loan.out, "given back while a view of it was alive"
    assert view.asnumpy().ravel().tolist() == list(range(6, 12))
    with pytest.raises(RuntimeError):
        loan.lend()
    del view
    mx.nd.waitall()
    _until(lambda: not loan.out, "the loan was not given back once every array was dropped")
    again = loan.lend()  # lent again: the same buffer
    assert again[1].asnumpy().tolist() == [12, 13]


def test_a_pending_operation_keeps_the_loan_out():
    """Arrays dropped while an engine operation that reads them still waits (on a slow one): the
    buffer comes back only after that read."""
    flat = np.ones(14, np.float32)
    loan = zerocopy.Loan(flat, VIEWS)
    x, y = loan.lend()
    slow = mx.nd.dot(mx.nd.ones((1500, 1500)), mx.nd.ones((1500, 1500)))  # ~0.1-1 s of CPU
    total = x.sum() + y.sum() + slow[0, 0] * 0
    del x, y
    assert loan.out, "given back while an operation reading it was still pending"
    assert total.asscalar() == 14
    _until(lambda: not loan.out, "not given back after the pending read finished")


def test_the_iterator_never_rewrites_a_batch_the_caller_holds(tmp_path):
    """Hold every batch of two epochs, and views of them: each still holds the
    windows it was handed (a buffer reused early would show another batch's ids)."""
    make_store(tmp_path / "s", {"2024-01-02": 150, "2024-01-03": 90})
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c", seed=3, prefetch_buffer=2) as it:
        held, views = [], []
        for _ in range(2):
            for b in it:
                held.append((b, batch_ids(b)))
                views.append((b.label[0][2:5], batch_ids(b)[2:5]))
            it.reset()
        for b, ids in held:
            assert batch_ids(b) == ids
        held.clear()
        for view, ids in views:
            assert view.asnumpy().astype(int).tolist() == ids


def test_buffers_are_reused_once_given_back(tmp_path):
    """A trainer that drops each batch: the arena keeps reusing the same few buffers."""
    make_store(tmp_path / "s", {"2024-01-02": 400})
    mx.nd.waitall()
    before = zerocopy.outstanding()
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c") as it:
        for _ in range(3):
            assert sorted(i for b in it for i in batch_ids(b)) == list(range(400))
            it.reset()
        arena = it.reader.pipeline.arena
        assert len(arena._batches) <= arena.keep and len(arena._loans) <= arena.keep
        assert len(zerocopy._OUT) <= max(64, 2 * (before + it.prefetch_buffer + 2)), "the registry is not swept"
    mx.nd.waitall()
    _until(lambda: zerocopy.outstanding() <= before, "loans of dropped batches still out")


def test_a_buffer_a_loan_cannot_track_falls_back_to_from_numpy(monkeypatch):
    """An address whose low half is zero cannot be told from a given-back one: that buffer goes
    through mx.nd.from_numpy (its Python deleter), and is never handed out again (when MXNet lets
    go of it is not known); the arena keeps lending new buffers, which MXNet's arrays never share."""
    arena = Arena(None, 14, keep=2)

    def refuse(*a, **k):
        raise ValueError("an array address with a zero low half")

    monkeypatch.setattr(zerocopy.Loan, "__init__", refuse)
    flat = arena.batch()
    flat[:] = np.arange(14)
    x, y = arena.hand_out(flat, VIEWS)
    assert y.asnumpy().tolist() == [12, 13]
    assert all(b is not flat for b in arena._batches), "kept while MXNet holds it"
    again = arena.batch()
    assert again is not flat, "reused while MXNet held it"
    again[:] = -1
    assert y.asnumpy().tolist() == [12, 13], "MXNet's array changed under it"
    del x, y


def test_lending_from_many_threads_at_once():
    loans = [zerocopy.Loan(np.full(14, i, np.float32), VIEWS) for i in range(8)]
    errors = []

    def work(loan, value):
        try:
            for _ in range(200):
                while loan.out:
                    pass
                x, y = loan.lend()
                assert x.asnumpy()[0, 0, 0] == value
                del x, y
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(loan, i)) for i, loan in enumerate(loans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    _until(lambda: not any(loan.out for loan in loans), "loans left out")


def _until(predicate, what: str, seconds: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(what)


def test_a_sweep_judging_an_old_lending_never_ends_a_new_one():
    """The registry sweep (any thread) pauses between judging a loan given back and marking it so,
    while its owner lends it again: the new lending stays out (found by review, forced here)."""
    import sys
    import time

    loan = zerocopy.Loan(np.full(14, 1, np.float32), VIEWS)
    first = loan.lend()
    del first
    zerocopy.free_pending()  # what the producer's next lend does
    mx.nd.waitall()
    _until(lambda: all(t.dl_tensor.data != a for t, a in zip(loan._tensors, loan._addresses)), "not given back")
    paused = threading.Event()

    def slow_lines(frame, event, arg):
        if event == "call" and frame.f_code is zerocopy.Loan._refresh.__code__:
            def local(frame, event, arg):
                if event == "line" and "self._out = False" in _line(frame):
                    paused.set()
                    time.sleep(0.5)
                return local
            return local
        return None

    def sweep():
        sys.settrace(slow_lines)
        try:
            zerocopy.sweep()
        finally:
            sys.settrace(None)

    with zerocopy._OUT_LOCK:
        zerocopy._OUT.add(loan)
    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    assert paused.wait(10)
    loan.flat[:] = 2
    second = loan.lend()  # the owner lends it again while the sweep is paused
    sweeper.join(10)
    assert loan.out, "a new lending was marked given back by a sweep of the old one"
    assert second[1].asnumpy().tolist() == [2, 2]
    del second


def _line(frame) -> str:
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_loans_given_back_after_a_peak_leave_the_registry(tmp_path):
    """A trainer that once held a whole epoch (list(it)), then drops each batch: the registry lets
    go of the buffers it held (review: it kept ~30 MB referenced until the process ended)."""
    make_store(tmp_path / "s", {"2024-01-02": 800})
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c") as it:
        held = list(it)  # 200 batches at once
        assert len(zerocopy._OUT) >= 150
        del held
        mx.nd.waitall()
        for _ in range(3):
            it.reset()
            for _b in it:
                pass
        assert len(zerocopy._OUT) < 100, len(zerocopy._OUT)

"""MXNet's ``Module.fit`` stopped and resumed in another process (issue 62, items 1 and 2), through the
real ``fit`` (tests/fit_resume_worker.py): fit asks for batch k+1 before the ``batch_end_callback`` of
batch k, so a state saved there with ``it.fit_checkpoint`` counts the batches fit trained, not the
ones it was handed; a state saved at an epoch's end resumes at the next epoch's first batch. Each
window of the epoch is trained once over both processes, in the order of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, batch_ids, make_store

from loader import LoaderError, ShardIter
from loader.checkpoint import _digest
from loader.tools.train_fit import evaluate_module

COUNTS = {f"2024-03-{d:02d}": 13 + 3 * (d % 3) for d in range(4, 12)}  # 8 dates, 131 windows
KW = dict(label_names=["a"], seed=5, shuffle_buffer=8)
B = 8
WORKER = ROOT / "tests" / "fit_resume_worker.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("fitresume") / "s"
    make_store(path, COUNTS, pack=2)
    return path


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory):
    """The ids of every batch of epochs 0 and 1, read without a stop."""
    with ShardIter(store, B, cache_dir=tmp_path_factory.mktemp("c"), **KW) as it:
        first = [batch_ids(b) for b in it]
        it.reset()
        return first, [batch_ids(b) for b in it]


def _run(store, out, tag, *args, timeout=240):
    done = subprocess.run([sys.executable, "-P", str(WORKER), "--store", str(store), "--out", str(out), "--tag", tag,
                           *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def _forwards(out, tag) -> list:
    return [json.loads(line) for line in (out / f"{tag}.jsonl").read_text().splitlines()]


def _trained_before_the_save(out) -> list:
    """Process 1's forwards up to its last save (the state and the model's parameters of that moment)."""
    saved = json.loads((out / "saved.json").read_text())
    return _forwards(out, "first")[: saved["forwards"]]


def _check_resumed(out, uninterrupted) -> None:
    epoch0, epoch1 = uninterrupted
    before, after = _trained_before_the_save(out), _forwards(out, "then")
    assert before and all(e == 0 for e, _ in before)
    resumed = [ids for e, ids in after if e == 0]
    assert [ids for _, ids in before] + resumed == epoch0  # every batch once, in the uninterrupted order
    assert [ids for e, ids in after if e == 1] == epoch1
    assert {e for e, _ in after} <= {0, 1}, "fit(num_epoch=2) read a third epoch"
    trained = sorted(i for ids in epoch0 for i in ids)
    assert trained == list(range(sum(COUNTS.values())))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stop", ["mid", "last"])
def test_module_fit_stopped_after_a_checkpoint_resumes_training_every_window_once(store, uninterrupted, tmp_path,
                                                                                   stop):
    """``fit_checkpoint(save, every=2)``: saved after fit's 2nd, 4th, ... batch and its last; the run
    stops at the save after its 5th batch (or at its last batch); a new process loads the state and
    ``fit(begin_epoch=state["epoch"])`` (the issue: 256 windows, one batch, never trained)."""
    at = 5 if stop == "mid" else len(uninterrupted[0])
    _run(store, tmp_path, "first", "--stop-at", at)
    assert json.loads((tmp_path / "saved.json").read_text())["forwards"] == (6 if stop == "mid" else at)
    _run(store, tmp_path, "then", "--resume", "--epochs", 2)
    _check_resumed(tmp_path, uninterrupted)


@pytest.mark.timeout(600)
def test_module_fit_killed_after_a_checkpoint_resumes_training_every_window_once(store, uninterrupted, tmp_path):
    """kill -9 of the training process after its save at fit's 8th batch; the resume trains the rest."""
    cmd = [sys.executable, "-P", str(WORKER), "--store", str(store), "--out", str(tmp_path), "--tag", "first",
           "--hang-at", "7"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "hanging").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the first run never reached its save"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        proc.stderr.close()
    assert json.loads((tmp_path / "saved.json").read_text())["forwards"] == 8
    _run(store, tmp_path, "then", "--resume", "--epochs", 2)
    _check_resumed(tmp_path, uninterrupted)


@pytest.mark.timeout(600)
def test_module_fit_resumed_from_an_epoch_end_state_trains_the_next_epoch_whole(store, uninterrupted, tmp_path):
    """``state_dict()`` saved in ``epoch_end_callback`` is the next epoch's start (``state["epoch"]`` 1), and
    ``fit(begin_epoch=state["epoch"], num_epoch=2)`` trains that epoch whole, once (was: a bare StopIteration;
    then, in review, a third epoch)."""
    _run(store, tmp_path, "first", "--epoch-end")
    assert json.loads((tmp_path / "saved.json").read_text())["state"]["epoch"] == 1
    _run(store, tmp_path, "then", "--resume", "--epochs", 2)
    assert _forwards(tmp_path, "then") == [[1, ids] for ids in uninterrupted[1]]


def test_a_loaded_epoch_end_state_starts_the_next_epoch_once_in_a_loop_or_after_reset(store, uninterrupted,
                                                                                      tmp_path):
    """A Gluon loop over an epoch-end state reads the next epoch; so does ``reset()`` after the load
    (no epoch skipped); ``state_dict()`` before either still says the epoch ended."""
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        for _ in it:
            pass
        end = it.state_dict()
    for reset_first in (False, True):
        with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
            it.load_state_dict(end)
            assert it.state_dict() == end
            if reset_first:
                it.reset()
            assert [batch_ids(it.next()) for _ in uninterrupted[1]] == uninterrupted[1] and it.epoch == 1
            with pytest.raises(StopIteration):  # then that epoch ends, as any other
                it.next()
            assert it.state_dict()["epoch"] == 2
            it.reset()  # and the next reset() starts the epoch after it
            assert it.epoch == 2 and len(list(it)) == len(uninterrupted[1])


def test_untrained_batches_leave_the_state_before_them_and_are_bounded(store, uninterrupted, tmp_path):
    """``state_dict(untrained=k)``: the batches after the state are the k last handed out and the rest;
    a plain ``state_dict()`` counts every batch handed out (a Gluon loop's meaning)."""
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        for _ in range(3):
            it.next()
        states = [it.state_dict(untrained=k) for k in (0, 1, 3)]
        assert [it.state_dict(untrained=np.int64(k)) for k in (0, 1, 3)] == states  # numpy integers are counts
        for bad in (4, -1, 1.0, True, np.int64(4), np.float64(1.0), np.bool_(True), "1"):
            with pytest.raises(LoaderError, match=r"untrained=.*expected a number of batches from 0 to the 3"):
                it.state_dict(untrained=bad)
        for bad in (0, np.int64(0), True, np.bool_(True), 3.0, "3"):
            with pytest.raises(LoaderError, match=r"every=.*, expected a number of batches >= 1"):
                it.fit_checkpoint(print, every=bad)
        for _ in it:
            pass
        last = it.state_dict(untrained=1)  # after StopIteration, one batch not trained: not the epoch's end
        assert "ended" not in last and it.state_dict()["ended"] is True
        edited = {k: v for k, v in it.state_dict().items() if k != "sha256"}
        edited["ended"] = 1
        with pytest.raises(LoaderError, match="'ended' must be true or absent, got 1"):
            it.load_state_dict({**edited, "sha256": _digest(edited)})
        edited = {k: v for k, v in last.items() if k != "sha256"}
        edited["ended"] = True  # an end mark on a state that has read batches of its epoch
        with pytest.raises(LoaderError, match="'ended' marks an epoch's start, but its 'phases'"):
            it.load_state_dict({**edited, "sha256": _digest(edited)})
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.load_state_dict(last)
        assert [batch_ids(b) for b in it] == uninterrupted[0][-1:]
    for k, state in zip((0, 1, 3), states):
        with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
            it.load_state_dict(state)
            assert [batch_ids(b) for b in it] == uninterrupted[0][3 - k:]


def _module(it):
    import mxnet as mx

    data = mx.sym.var("seq_var")
    out = mx.sym.flatten(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=1))
    net = mx.sym.LinearRegressionOutput(out, label=mx.sym.var("a"), name="out")
    return mx.mod.Module(net, data_names=["seq_var"], label_names=["a"])


@pytest.mark.parametrize("every", [3, np.int64(3)], ids=["int", "numpy-int64"])
def test_fit_checkpoint_states_count_the_batches_fit_trained_in_every_epoch(store, uninterrupted, tmp_path, every):
    """In one real ``Module.fit`` of two epochs, ``every=3`` (a numpy integer too, as a script that reads
    it from an array passes it): a state after fit's 3rd, 6th, ... batch and its last, each counting the
    batches trained (the last: the next epoch's start, marked as an end)."""
    n = len(uninterrupted[0])
    saved = []
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        mod = _module(it)
        on_batch = it.fit_checkpoint(lambda state: saved.append(state), every=every)
        mod.fit(it, num_epoch=2, optimizer="sgd", optimizer_params={"learning_rate": 1e-6}, batch_end_callback=on_batch)
    want = [(e + 1, 0, True) if k == n else (e, k, False)
            for e in (0, 1) for k in range(1, n + 1) if k % 3 == 0 or k == n]
    assert [(s["epoch"], s["phases"][-1][2], s.get("ended", False)) for s in saved] == want


def test_the_module_paths_validation_figure_leaves_the_pad_out(store, tmp_path):
    """``evaluate_module`` (the example trainer's ``--module`` val mse): the mse over the real rows, as
    MXNet's own ``Module.predict`` (which trims each batch by its pad) gives them."""
    import numpy as np

    with ShardIter(store, 10, shuffle=False, cache_dir=tmp_path / "c", **{**KW, "shuffle_buffer": None}) as it:
        assert sum(COUNTS.values()) % 10, "the last batch is padded"
        mod = _module(it)
        mod.bind(it.provide_data, it.provide_label, for_training=False)
        mod.init_params()
        got = evaluate_module(mod, it, 0)
        pred = mod.predict(it).asnumpy().reshape(-1)
        it.reset()
        labels = np.concatenate([b.label[0].asnumpy()[: 10 - b.pad] for b in it])
    assert got == pytest.approx(float(((pred - labels) ** 2).mean()), rel=1e-5)

"""MXNet's own clients over the parts of a store: ``Module.predict`` (which trims every batch by
``pad`` and fails on an all-filler batch), ``Module.score`` and ``PrefetchingIter`` with ``reset()``.
The parts together must give every window once, and each part exactly its own windows."""

from collections import Counter

import mxnet as mx
import numpy as np
import pytest
from conftest import make_store, part_sizes, stop_prefetching

from loader import ShardIter

# 16 dates of different sizes: 232 windows. 3 parts of batch 8: 77/77/78 windows, 10 batches each;
# 3 parts of batch 7 (232 = 11 * 21 + 1) is the README's exception.
COUNTS = {f"2024-01-{d:02d}": 5 + (d * 7) % 19 for d in range(2, 18)}
N = sum(COUNTS.values())


@pytest.fixture(scope="module", params=[1, 8], ids=["samples", "windows-pack8"])
def store(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"clients{request.param}")
    make_store(path, COUNTS, pack=request.param)
    return path


def _identity_module(it):
    """A module whose output is its input row, flattened: predictions identify the windows."""
    net = mx.sym.flatten(mx.sym.var("seq_var"))
    mod = mx.mod.Module(net, data_names=["seq_var"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=it.provide_data, for_training=False)
    mod.init_params()
    return mod


def _ids(rows: np.ndarray) -> list:
    """Window ids from flattened x rows (x[0, 0] == id)."""
    return np.rint(rows[:, 0]).astype(int).tolist()


@pytest.mark.parametrize("parts, batch_size", [(1, 16), (2, 5), (3, 8), (8, 3)])
def test_module_predict_gives_each_part_exactly_its_windows(store, tmp_path, parts, batch_size):
    assert N % (parts * batch_size) == 0 or N % (parts * batch_size) >= parts, "not the README's exception"
    seen = Counter()
    for p in range(parts):
        with ShardIter(store, batch_size, seed=2, num_parts=parts, part_index=p,
                       cache_dir=tmp_path) as it:
            mod = _identity_module(it)
            for _ in range(2):  # predict resets the iterator first: two epochs
                out = mod.predict(it, reset=True).asnumpy()
                assert out.shape[0] == part_sizes(N, parts)[p] == it.records_per_epoch
                ids = _ids(out)
                assert len(set(ids)) == len(ids), "a part never repeats a window"
            seen.update(ids)
    assert seen == Counter(range(N)), "the parts together give every window once"


def test_module_predict_survives_the_readme_exception(store, tmp_path):
    """N mod (parts * batch) in [1, parts-1]: shorter parts repeat one row, never an all-filler batch."""
    parts, batch_size = 3, 7  # parts 77, 77, 78: 12 batches each; the 77s have nothing for the 12th
    assert 1 <= N % (parts * batch_size) <= parts - 1
    seen = Counter()
    for p in range(parts):
        with ShardIter(store, batch_size, num_parts=parts, part_index=p, cache_dir=tmp_path) as it:
            out = _identity_module(it).predict(it).asnumpy()
            ids = _ids(out)
            size = part_sizes(N, parts)[p]
            assert len(ids) == 12 * batch_size - sum(b.pad for b in _epoch(it))
            assert len(set(ids)) == size and len(ids) - size in (0, 1)
            seen.update(set(ids))
    assert seen == Counter(range(N))


def _epoch(it):
    it.reset()
    return list(it)


def test_module_score_runs_every_part_with_equal_batches(store, tmp_path):
    parts, batch_size = 3, 8
    counted = set()
    for p in range(parts):
        with ShardIter(store, batch_size, num_parts=parts, part_index=p, label_names=["a"],
                       cache_dir=tmp_path) as it:
            data = mx.sym.var("seq_var")
            out = mx.sym.LinearRegressionOutput(mx.sym.slice_axis(mx.sym.flatten(data), axis=1, begin=0, end=1),
                                                label=mx.sym.var("a"))
            mod = mx.mod.Module(out, data_names=["seq_var"], label_names=["a"], context=mx.cpu())
            mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label, for_training=False)
            mod.init_params()
            metric = mx.metric.MAE()
            mod.score(it, metric)
            name, mae = metric.get()
            assert mae < 1e-4, "output x[0, 0] equals label a on every row, filler rows included"
            counted.add(metric.num_inst)
    assert counted == {10}, "score sees the same number of batches (MAE counts one per batch) on every part"


@pytest.mark.parametrize("parts", [2, 3])
def test_prefetching_iter_two_epochs_with_reset(store, tmp_path, parts):
    batch_size = 6
    seen = [Counter(), Counter()]
    for p in range(parts):
        with ShardIter(store, batch_size, seed=1, num_parts=parts, part_index=p, cache_dir=tmp_path) as base:
            it = mx.io.PrefetchingIter(base)
            try:
                for e in range(2):
                    got = []
                    for b in it:
                        assert 0 <= b.pad < batch_size
                        x = b.data[0].asnumpy()
                        got += _ids(x.reshape(len(x), -1)[:batch_size - b.pad])
                    assert len(got) == part_sizes(N, parts)[p]
                    seen[e].update(got)
                    if e == 0:
                        it.reset()
            finally:
                stop_prefetching(it)  # before the ShardIter its thread calls is closed
    assert seen[0] == seen[1] == Counter(range(N))


@pytest.mark.parametrize("parts, batch_size", [(1, 300), (3, 78), (3, 100)])
def test_a_batch_larger_than_a_part_through_fit_predict_and_score(store, tmp_path, parts, batch_size):
    """A small validation split (parts of 77/77/78 windows, or all 232, below batch_size): one batch
    per part and epoch, ``pad = batch_size - windows``; Module.fit trains on it, predict gives each
    part exactly its windows, score counts one batch on every part."""
    seen = Counter()
    for p in range(parts):
        size = part_sizes(N, parts)[p]
        with ShardIter(store, batch_size, seed=4, num_parts=parts, part_index=p, label_names=["a"],
                       cache_dir=tmp_path) as it:
            assert [b.pad for b in it] == [batch_size - size]
            it.reset()
            out = _identity_module(it).predict(it).asnumpy()
            ids = _ids(out)
            assert len(ids) == len(set(ids)) == size
            seen.update(ids)
            data = mx.sym.var("seq_var")
            net = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=1),
                                                label=mx.sym.var("a"))
            mod = mx.mod.Module(net, data_names=["seq_var"], label_names=["a"], context=mx.cpu())
            batches = []
            it.reset()  # fit() starts where the iterator is (predict read it to its end)
            mod.fit(it, num_epoch=2, optimizer="sgd", optimizer_params={"learning_rate": 1e-9},
                    initializer=mx.init.Zero(), eval_metric="mse",
                    batch_end_callback=lambda param, out=batches: out.append((param.epoch, param.nbatch)))
            assert batches == [(0, 0), (1, 0)], "one batch per epoch"
            assert it.stats["last_epoch"]["samples"] == size
            metric = mx.metric.MSE()
            mod.score(it, metric)
            assert metric.num_inst == 1 and np.isfinite(metric.get()[1])
    assert seen == Counter(range(N)), "the parts together give every window once"

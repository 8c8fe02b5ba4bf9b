"""ShardIter: contract, exact-once epochs, parts, shuffle, date ranges, generations, resumption."""

import json
from collections import Counter

import mxnet as mx
import numpy as np
import pytest
from conftest import batch_ids, expected_pads, make_store, part_sizes, real_batches, stop_prefetching

from loader import LoaderError, ShardIter, to_datetime64
from shardgen.store.manifest import Manifest

COUNTS = {"2024-01-02": 7, "2024-01-03": 13, "2024-01-04": 1, "2024-01-05": 20}  # 41 records


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    make_store(path, COUNTS)
    return path


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def opened(monkeypatch):
    """The ShardIters a test opens, held to its end: each must be closed by then, and every thread
    the test started must end (one left running, a PrefetchingIter's holding its ShardIter, broke a
    later test that counts threads). A test that drops an iterator on purpose empties the list."""
    import threading
    import time

    import loader.shard_iter

    made, track = [], loader.shard_iter.track
    monkeypatch.setattr(loader.shard_iter, "track", lambda it: (made.append(it), track(it)))
    threads = set(threading.enumerate())
    yield made
    left_open = [it for it in made if not it._closed]
    for it in left_open:
        it.close()
    made.clear()
    deadline = time.monotonic() + 30
    while (running := [t for t in threading.enumerate() if t not in threads and t.is_alive()]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left_open, f"{len(left_open)} ShardIter(s) left open"
    assert not running, f"threads left running: {[t.name for t in running]}"


def epoch(it):
    batches = list(it)
    it.reset()
    return batches


def test_contract_shapes_and_values(store, cache):
    it = ShardIter(store / "manifest.json", 8, shuffle=False, cache_dir=cache)
    assert [(d.name, d.shape, d.layout) for d in it.provide_data] == [("seq_var", (8, 3, 2), "NTC")]
    assert [(d.name, d.shape) for d in it.provide_label] == [("a", (8,)), ("b", (8, 2)), ("date", (8,))]
    b = it.next()
    assert b.data[0].shape == (8, 3, 2) and b.data[0].dtype == np.float32
    x, a, bb, date = b.data[0].asnumpy(), *(lab.asnumpy() for lab in b.label)
    np.testing.assert_array_equal(a, np.arange(8))
    np.testing.assert_allclose(x[5], 5 + np.arange(6).reshape(3, 2) / 100, rtol=1e-6)
    np.testing.assert_array_equal(bb, np.stack([a * 2, -a], 1))
    assert list(to_datetime64(date)[[0, 6, 7]].astype(str)) == ["2024-01-02", "2024-01-02", "2024-01-03"]
    it.close()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3, 7])
@pytest.mark.parametrize("dates, n", [(None, 41), (("2024-01-03", "2024-01-04"), 14)])
def test_exact_once_every_epoch_every_part(store, cache, shuffle, batch_size, dates, n):
    first = sum(v for d, v in COUNTS.items() if dates is not None and d < dates[0])
    for parts in range(1, 9):  # parts of 1-41 samples: some smaller than a batch (one padded batch)
        iters = [ShardIter(store, batch_size, shuffle=shuffle, seed=5, num_parts=parts, part_index=p,
                           dates=dates, cache_dir=cache) for p in range(parts)]
        for _ in range(3):
            seen = Counter()
            for p, it in enumerate(iters):
                assert it.records_per_epoch == part_sizes(n, parts)[p]
                batches = epoch(it)
                assert [b.pad for b in batches] == expected_pads(n, parts, batch_size, p)
                for b in batches:
                    assert b.data[0].shape[0] == batch_size and 0 <= b.pad < batch_size
                    filler = b.label[0].asnumpy()[batch_size - b.pad:].astype(int)
                    assert set(filler) <= set(range(first, first + n)), "padding rows must be real records"
                    assert np.isfinite(b.data[0].asnumpy()).all()
                part = Counter(i for b in real_batches(batches, n, parts, p) for i in batch_ids(b))
                assert sum(part.values()) == part_sizes(n, parts)[p], "parts are balanced by samples"
                seen.update(part)
            assert seen == Counter(range(first, first + n)), "each record exactly once per epoch"
        for it in iters:
            it.close()


def test_discard_yields_full_batches_only(store, cache):
    seen = Counter()
    for p in range(3):  # parts 14, 14, 13 -> 3 full batches each
        with ShardIter(store, 4, num_parts=3, part_index=p, last_batch="discard", cache_dir=cache) as it:
            batches = epoch(it)
        assert len(batches) == 3 and all(b.pad == 0 for b in batches)
        for b in batches:
            seen.update(batch_ids(b))
    assert sum(seen.values()) == 36 and max(seen.values()) == 1


def test_shuffle_is_global_reproducible_and_per_epoch(store, cache):
    def orders(seed, epochs=3):
        it = ShardIter(store, 41, seed=seed, cache_dir=cache)
        out = [batch_ids(epoch(it)[0]) for _ in range(epochs)]
        it.close()
        return out

    a, b, c = orders(1), orders(1), orders(2)
    assert a == b  # same seed, same generation: same order
    for order in a + c:
        # Mixes shards: the 20 records of 2024-01-05 (ids 21..40) spread over the epoch. In order,
        # or shard by shard, the first half holds 0 or 20 of them; a uniform shuffle 4..16 except
        # with probability 5e-5 (hypergeometric). (">= 3 dates among the first ten" fails 1 in 10.)
        assert sorted(order) == list(range(41))
        assert 4 <= sum(i >= 21 for i in order[:20]) <= 16, order
    assert a[0] != a[1] and a[1] != a[2] and a[0] != a[2]  # differs per epoch
    assert a[0] != c[0]


def test_new_generation_only_after_reset(tmp_path, cache):
    make_store(tmp_path, {"2024-01-02": 10})
    with ShardIter(tmp_path, 4, shuffle=False, cache_dir=cache) as it:
        ids = batch_ids(it.next())
        make_store(tmp_path, {"2024-01-03": 5}, base_id=100)  # published mid-epoch
        assert Manifest.load(tmp_path / "manifest.json").generation == 2
        for b in it:
            ids += batch_ids(b)
        assert sorted(ids) == list(range(10)) and it.generation == 1
        it.reset()
        ids = [i for b in it for i in batch_ids(b)]
        assert sorted(ids) == list(range(10)) + list(range(100, 105)) and it.generation == 2


def test_date_range_selection(store, cache):
    with ShardIter(store, 2, dates=(None, "2024-01-03"), cache_dir=cache) as train, \
            ShardIter(store, 2, dates=("2024-01-04", None), cache_dir=cache) as val:
        tr = [i for b in train for i in batch_ids(b)]
        va = [i for b in val for i in batch_ids(b)]
    assert sorted(tr) == list(range(20)) and sorted(va) == list(range(20, 41))


@pytest.mark.parametrize("parts, stop_at", [(1, 3), (2, 0), (2, 4)])
def test_resume_equals_uninterrupted(store, cache, parts, stop_at):
    kw = dict(batch_size=3, seed=9, num_parts=parts, part_index=parts - 1, cache_dir=cache)
    with ShardIter(store, **kw) as ref:
        full = [batch_ids(b) for b in epoch(ref)] + [batch_ids(b) for b in epoch(ref)]
    with ShardIter(store, **kw) as run:
        epoch(run)
        got = [batch_ids(run.next()) for _ in range(stop_at)]
        state = json.loads(json.dumps(run.state_dict()))  # survives a round trip through JSON
    with ShardIter(store, **kw) as resumed:
        resumed.load_state_dict(state)
        got += [batch_ids(b) for b in resumed]
    assert got == full[len(full) // 2:]


def test_stats_report_rates(store, cache):
    it = ShardIter(store, 5, cache_dir=cache)
    list(it)
    s = it.stats
    assert s["samples"] == 41 and s["batches"] == 9
    assert s["samples_per_s"] > 0 and 0 <= s["stall_fraction"] <= 1.0 + 1e-9
    it.close()


def test_stall_fraction_tells_a_slow_consumer_from_a_slow_producer(store, cache, monkeypatch):
    """A consumer that works 50 ms per batch finds its batches ready; a producer that takes 50 ms
    per native batch (one per block of 5 records) keeps the consumer waiting most of the time."""
    import time

    import loader.pipeline.fill as module

    with ShardIter(store, 5, shuffle=False, prefetch_buffer=2, shuffle_buffer=5, cache_dir=cache) as it:
        _wait_until_parked(it)  # the native iterator started and the producer filled its queue
        for _ in it:
            time.sleep(0.05)
        assert it.stats["batches"] == 9 and it.stats["stall_fraction"] < 0.2, it.stats
    real = module.next_label

    def slow(native):
        time.sleep(0.05)
        return real(native)

    monkeypatch.setattr(module, "next_label", slow)
    with ShardIter(store, 5, shuffle=False, prefetch_buffer=2, shuffle_buffer=5, cache_dir=cache) as it:
        assert sum(5 - b.pad for b in it) == 41
        assert it.stats["stall_fraction"] > 0.8, it.stats


def test_label_names_subset_and_for_kvstore(store, cache):
    with ShardIter(store, 4, label_names=["a"], cache_dir=cache) as it:
        assert [d.name for d in it.provide_label] == ["a"] and len(it.next().label) == 1
    with pytest.raises(LoaderError, match="choose among"):
        ShardIter(store, 4, label_names=["nope"], cache_dir=cache)
    kv = mx.kv.create("local")
    with ShardIter.for_kvstore(kv, store, 4, cache_dir=cache) as it:
        assert (it.num_parts, it.part_index) == (1, 0)


def test_prefetching_iter_wraps_it(store, cache):
    with ShardIter(store, 5, shuffle=False, cache_dir=cache) as it:
        pit = mx.io.PrefetchingIter(it)
        try:
            ids = [i for b in pit for i in batch_ids(b)]
        finally:
            stop_prefetching(pit)  # before the ShardIter its thread calls is closed
    assert sorted(ids) == list(range(41))


def test_iter_next_and_the_getters_give_what_next_gives(store, cache):
    """``iter_next()`` then ``getdata/getlabel/getpad/getindex``: the path MXNet's ``Module`` and
    ``PrefetchingIter`` take through a DataIter. The same batches, pads and index as ``next()``."""
    kw = dict(batch_size=8, seed=3, cache_dir=cache)  # 41 samples: 6 batches, the last with pad 7
    with ShardIter(store, **kw) as a, ShardIter(store, **kw) as b:
        for _ in range(2):  # and again after reset()
            want = list(a)
            got = []
            while b.iter_next():
                got.append((b.getdata(), b.getlabel(), b.getpad(), b.getindex()))
            assert not b.iter_next(), "the end stays the end"
            assert [pad for _d, _l, pad, _i in got] == [x.pad for x in want] == [0] * 5 + [7]
            for (data, label, _pad, index), batch in zip(got, want):
                assert index is None and batch.index is None
                assert len(data) == 1 and len(label) == 3
                for x, y in zip(data + label, batch.data + batch.label):
                    np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())
            a.reset()
            b.reset()


def _copy_store(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("text, match", [("0\t0\n", "2024-01-05.idx: 1 records"),
                                         ("garbage", "2024-01-05.idx: malformed index"),
                                         ("".join(f"{i}\t{i * 9}\n" for i in range(20)), "offsets differ")])
def test_a_damaged_idx_is_for_verify_the_loader_does_not_use_it(store, tmp_path, cache, text, match):
    """The loader indexes whole-size records itself (from the checked .rec); stock MXNet readers
    use the .idx, so `shardgen verify` names it."""
    from shardgen.store.verify import verify_store

    copy = _copy_store(store, tmp_path / "s")
    (copy / "2024-01-05.idx").write_text(text)
    with ShardIter(copy, 4, shuffle=False, cache_dir=cache) as it:
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(41))
    problems = verify_store(copy)[1]
    assert len(problems) == 1 and problems[0][0] == "2024-01-05" and match in problems[0][1]


@pytest.mark.parametrize("damage, match", [
    (lambda s: (s / "manifest.json").unlink(), "no manifest"),
    (lambda s: (s / "manifest.json").write_text("{not json"), "not valid JSON"),
    (lambda s: (s / "manifest.json").write_text('{"format": "other/9"}'), "format 'other/9'"),
    (lambda s: (s / "2024-01-03.rec").unlink(), "2024-01-03.rec: shard file is missing"),
    (lambda s: open(s / "2024-01-03.rec", "r+b").truncate(100), "2024-01-03.rec: 100 bytes, the manifest says"),
])
def test_bad_store_is_a_clear_error(store, tmp_path, cache, damage, match):
    copy = _copy_store(store, tmp_path / "copy")
    damage(copy)
    with pytest.raises(LoaderError, match=match):
        ShardIter(copy / "manifest.json", 4, cache_dir=cache)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(batch_size=42, last_batch="discard"), "batch_size 42 is larger than part 0 of 1 .*leaves no batch"),
    (dict(batch_size=4, num_parts=2, part_index=2), r"part_index must be in \[0, 2\)"),
    (dict(batch_size=4, last_batch="keep"), "last_batch must be"),
    (dict(batch_size=4, dates=("2025-01-01", None)), "no shards selected"),
    (dict(batch_size=4, dates=("yesterday", None)), "not YYYY-MM-DD"),
    (dict(batch_size=4, seed=-1), "seed must be"),
])
def test_bad_arguments(store, cache, kwargs, match):
    with pytest.raises(LoaderError, match=match):
        ShardIter(store, cache_dir=cache, **kwargs)


def test_semicolon_in_store_path(store, tmp_path, cache):
    """MXNet joins .rec paths with ';' but never sees the store's paths (only /proc/self/fd links)."""
    copy = _copy_store(store, tmp_path / "a;b")
    with ShardIter(copy, 4, shuffle=False, cache_dir=cache) as it:
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(41))
    with pytest.raises(LoaderError, match="may not contain ';'"):
        ShardIter(store, 4, cache_dir=tmp_path / "c;d")


def test_schema_change_raises_at_reset(tmp_path, cache):
    make_store(tmp_path / "s", {"2024-01-02": 10})
    with ShardIter(tmp_path / "s", 4, cache_dir=cache) as it:
        (tmp_path / "s" / "manifest.json").unlink()
        make_store(tmp_path / "s", {"2024-01-03": 10}, t=4)
        with pytest.raises(LoaderError, match="schema changed"):
            it.reset()


def test_module_fit_trains_and_stats_keep_the_last_finished_epoch(store, cache):
    """``Module.fit`` resets the iterator after every epoch: ``stats`` then describe an epoch not
    started, and ``stats["last_epoch"]`` the one it trained on."""
    with ShardIter(store, 8, label_names=["a"], cache_dir=cache) as it:
        assert it.stats["last_epoch"] is None
        data = mx.sym.var("seq_var")
        net = mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=1, name="fc")  # named: MXNet's counter is global
        net = mx.sym.LinearRegressionOutput(mx.sym.flatten(net), label=mx.sym.var("a"), name="out")
        mod = mx.mod.Module(net, data_names=["seq_var"], label_names=["a"], context=mx.cpu())
        seen = []
        mod.fit(it, num_epoch=2, optimizer="sgd", optimizer_params={"learning_rate": 1e-6}, eval_metric="mse",
                initializer=mx.init.Zero(), batch_end_callback=lambda p: seen.append((p.epoch, p.nbatch)))
        assert len(seen) == 2 * 6  # ceil(41 / 8) per epoch
        weight = mod.get_params()[0]["fc_weight"].asnumpy()
        assert np.isfinite(weight).all() and (weight != 0).any()  # it trained on the batches
        now, last = it.stats, it.stats["last_epoch"]
        assert (now["epoch"], now["batches"], now["samples"], now["samples_per_s"]) == (2, 0, 0, 0.0)
        assert (last["epoch"], last["batches"], last["samples"]) == (1, 6, 41)
        assert last["samples_per_s"] > 0 and last["seconds"] > 0 and "last_epoch" not in last
        assert [h["samples"] for h in it.history] == [41, 41]
    assert it.stats["last_epoch"]["samples"] == 41, "readable after close()"


def test_records_split_by_the_magic_word_read_back_exactly(tmp_path, cache):
    """dmlc splits a record whose payload holds its magic word; the native reader must rejoin it."""
    import datetime as dt
    import struct

    from shardgen.format import MAGIC, LabelSpec, Schema
    from shardgen.produce.writer import write_shard
    from shardgen.store.publish import publish

    schema = Schema.create(time_steps=2, num_inputs=2, data_name="seq_var", labels=[LabelSpec("a", 1)])
    magic = np.frombuffer(struct.pack("<I", MAGIC), np.float32)[0]
    x = np.arange(40, dtype=np.float32).reshape(10, 2, 2)
    x[3, 0, 1] = x[7, 1, 1] = x[7, 0, 0] = magic
    labels = {"a": np.arange(10, dtype=np.float32)}
    entry = write_shard(tmp_path, dt.date(2024, 1, 2), x, labels, schema).entry()
    assert entry.bytes > 10 * schema.record_bytes  # the split records are longer
    publish(tmp_path, schema, 0, [entry])
    with ShardIter(tmp_path, 10, shuffle=False, cache_dir=cache) as it:
        b = it.next()
    np.testing.assert_array_equal(b.data[0].asnumpy(), x)
    np.testing.assert_array_equal(b.label[0].asnumpy(), labels["a"])


def test_date_selection_changes_at_the_next_reset(store, cache):
    with ShardIter(store, 2, shuffle=False, dates=(None, "2024-01-02"), cache_dir=cache) as it:
        it.next()
        it.dates = ("2024-01-04", None)
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(2, 7))  # this epoch: unchanged
        it.reset()
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(20, 41))
        with pytest.raises(LoaderError, match="not YYYY-MM-DD"):
            it.dates = ("soon", None)
        assert it.dates == ("2024-01-04", None)


def _within(seconds, fn, what):
    """``fn()`` run in a thread: its result or the exception it raised; fails if it is still
    running after ``seconds``."""
    import threading

    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=seconds)
    assert not t.is_alive(), f"{what} hung"
    return out[0]


def _wait_until_parked(it, error=False):
    """Wait until the producer thread of ``it``'s epoch is parked: waiting in ``_offer`` for the
    caller to take batches from its full queue, or, if ``error``, with an error queued last (the
    producer ends a job at its error: it then waits for the next job) or still to queue."""
    import sys
    import time

    pipeline = it.reader.pipeline
    producer = next(t for t in pipeline._threads if t.name == "shardgen-batches")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        frame, calls = sys._current_frames().get(producer.ident), []
        while frame is not None:
            calls.append(frame.f_code.co_name)
            frame = frame.f_back
        with pipeline.lock:
            ready = [item for _, item in pipeline._ready]
        if calls[:2] == ["wait", "_offer"] and not error:
            return
        if error and ready and calls[:2] in (["wait", "_offer"], ["wait", "_next_to_produce"]) and (
            isinstance(ready[-1], BaseException) or len(ready) >= pipeline._depth
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"the producer never parked on a full queue: queued {ready}, in {calls}")


def test_reset_and_close_never_hang_on_a_full_queue_or_an_error(store, cache, monkeypatch):
    """The producer runs ahead; an error it meets while its queue is full must not block reset/close,
    and next() raises it once the batches before it are taken."""
    import loader.pipeline.fill as module

    # One record per block (so per native batch), in order: every batch of 1 is one next_label() call.
    it = ShardIter(store, 1, shuffle=False, prefetch_buffer=2, shuffle_buffer=1, cache_dir=cache)
    try:
        _full_queue_or_error(it, module, monkeypatch)
    finally:
        it.close()


def _full_queue_or_error(it, module, monkeypatch):
    import threading
    import time

    it.next()
    _wait_until_parked(it)
    _within(10, it.reset, "reset() with the producer parked on a full queue")
    _wait_until_parked(it)
    # The native read fails from the second block of the epoch that reset() makes current (the loader
    # may have read that epoch's first blocks ahead, before the failure was armed: they come first).
    armed, calls, now = {"on": False}, {"n": 0}, threading.local()
    real_fill, real_label = module.Reading.fill, module.next_label

    def fill(self, v):
        now.failing = armed["on"] and v >= 1 and self.job is it.reader.pipeline.current
        return real_fill(self, v)

    def failing(native):
        if getattr(now, "failing", False):
            calls["n"] += 1
            raise RuntimeError("disk went away")
        return real_label(native)

    def fired():
        deadline = time.monotonic() + 10
        while calls["n"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls["n"] >= 1, "the injected failure never fired"
        _wait_until_parked(it, error=True)

    def batches_then_the_error():
        ids = batch_ids(_within(10, it.next, "next()"))
        assert ids == [0], ids  # the batches before the error come first, in order
        for expected in range(1, 4):
            got = _within(10, it.next, "next() up to the failure")
            if isinstance(got, BaseException):
                break
            assert batch_ids(got) == [expected]
        else:
            raise AssertionError("the injected failure never reached next()")
        for _ in range(2):  # the error stays: every later next() raises it
            exc = _within(10, it.next, "next() after the failure")
            assert isinstance(exc, RuntimeError) and "disk went away" in str(exc), exc

    monkeypatch.setattr(module.Reading, "fill", fill)
    monkeypatch.setattr(module, "next_label", failing)
    armed["on"] = True
    assert _within(10, it.reset, "reset()") is None
    fired()
    batches_then_the_error()
    calls["n"] = 0
    assert _within(10, it.reset, "reset() after an error") is None
    fired()
    batches_then_the_error()
    calls["n"] = 0
    assert _within(10, it.reset, "reset() after an error") is None
    fired()
    _within(10, it.close, "close() with an error in a full queue")


def test_exiting_mid_epoch_without_close_is_clean(store, tmp_path):
    """Native threads alive at interpreter exit abort the process unless ShardIter stops them."""
    import subprocess
    import sys

    from conftest import ROOT

    script = f"""
from loader import ShardIter
it = ShardIter({str(store)!r}, 4, cache_dir={str(tmp_path / 'cache')!r})
for b in it:
    pass
it.reset()
it.next()  # leave mid-epoch: producer, next-epoch opener and native threads all running
"""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]


def test_unwritable_cache_dir_is_a_clear_error(store, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(LoaderError, match="cannot write the loader's index folder.*cache_dir="):
        ShardIter(store, 4, cache_dir=blocker / "cache")


def test_an_iterator_dropped_without_close_releases_everything(tmp_path, opened):
    """Threads hold no reference to the iterator: garbage collection stops them, removes the
    reader lease (which would otherwise block gc of every later retirement) and the plan folder."""
    import gc
    import threading
    import time

    make_store(tmp_path / "s", {"2024-01-02": 70, "2024-01-03": 13})
    before = set(threading.enumerate())
    it = ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c")
    opened.clear()  # dropped on purpose
    it.next()
    assert list((tmp_path / "s" / "leases").glob("*.json"))
    mine = [t for t in threading.enumerate() if t not in before]
    assert mine
    del it
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(t.is_alive() for t in mine):
        time.sleep(0.05)
    assert not [t.name for t in mine if t.is_alive()]
    assert not list((tmp_path / "s" / "leases").glob("*.json"))
    assert not [p for p in (tmp_path / "c" / "plans").glob("*/*") if p.is_dir()]


def test_load_state_dict_restores_the_date_selection(store, cache):
    with ShardIter(store, 2, dates=("2024-01-03", "2024-01-04"), cache_dir=cache) as it:
        it.next()
        state = it.state_dict()
    with ShardIter(store, 2, cache_dir=cache) as it:
        it.load_state_dict(state)
        assert it.dates == ("2024-01-03", "2024-01-04")
        assert sum(2 - b.pad for b in it) == 14 - 2
        it.reset()
        assert it.records_per_epoch == 14, "the saved selection holds after the next reset()"


def test_history_keeps_one_entry_per_epoch_read_and_load_state_dict_starts_a_new_one(store, cache):
    """``history``: an epoch's statistics once it ends (reset, close, or a load_state_dict that
    starts another stream), none for an epoch not read at all; the statistics after a
    load_state_dict count only what was read since."""
    with ShardIter(store, 8, cache_dir=cache) as it:
        it.reset()  # nothing read: no entry
        assert it.history == []
        n = sum(1 for _ in it)
        it.reset()
        assert [(h["epoch"], h["batches"], h["samples"]) for h in it.history] == [(1, n, it.records_per_epoch)]
        it.next()
        state = it.state_dict()
        it.next()
        it.close()  # a partial epoch counts too
        assert [h["batches"] for h in it.history] == [n, 2]
    with ShardIter(store, 8, cache_dir=cache) as it:
        it.next(), it.next()
        it.load_state_dict(state)  # epoch 2 from its second batch: a new stream, a new clock
        assert [(h["epoch"], h["batches"]) for h in it.history] == [(0, 2)]
        it.next()
        assert it.stats["samples"] == 8 and it.stats["batches"] == 1 and it.epoch == 2  # what this process read


def test_a_resume_at_an_epochs_end_adds_no_figures_of_its_own(store, cache):
    """Found in review: resumed from a state saved after an epoch's last batch, the empty rest of
    that epoch came into ``history`` and ``last_epoch`` with ~-11000 seconds (a clock started by the
    StopIteration of ``list(it)`` and never stopped), and the previous process's batch count. Such a
    state goes on with the next epoch."""
    with ShardIter(store, 8, cache_dir=cache) as it:
        n = sum(1 for _ in it)
        state = it.state_dict()
    with ShardIter(store, 8, cache_dir=cache) as it:
        it.load_state_dict(state)
        assert sum(1 for _ in it) == n and it.epoch == 1  # saved after the epoch's end: the next epoch (issue 62)
        assert it.history == [] and it.stats["last_epoch"] is None  # nothing of the empty rest of epoch 0
        it.reset()
        last = it.stats["last_epoch"]
        assert last["epoch"] == 1 and last["batches"] == n and last["seconds"] > 0 and last["samples_per_s"] > 0, last

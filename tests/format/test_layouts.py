"""Record layouts samples / windows / runs: the same windows, exactly once per epoch, whichever
layout stores them; parts, date selection and resumption; what stock MXNet reads back."""

import datetime as dt
from collections import Counter

import mxnet as mx
import numpy as np
import pytest
from conftest import expected_pads, part_sizes, real_batches

from loader import LoaderError, ShardIter
from shardgen.format import LabelSpec, Layout, Schema, unpack_samples
from shardgen.process import RunSpec, sliding_windows
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.publish import publish
from shardgen.store.verify import verify_store

T, C = 6, 3
LABELS = [LabelSpec("a", 1), LabelSpec("b", 2)]
DATES = [dt.date(2024, 1, 2) + dt.timedelta(days=i) for i in range(5)]
ROWS = {d: 40 + 13 * i for i, d in enumerate(DATES)}  # dates of different sizes
LAYOUTS = {"samples": Layout(), "windows": Layout("windows", 4), "runs": Layout("runs", 8, T + 7),
           "runs_stride2": Layout("runs", 5, T + 2 * 4)}


def raw_for(date):
    rng = np.random.default_rng(date.toordinal())
    return rng.standard_normal((ROWS[date], C + 3)).astype(np.float32)


def make(store, layout, stride=1):
    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=layout)
    store.mkdir(parents=True, exist_ok=True)
    entries = []
    for d in DATES:
        spec = sliding_windows(raw_for(d), d, time_steps=T, num_inputs=C, labels=LABELS, stride=stride)
        entries.append(write_shard(store, d, spec, None, schema, fsync=False).entry())
    publish(store, schema, 0, entries)
    return schema


def keys(batch):
    """One hashable key per real sample: its exact bytes (x, labels, date)."""
    n = batch.data[0].shape[0] - batch.pad
    parts = [batch.data[0].asnumpy().reshape(len(batch.data[0]), -1)] + \
            [lab.asnumpy().reshape(len(lab), -1) for lab in batch.label]
    rows = np.concatenate(parts, axis=1)[:n]
    return [r.tobytes() for r in rows]


def expected(stride=1, dates=None):
    out = Counter()
    for d in DATES:
        if dates and not (dates[0] <= d.isoformat() <= dates[1]):
            continue
        x, labs = sliding_windows(raw_for(d), d, time_steps=T, num_inputs=C, labels=LABELS,
                                  stride=stride).as_windows(T)
        day = np.full((len(x), 1), (d - dt.date(1970, 1, 1)).days, np.float32)
        rows = np.concatenate([x.reshape(len(x), -1), labs["a"], labs["b"], day], axis=1)
        out.update(r.tobytes() for r in rows)
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, layout in LAYOUTS.items():
        make(base / name, layout, stride=2 if name.endswith("stride2") else 1)
        out[name] = base / name
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("batch_size", [3, 16])  # 3: smaller than every layout's pack
@pytest.mark.parametrize("parts, dates", [(1, None), (2, None), (3, None), (5, None), (8, None),
                                          (2, ("2024-01-03", "2024-01-05"))])
def test_every_window_once_per_epoch_bit_identical(stores, tmp_path, name, batch_size, parts, dates):
    want = expected(stride=2 if name.endswith("stride2") else 1, dates=dates)
    n = sum(want.values())
    iters = [ShardIter(stores[name], batch_size, seed=3, num_parts=parts, part_index=p, dates=dates,
                       cache_dir=tmp_path, shuffle_buffer=8) for p in range(parts)]
    for _ in range(2):
        seen = Counter()
        for p, it in enumerate(iters):
            batches = list(it)
            assert [b.pad for b in batches] == expected_pads(n, parts, batch_size, p), "exact pads, pad < batch"
            part = Counter(k for b in real_batches(batches, n, parts, p) for k in keys(b))
            assert sum(part.values()) == part_sizes(n, parts)[p], "parts are balanced by samples"
            seen.update(part)
            for b in batches:
                assert np.isfinite(b.data[0].asnumpy()).all()
            it.reset()
        assert seen == want, "exactly the windows of the raw data, each once"
    for it in iters:
        it.close()


def test_layouts_store_the_same_windows_and_runs_store_rows_once(stores):
    sizes = {name: Manifest.load(stores[name] / "manifest.json") for name in ("samples", "windows", "runs")}
    assert len({m.samples for m in sizes.values()}) == 1
    per = {name: m.bytes / m.samples for name, m in sizes.items()}
    assert per["runs"] < per["samples"] / 3 and per["windows"] < per["samples"]
    for name in LAYOUTS:
        assert verify_store(stores[name])[1] == []


@pytest.mark.parametrize("name", ["windows", "runs"])
def test_stock_mxnet_reads_every_layout(stores, name):
    manifest = Manifest.load(stores[name] / "manifest.json")
    s = manifest.shards[0]
    r = mx.recordio.MXIndexedRecordIO(str(stores[name] / s.idx), str(stores[name] / s.rec), "r")
    got = []
    for k in r.keys:
        header, _img = mx.recordio.unpack(r.read_idx(k))
        assert header.flag == manifest.schema.record_floats
        x, labels, days, position = unpack_samples(header.label, manifest.schema)
        got += list(zip(position.tolist(), x))
    r.close()
    want, _ = sliding_windows(raw_for(DATES[0]), DATES[0], time_steps=T, num_inputs=C, labels=LABELS).as_windows(T)
    got.sort(key=lambda p: p[0])
    np.testing.assert_array_equal(np.stack([x for _, x in got]), want)


def test_the_shuffle_buffer_separates_a_runs_neighbours_like_an_exact_shuffle(stores, tmp_path):
    """A record brings a run of neighbouring windows; the buffer must mix them over the epoch, not
    hand them out together. The share of windows whose next window (same date, next start) is in
    their batch: an exact shuffle of the N windows gives (B-1)/(N-1), 4.9% here; the buffer gives
    6.2% and 3.9% (seed 0, two epochs); drawn in arrival order 83%. The bound, 3x exact, is far from both."""
    where = {}
    for d in DATES:
        x, _labels = sliding_windows(raw_for(d), d, time_steps=T, num_inputs=C, labels=LABELS).as_windows(T)
        where.update((w.tobytes(), (d, start)) for start, w in enumerate(x))
    bs, n = 16, len(where)
    exact = (bs - 1) / (n - 1)
    with ShardIter(stores["runs"], bs, seed=0, cache_dir=tmp_path) as it:
        for _ in range(2):
            together = total = 0
            for b in it:
                batch = {where[w.tobytes()] for w in b.data[0].asnumpy()[:bs - b.pad]}
                together += sum((d, start + 1) in batch for d, start in batch)
                total += len(batch)
            assert total == n
            assert together / total < 3 * exact, f"{together / total:.0%} of windows share a batch with the next"
            it.reset()


def test_same_order_for_the_same_seed_and_a_new_one_per_epoch(stores, tmp_path):
    def epochs(seed):
        with ShardIter(stores["runs"], 16, seed=seed, cache_dir=tmp_path, shuffle_buffer=8) as it:
            first = [k for b in it for k in keys(b)]
            it.reset()
            second = [k for b in it for k in keys(b)]
        return first, second

    a, b = epochs(1), epochs(1)
    assert a == b and a[0] != a[1] and sorted(a[0]) == sorted(a[1])
    assert epochs(2)[0] != a[0]


@pytest.mark.parametrize("name", ["samples", "runs"])
def test_resume_continues_with_the_same_batches(stores, tmp_path, name):
    kw = dict(seed=4, num_parts=2, part_index=1, cache_dir=tmp_path, shuffle_buffer=8)
    it = ShardIter(stores[name], 8, **kw)
    it.reset()  # epoch 1
    full = [keys(b) for b in it]
    it.reset()
    it.reset()
    it2 = ShardIter(stores[name], 8, **kw)
    it2.reset()
    for _ in range(5):
        it2.next()
    state = it2.state_dict()
    it2.close()
    it3 = ShardIter(stores[name], 8, **kw)
    it3.load_state_dict(state)
    rest = [keys(b) for b in it3]
    assert rest == full[5:]
    it3.reset()
    assert it3.epoch == 2
    it.close()
    it3.close()


def test_runs_layout_needs_run_form(tmp_path):
    from shardgen.errors import ProcessorError
    from shardgen.process import run_processor

    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=LAYOUTS["runs"])

    def windows_only(raw, date, **kw):
        return sliding_windows(raw, date, **kw).as_windows(T)

    with pytest.raises(ProcessorError, match="store.layout = 'runs' needs RunSpec"):
        run_processor(windows_only, raw_for(DATES[0]), DATES[0], schema, {})
    bad = RunSpec(np.zeros((10, C), np.float32), np.array([0, 5]), {"a": np.zeros(2, np.float32),
                                                                   "b": np.zeros((2, 2), np.float32)})
    with pytest.raises(ProcessorError, match=r"starts must lie in \[0, 4\]"):
        run_processor(lambda *a, **k: bad, raw_for(DATES[0]), DATES[0], schema, {})


@pytest.mark.parametrize("name", ["samples", "runs"])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_a_batch_larger_than_a_part_is_one_padded_batch(stores, tmp_path, name, parts):
    """A small validation split: one batch per part, ``pad = batch_size - samples`` (as NDArrayIter
    and Gluon's DataLoader give); every part the same batch count, every window once."""
    want = expected()
    n = sum(want.values())
    largest = max(part_sizes(n, parts))
    for bs in (largest, largest + 1, 1000):  # equal to the largest part (the others are smaller), above all
        seen = Counter()
        for p in range(parts):
            with ShardIter(stores[name], bs, seed=2, num_parts=parts, part_index=p, cache_dir=tmp_path) as it:
                for _ in range(2):
                    batches = list(it)
                    assert [b.pad for b in batches] == [bs - part_sizes(n, parts)[p]] == expected_pads(n, parts, bs, p)
                    assert it.batches_per_epoch == 1 and it.records_per_epoch == part_sizes(n, parts)[p]
                    got = keys(batches[0])
                    assert len(got) == len(set(got)) == part_sizes(n, parts)[p]
                    assert np.isfinite(batches[0].data[0].asnumpy()).all(), "padding rows are real data"
                    it.reset()
            seen.update(got)
        assert seen == want
    with pytest.raises(LoaderError, match="batch_size 1000 is larger than part 0 of 1 .*last_batch='discard' leaves "
                                          "no batch; last_batch='pad' gives one padded batch"):
        ShardIter(stores[name], 1000, last_batch="discard", cache_dir=tmp_path)


def test_processors_written_for_the_windows_form_still_unpack_sliding_windows():
    """``x, labels = sliding_windows(...)`` was the contract before RunSpec; it still works."""
    d = DATES[0]
    x, labs = sliding_windows(raw_for(d), d, time_steps=T, num_inputs=C, labels=LABELS)
    assert x.shape == (ROWS[d] - T + 1, T, C) and labs["a"].shape == (len(x), 1)
    np.testing.assert_array_equal(x[3], raw_for(d)[3:3 + T, :C])


@pytest.mark.parametrize("at", [0, 1, 7, -1])
def test_resume_in_the_first_epoch_skips_inside_the_running_stream(stores, tmp_path, at):
    kw = dict(seed=9, cache_dir=tmp_path, shuffle_buffer=8, prefetch_buffer=2)
    with ShardIter(stores["runs"], 8, **kw) as it:
        full = [keys(b) for b in it]
    at = len(full) + at if at < 0 else at
    with ShardIter(stores["runs"], 8, **kw) as it:
        for _ in range(at):
            it.next()
        state = it.state_dict()
    with ShardIter(stores["runs"], 8, **kw) as it:
        it.load_state_dict(state)
        assert [keys(b) for b in it] == full[at:]
        it.reset()
        assert sorted(k for b in it for k in keys(b)) == sorted(k for ks in full for k in ks)


def test_records_sharing_a_key_are_still_split_exactly(tmp_path):
    """A processor that repeats window starts makes two runs of a date begin on the same row: the
    loader tells them apart by the first item's label too, and parts stay exact and balanced."""
    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=LAYOUTS["runs"])
    entries, want = [], Counter()
    (tmp_path / "s").mkdir()
    for d, rows in zip(DATES[:2], (40, 53)):
        spec = sliding_windows(raw_for(d)[:rows], d, time_steps=T, num_inputs=C, labels=LABELS)
        labs = {k: np.repeat(v, 12, axis=0) for k, v in spec.labels.items()}
        labs["a"] = labs["a"] + (np.tile(np.arange(12, dtype=np.float32), len(spec.starts)) * 1000
                                 ).reshape(labs["a"].shape)  # duplicates differ in their labels
        spec = RunSpec(spec.rows, np.repeat(spec.starts, 12), labs, T)
        entries.append(write_shard(tmp_path / "s", d, spec, None, schema, fsync=False).entry())
        x, labs = spec.as_windows(T)
        day = np.full((len(x), 1), (d - dt.date(1970, 1, 1)).days, np.float32)
        want.update(r.tobytes() for r in np.concatenate([x.reshape(len(x), -1), labs["a"].reshape(len(x), -1),
                                                         labs["b"], day], axis=1))
    publish(tmp_path / "s", schema, 0, entries)
    n = sum(want.values())
    for parts, bs in ((3, 5), (5, 7)):
        seen = Counter()
        for p in range(parts):
            with ShardIter(tmp_path / "s", bs, seed=1, num_parts=parts, part_index=p, cache_dir=tmp_path) as it:
                batches = list(it)
                assert [b.pad for b in batches] == expected_pads(n, parts, bs, p)
                seen.update(k for b in real_batches(batches, n, parts, p) for k in keys(b))
        assert seen == want


def test_the_exceptions_repeat_batch_is_a_copy(stores, tmp_path):
    """The caller may change a batch in place; the repeat batch after it still holds stored data."""
    n = sum(expected().values())
    parts, bs = next((p, b) for p in (2, 3, 4) for b in range(3, 40) if 1 <= n % (p * b) <= p - 1
                     and n // p >= b)
    short = next(p for p in range(parts) if part_sizes(n, parts)[p] == n // parts)
    want = expected()
    with ShardIter(stores["runs"], bs, num_parts=parts, part_index=short, cache_dir=tmp_path) as it:
        batches = []
        for b in it:
            if batches:
                batches[-1].data[0][:] = -1  # an in-place change by the caller, after the next batch came
            batches.append(b)
    assert batches[-1].pad == bs - 1 and batches[-1].data[0] is not batches[-2].data[0]
    restored = keys(batches[-1])
    assert len(restored) == 1 and restored[0] in want


@pytest.mark.parametrize("layout", [Layout(), Layout("windows", 1), Layout("runs", 1, T)])
def test_records_of_one_window_each_say_nothing_about_distinct_keys(tmp_path, layout):
    """A part boundary never falls inside a record of one window: the writer leaves ``distinct``
    out (None) rather than reading the shard back to compute it (issue 45 pins the short cut)."""
    from shardgen.process import sliding_windows
    from shardgen.produce.writer import write_shard

    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=layout)
    raw = np.random.default_rng(0).standard_normal((40, C + 3)).astype(np.float32)
    d = dt.date(2024, 1, 2)
    side = write_shard(tmp_path, d, sliding_windows(raw, d, time_steps=T, num_inputs=C, labels=LABELS), None,
                       schema, fsync=False)
    assert side.records == side.windows and side.distinct is None

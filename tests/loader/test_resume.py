"""A saved state continues its epoch exactly in a new process, whatever changed that does not shape
the order (issue 42): prefetch_buffer, preprocess_threads, cache_limit, the store's kind, and
the number of parts. Every window is read exactly once over the old and the new processes (pads
and the repeated batch of a part that ran out early excluded); with the same parts and batch size
the new process reads exactly the batches the old one would have."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, batch_ids, make_store

from loader import LoaderError, ShardIter
from loader.pipeline.order import EpochOrder, OrderSpec, Phase, count, remainder, slice_of

COUNTS = {f"2024-04-{d:02d}": 17 + 5 * (d % 4) for d in range(1, 15)}  # 14 dates, 343 windows
TOTAL = sum(COUNTS.values())
KW = dict(seed=11, shuffle_buffer=16)  # blocks of 64 windows (packed by 4): several blocks an epoch
B = 8

CHILD = """
import json, sys
from loader import ShardIter
jobs, out = json.loads(sys.stdin.read()), []
for job in jobs:
    got = []
    for part in range(job["parts"]):
        with ShardIter(job["store"], job["batch"], num_parts=job["parts"], part_index=part,
                       cache_dir=f"{job['cache']}/p{part}", **job["kw"]) as it:
            it.load_state_dict(job["state"])
            got.append([[b.label[0].asnumpy().astype(int).tolist(), b.pad] for b in it])
    out.append(got)
print(json.dumps(out))
"""


def _real(batches: list, bs: int) -> list:
    """Ids of the real windows of a part's batches, in order: pads dropped, and a batch that only
    repeats the last real one (a part that ran out a batch early) left out."""
    ids, last = [], None
    for rows, pad in batches:
        if pad == bs - 1 and last is not None and rows[0] == last:
            continue
        ids += rows[:bs - pad]
        last = rows[0]
    return ids


def _consumed(state: dict) -> int:
    """Windows of the epoch's order the state's phases read, by every part."""
    return TOTAL - count(remainder(TOTAL, [Phase(*ph) for ph in state["phases"]]))


def _old_job(store, cache, parts, frac=None, k=None, **kw):
    """Each of ``parts`` iterators reads ``k`` batches (or ``frac`` of its epoch): the ids read and
    the state part 0 saved (every worker of a dist_sync job is at the same batch)."""
    iters = [ShardIter(store, B, num_parts=parts, part_index=p, cache_dir=f"{cache}/p{p}", **KW, **kw)
             for p in range(parts)]  # a cache of its own each, as dist_sync workers under a cache_limit
    try:
        n = iters[0].batches_per_epoch
        k = min(n, max(1, round(frac * n))) if k is None else k
        ids = []
        for it in iters:
            ids += _real([[b.label[0].asnumpy().astype(int).tolist(), b.pad] for b in (it.next() for _ in range(k))],
                         B)
        return ids, iters[0].state_dict(), k, n
    finally:
        for it in iters:
            it.close()


def _new_jobs(jobs: list) -> list:
    """Run ``jobs`` in ONE new process (each: every part of a new job loads the state)."""
    done = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(jobs), capture_output=True, text=True,
                          cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "s"
    make_store(path, COUNTS, pack=4)
    return path


@pytest.mark.timeout(300)
def test_every_window_once_over_old_and_new_processes_whatever_changed(store, tmp_path):
    cases = []  # (old parts, new parts, frac or k, old settings, new settings)
    for frac in (0.1, 0.6, 0.99, "last"):
        cases += [(1, 1, frac, dict(preprocess_threads=1), dict(preprocess_threads=3, prefetch_buffer=2)),
                  (1, 2, frac, dict(prefetch_buffer=1), dict(preprocess_threads=2)),
                  (2, 1, frac, dict(preprocess_threads=3, prefetch_buffer=3), dict(prefetch_buffer=1)),
                  (2, 4, frac, dict(), dict(preprocess_threads=1))]
    olds, jobs = [], []
    for parts, new_parts, frac, old_kw, new_kw in cases:
        k = None
        if frac == "last":
            with ShardIter(store, B, num_parts=parts, cache_dir=tmp_path / "c", **KW) as it:
                k = it.batches_per_epoch - 1
        ids, state, k, n = _old_job(store, tmp_path / "c", parts, None if k else frac, k, **old_kw)
        assert state["phases"] == [[parts, B, k]] and _consumed(state) == len(ids)
        json.dumps(state)  # a state is plain JSON
        olds.append(ids)
        jobs.append(dict(store=str(store), cache=str(tmp_path / "c2"), parts=new_parts, batch=B, state=state,
                         kw={**KW, **new_kw}))
    for (parts, new_parts, frac, _, _), old, new in zip(cases, olds, _new_jobs(jobs)):
        rest = [i for got in new for i in _real(got, B)]
        assert sorted(old + rest) == list(range(TOTAL)), (parts, new_parts, frac)
        assert len({len(got) for got in new}) == 1, "every new part yields as many batches"


def test_the_same_parts_and_batch_size_read_exactly_the_batches_left(store, tmp_path):
    """Resumed with the same num_parts and batch_size (other settings changed), each part goes on
    with exactly the batches an uninterrupted run reads."""
    for parts in (1, 2):
        for p in range(parts):
            with ShardIter(store, B, num_parts=parts, part_index=p, cache_dir=tmp_path / "c", **KW) as it:
                want = [[b.label[0].asnumpy().astype(int).tolist(), b.pad] for b in it]
                it.reset()
                [it.next() for _ in range(3)]
                state = it.state_dict()
            with ShardIter(store, B, num_parts=parts, part_index=p, cache_dir=tmp_path / "c", prefetch_buffer=1,
                           preprocess_threads=2, **KW) as again:
                again.load_state_dict(state)
                assert again.epoch == 1
                got = [[b.label[0].asnumpy().astype(int).tolist(), b.pad] for b in again]
            with ShardIter(store, B, num_parts=parts, part_index=p, cache_dir=tmp_path / "c", **KW) as it:
                it.reset()
                assert got == [[b.label[0].asnumpy().astype(int).tolist(), b.pad] for b in it][3:]
        assert want  # epoch 0 was read too


def test_a_resume_with_another_batch_size_splits_what_is_left(store, tmp_path):
    """The same parts, another batch size: the saved phase is not gone on with (its batches are
    another size), what is left is split again: every window once."""
    ids, state, k, _ = _old_job(store, tmp_path / "c", 2, 0.5)
    (new,) = _new_jobs([dict(store=str(store), cache=str(tmp_path / "c2"), parts=2, batch=5, state=state,
                             kw={**KW, "prefetch_buffer": 2})])
    assert sorted(ids + [i for got in new for i in _real(got, 5)]) == list(range(TOTAL))


def test_a_resume_reads_only_from_the_block_it_resumes_in(store, tmp_path, monkeypatch):
    """Reaching batch k reads the block holding it and the ones after, never a consumed block."""
    import loader.pipeline.fill as fill

    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        n = it.batches_per_epoch
        [it.next() for _ in range(int(n * 0.9))]
        state = it.state_dict()
    blocks = []
    real = fill.Reading.fill

    def recording(self, v):
        visit = self.job.visits[v]
        blocks.append((self.job, visit.c, visit.b))
        return real(self, v)

    monkeypatch.setattr(fill.Reading, "fill", recording)
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.load_state_dict(state)
        job = it.reader.pipeline.current  # the resumed epoch's (not the first one's, nor the next one's)
        shards = it.reader.plan.shards
        list(it)
    blocks = [(c, b) for who, c, b in blocks if who is job]
    order = EpochOrder([s.samples for s in shards], OrderSpec(KW["seed"], True, 1, state["block"], 4), 0)
    first = next(order.visits(remainder(TOTAL, [Phase(1, B, int(n * 0.9))])))
    assert blocks and blocks[0] == (first.c, first.b)
    bounds = order.canonical(0)[2]
    assert blocks == [(0, b) for b in range(first.b, len(bounds) - 1)]  # the rest of the epoch's blocks, no more


def test_a_state_of_the_old_format_or_another_seed_is_refused_saying_what_to_do(store, tmp_path):
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        state = it.state_dict()
        old = {**state, "version": 3, "batches": 5, "epoch": 2}
        with pytest.raises(LoaderError, match=r"version 3 .*cannot find its place.*Start epoch 2 again"):
            it.load_state_dict(old)
        with pytest.raises(LoaderError, match="seed=11, this iterator has 12"):
            ShardIter(store, B, cache_dir=tmp_path / "c", **{**KW, "seed": 12}).load_state_dict(state)
        with pytest.raises(LoaderError, match="state_dict differs from what state_dict.. saved"):
            it.load_state_dict({**state, "phases": [[0, 8, 1]]})
        assert it.next().data[0].shape[0] == B, "the epoch in progress is untouched"


def test_the_phases_say_which_windows_were_consumed():
    """``remainder`` and ``slice_of``: the pure arithmetic a resume rests on, on many shapes."""
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(300):
        total = int(rng.integers(0, 200))
        phases, consumed = [], []
        rest = remainder(total, [])
        for _ in range(int(rng.integers(0, 4))):
            parts, bs = int(rng.integers(1, 9)), int(rng.integers(1, 9))
            slices = [slice_of(rest, parts, p) for p in range(parts)]
            sizes = [count(s) for s in slices]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == count(rest)
            k = int(rng.integers(0, math.ceil(max(sizes) / bs) + 1)) if max(sizes) else 0
            for s in slices:
                taken = 0
                for a, z in s:
                    take = min(z - a, k * bs - taken)
                    consumed += list(range(a, a + max(0, take)))
                    taken += max(0, take)
            phases.append(Phase(parts, bs, k))
            rest = remainder(total, phases)
        left = [i for a, z in rest for i in range(a, z)]
        assert sorted(consumed + left) == list(range(total))


@pytest.mark.timeout(300)
def test_a_state_moves_between_a_folder_and_s3_and_any_cache_limit(s3, tmp_path):
    """The same generation on a folder and on S3 is one order: a state saved on either, with any
    cache_limit, continues on the other (in a new process) with every window once."""
    from test_s3_loader import upload_store

    from shardgen.store.manifest import Manifest

    counts = {f"2024-05-{d:02d}": 8 + d % 5 for d in range(1, 31)}  # 30 shards of 5-7 kB: a limit of a quarter holds 3
    store = tmp_path / "big"
    make_store(store, counts, pack=4, t=20, c=8)
    url = upload_store(s3, store)
    part = sum(s.bytes for s in Manifest.load(store / "manifest.json").shards)
    cases = [  # (old store, old settings, new store, new settings, old parts, new parts, fraction)
        (str(store), {}, url, dict(cache_limit=part * 25 // 100), 1, 1, 0.6),
        (url, dict(cache_limit=part * 40 // 100), str(store), {}, 1, 2, 0.6),
        (url, {}, url, dict(cache_limit=part * 25 // 100), 2, 1, 0.1),
        (url, dict(cache_limit=part * 25 // 100), url, {}, 2, 4, 0.99),
    ]
    olds, jobs = [], []
    for n, (old_store, old_kw, new_store, new_kw, parts, new_parts, frac) in enumerate(cases):
        ids, state, _, _ = _old_job(old_store, tmp_path / f"old{n}", parts, frac, **old_kw)
        olds.append(ids)
        jobs.append(dict(store=new_store, cache=str(tmp_path / f"new{n}"), parts=new_parts, batch=B, state=state,
                         kw={**KW, **new_kw}))
    for case, old, new in zip(cases, olds, _new_jobs(jobs)):
        assert sorted(old + [i for got in new for i in _real(got, B)]) == list(range(sum(counts.values()))), case


@pytest.mark.parametrize("edit, match", [
    ({"epoch": -1}, "'epoch' must be an integer >= 0"),
    ({"epoch": "3"}, "'epoch' must be"),
    ({"canonical_parts": 2**63}, r"'canonical_parts' must be an integer in \[1, 65536\]"),
    ({"block": 0}, "'block' must be"),
    ({"generation": None}, "'generation' must be"),
    ({"pinned": "x"}, "'pinned' must be"),
    ({"shards": []}, "'shards' must be the non-empty list"),
    ({"shards": [{"date": "2024-04-01"}]}, "'shards' or 'dates' cannot be read"),
    ({"dates": ["2024-13-01", None]}, "'shards' or 'dates' cannot be read"),
    ({"phases": [[1, 8, 10_000]]}, "1 parts read 10000 batches of 8, their slices hold at most 343 samples"),
    ({"phases": [[1, True, 1]]}, "'phases' must be"),
    ({"phases": [[10**7, 1, 0]]}, "'phases' must be"),  # a table of 10^7 slices: refused, not built
    ({"phases": [[1, 0, 1]]}, "'phases' must be"),  # a batch of 0 (ZeroDivisionError, not refused)
    ({"phases": [[0, 8, 1]]}, "'phases' must be"),
    ({"phases": [[1, 8, 2**31]]}, "'phases' must be"),
    ({"seed": None}, "saved with seed=None"),
])
def test_a_hand_edited_state_is_one_loader_error_and_the_epoch_goes_on(store, tmp_path, edit, match):
    """A state is written by state_dict() alone: an edited field (or a window count of a shard)
    is refused by the state's own sha256; re-signed, each field is still checked. Always before
    the epoch in progress is let go: one LoaderError, never a KeyError/TypeError/hang, and the
    iterator goes on reading where it was."""
    from loader.checkpoint import _digest

    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        first = it.next().label[0].asnumpy().tolist()
        state = json.loads(json.dumps(it.state_dict()))
        altered = json.loads(json.dumps({**state, **edit}))
        with pytest.raises(LoaderError, match="state_dict differs from what state_dict.. saved"):
            it.load_state_dict(altered)
        with pytest.raises(LoaderError, match=match):
            it.load_state_dict({**altered, "sha256": _digest(altered)})
        it.load_state_dict(state)  # the unaltered state still loads
        second = it.next().label[0].asnumpy().tolist()
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        assert [it.next().label[0].asnumpy().tolist() for _ in range(2)] == [first, second]


@pytest.mark.parametrize("bad", [None, [], {"version": 4}])
def test_what_is_not_a_state_is_one_loader_error(store, tmp_path, bad):
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        with pytest.raises(LoaderError):
            it.load_state_dict(bad)
        assert it.next().data[0].shape[0] == B


@pytest.mark.parametrize("version", [1, 7, None, "6"])
def test_a_state_of_another_version_is_refused_naming_it(store, tmp_path, version):
    from loader.checkpoint import STATE_VERSION, _digest

    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.next()
        state = {**it.state_dict(), "version": version}
        with pytest.raises(LoaderError, match=f"state_dict version {version!r}, expected {STATE_VERSION}"):
            it.load_state_dict({**state, "sha256": _digest(state)})


def test_a_state_of_the_order_with_a_ramp_is_refused_saying_what_to_do(store, tmp_path):
    """Version 4 states were saved while an epoch's first blocks ramped up (2026-12-06): their place
    is not in today's order, and the message says how to go on."""
    from loader.checkpoint import _digest

    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.next()
        state = {**it.state_dict(), "version": 4}
        with pytest.raises(LoaderError, match="version 4 .* equal blocks.*Start epoch 0 again"):
            it.load_state_dict({**state, "sha256": _digest(state)})
        assert it.next().data[0].shape[0] == B


def test_a_version_5_state_is_refused_where_blocks_became_stripes_and_resumes_where_the_order_is_the_same(
        store, tmp_path):
    """Version 5 read a shuffled part of several blocks in consecutive dates (before 2026-12-07); a
    one-block part's order (and any order in store order) is the same in both: those states resume."""
    from loader.checkpoint import _digest

    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        assert it.reader.params.block < TOTAL, "this store is read in several blocks"
        it.next()
        state = {**it.state_dict(), "version": 5}
        with pytest.raises(LoaderError, match="version 5 .* stripes.*Start epoch 0 again"):
            it.load_state_dict({**state, "sha256": _digest(state)})
    for kw in ({**KW, "shuffle_buffer": None}, {**KW, "shuffle": False}):
        with ShardIter(store, B, cache_dir=tmp_path / "c", **kw) as it:
            it.next()
            state = it.state_dict()
            want = [b.label[0].asnumpy().tolist() for b in it]
        old = {**state, "version": 5}
        with ShardIter(store, B, cache_dir=tmp_path / "d", **kw) as again:
            again.load_state_dict({**old, "sha256": _digest(old)})
            assert [b.label[0].asnumpy().tolist() for b in again] == want


def test_a_state_the_new_parts_cannot_split_is_refused_before_the_epoch_is_let_go(store, tmp_path):
    """Saved one batch before the end (1 sample left), loaded on 2 parts: part 1 would be empty;
    the iterator goes on. With last_batch='discard', the end of an epoch resumes on any number of
    parts (discard leaves the rest out): saved after the epoch's end, the next epoch follows."""
    with ShardIter(store, 9, cache_dir=tmp_path / "a", **KW) as old:
        for _ in range(old.batches_per_epoch - 1):
            old.next()
        state = old.state_dict()
    assert TOTAL - _consumed(state) == 1
    with ShardIter(store, 9, num_parts=2, cache_dir=tmp_path / "b", **KW) as it:
        first = it.next().label[0].asnumpy().tolist()
        with pytest.raises(LoaderError, match=r"part \d of 2 would be empty"):
            it.load_state_dict(state)
        second = it.next().label[0].asnumpy().tolist()  # the epoch in progress goes on
    with ShardIter(store, 9, num_parts=2, cache_dir=tmp_path / "b", **KW) as again:
        assert [again.next().label[0].asnumpy().tolist() for _ in range(2)] == [first, second]
    for parts, new in ((3, 1), (1, 2), (2, 4)):
        with ShardIter(store, B, num_parts=parts, last_batch="discard", cache_dir=tmp_path / "d", **KW) as old:
            for _ in old:
                pass
            state = old.state_dict()
        for reset in (False, True):  # saved after the epoch's end: the next epoch, with or without a reset()
            with ShardIter(store, B, num_parts=new, last_batch="discard", cache_dir=tmp_path / "e", **KW) as it:
                it.load_state_dict(state)
                assert it.epoch == 1 and state["epoch"] == 1  # the next epoch's start, on any part count
                if reset:
                    it.reset()
                assert len(list(it)) == it.batches_per_epoch > 0 and it.epoch == 1


def test_canonical_parts_is_bounded(store, tmp_path):
    with pytest.raises(LoaderError, match="canonical_parts .*must be <= 65,536"):
        ShardIter(store, B, cache_dir=tmp_path / "c", canonical_parts=2**63)
    with pytest.raises(LoaderError, match="canonical_parts .*must be <= 65,536"):
        ShardIter(store, B, cache_dir=tmp_path / "c", num_parts=70_000)


def test_a_resume_inside_the_last_batches_hands_out_what_an_uninterrupted_run_does(store, tmp_path):
    """343 windows on 2 parts of batch 9: part 0 (171 = 19 x 9) runs out a batch before part 1 (172)
    and repeats its last real batch; on 1 part the last batch is padded (343 = 38 x 9 + 1). Saved at
    each of the last batches and loaded again, every batch is the one the uninterrupted epoch gave:
    the same rows (never NaN: a resume at the repeated batch must assemble the batch it repeats) and
    the same pad (found by the round-4 audit: labels -9223372036854775808)."""
    import numpy as np

    for parts in (1, 2):
        for p in range(parts):
            with ShardIter(store, 9, num_parts=parts, part_index=p, cache_dir=tmp_path / "c", **KW) as it:
                n = it.batches_per_epoch
                want, states = [], {}
                for i in range(n):
                    if i >= n - 3:
                        states[i] = it.state_dict()
                    b = it.next()
                    want.append((b.label[0].asnumpy().tolist(), b.label[1].asnumpy().tolist(), b.pad))
                for k, state in states.items():
                    it.load_state_dict(state)
                    got = [(b.label[0].asnumpy().tolist(), b.label[1].asnumpy().tolist(), b.pad) for b in it]
                    assert not np.isnan(np.array([g[0] for g in got])).any(), (parts, p, k)
                    assert got == want[k:], (parts, p, k)
            if parts == 2 and p == 0:
                assert want[-1][2] == 8 and want[-1][0] == want[-2][0], "part 0 repeats its last real batch"


# What states written before issue 55 carried and nothing read: the place is in the phases, the rest
# are the saving iterator's own settings (which the loading one may change).
UNREAD = {"manifest": "/elsewhere/manifest.json", "batches": 2, "samples": 16, "batch_size": B, "num_parts": 1,
          "part_index": 0, "last_batch": "pad"}


def test_a_state_writes_only_what_a_load_reads_and_a_state_with_the_old_fields_still_loads(store, tmp_path):
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        for _ in range(2):
            it.next()
        state = it.state_dict()
        assert not set(UNREAD) & set(state), "a field nothing reads back"
        want = [b.label[0].asnumpy().tolist() for b in it]
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        old = _signed(state, **UNREAD)  # as the previous version wrote it (signed with its fields)
        it.load_state_dict(old)
        assert [b.label[0].asnumpy().tolist() for b in it] == want
        it.reset()
        it.load_state_dict(_signed(old, last_batch="discard", part_index=3, manifest=None))  # never read
        assert [b.label[0].asnumpy().tolist() for b in it] == want


def _signed(state: dict, **edit) -> dict:
    from loader.checkpoint import _digest

    altered = json.loads(json.dumps({**state, **edit}))
    return {**altered, "sha256": _digest(altered)}


@pytest.mark.parametrize("phases", [[[1, 8, -1]], [[1, -8, 1]], [[-1, 8, 1]], [[1, 8, 3], [1, 8, -2]]])
def test_a_state_with_negative_phases_is_refused_by_its_check_before_anything_is_allocated(store, tmp_path, phases):
    """A negative count read back (batches before the epoch's start) used to load, then its producer
    asked for samples past the part's end without bound (24 GB: OOM-killed). The check alone is
    asked here (``Reader.check``: nothing read or allocated), so a check that lets one through fails
    this test at once instead of exhausting the machine."""
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.next()
        with pytest.raises(LoaderError, match="'phases' must be"):
            it.reader.check(_signed(it.state_dict(), phases=phases))


@pytest.mark.parametrize("version", [2, 3])
def test_a_state_of_a_cache_shaped_order_is_refused_saying_what_to_do(store, tmp_path, version):
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.next()
        state = _signed(it.state_dict(), version=version, epoch=2)
        with pytest.raises(LoaderError, match=f"version {version} .*cannot find its place.*Start epoch 2 again"):
            it.load_state_dict(state)
        assert it.next().data[0].shape[0] == B


def test_a_state_must_match_the_iterators_seed_and_shuffle(store, tmp_path):
    """A shuffled state loaded with shuffle=False read 343 windows of which 303 distinct: the order's
    seed and shuffle are the iterator's, never the state's; the epoch in progress goes on."""
    for saved, now in ((dict(shuffle=True), dict(shuffle=False)), (dict(shuffle=False), dict(shuffle=True)),
                       (dict(seed=11), dict(seed=12))):
        with ShardIter(store, B, cache_dir=tmp_path / "c", **{**KW, **saved}) as it:
            it.next()
            state = it.state_dict()
        key, = saved
        with ShardIter(store, B, cache_dir=tmp_path / "c", **{**KW, **now}) as it:
            first = it.next().label[0].asnumpy().tolist()
            with pytest.raises(LoaderError, match=f"saved with {key}={saved[key]!r}, this iterator has {now[key]!r}"):
                it.load_state_dict(state)
            second = it.next().label[0].asnumpy().tolist()
        with ShardIter(store, B, cache_dir=tmp_path / "c", **{**KW, **now}) as it:
            assert [it.next().label[0].asnumpy().tolist() for _ in range(2)] == [first, second]


def test_a_state_loads_whatever_order_its_keys_come_back_in(store, tmp_path):
    """A state is JSON: stored by a checkpoint library that sorts keys (or in any order), its sha256
    still matches, and it continues exactly."""
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        it.next()
        state = it.state_dict()
        want = [b.label[0].asnumpy().tolist() for b in it]
        for again in (json.loads(json.dumps(state, sort_keys=True)), dict(reversed(list(state.items())))):
            assert list(again) != list(state)
            it.load_state_dict(again)
            assert [b.label[0].asnumpy().tolist() for b in it] == want


def test_a_state_of_another_schema_is_refused_naming_it(store, tmp_path):
    """The same dates and counts, another shape of window: the state's order would fit, its records
    would not (a byte count error while reading, before the check)."""
    other = tmp_path / "other"
    make_store(other, COUNTS, pack=4, t=4)
    with ShardIter(other, B, cache_dir=tmp_path / "o", **KW) as it:
        it.next()
        state = it.state_dict()
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        first = it.next().label[0].asnumpy().tolist()
        with pytest.raises(LoaderError, match="state_dict was saved for another schema"):
            it.load_state_dict(state)
        second = it.next().label[0].asnumpy().tolist()
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        assert [it.next().label[0].asnumpy().tolist() for _ in range(2)] == [first, second]


def test_the_largest_canonical_parts_and_num_parts_are_states_that_load(store, tmp_path):
    """The bounds are inclusive: canonical_parts=65,536 is valid (ShardIter takes it), so its state
    loads and continues; a phase of 65,536 parts passes the state's field check (a store that large
    is not written here: the check is pure)."""
    from loader.checkpoint import MAX_CANONICAL_PARTS, _check_fields

    with ShardIter(store, B, cache_dir=tmp_path / "c", canonical_parts=MAX_CANONICAL_PARTS, **KW) as it:
        it.next()
        state = it.state_dict()
        want = [b.label[0].asnumpy().tolist() for b in it]
        it.load_state_dict(state)
        assert [b.label[0].asnumpy().tolist() for b in it] == want
    big = {**state, "shards": [{**state["shards"][0], "windows": 2 * MAX_CANONICAL_PARTS}],
           "phases": [[MAX_CANONICAL_PARTS, 1, 1]]}
    _check_fields(big)
    with pytest.raises(LoaderError, match="'phases' must be"):
        _check_fields({**big, "phases": [[MAX_CANONICAL_PARTS + 1, 1, 1]]})
    with pytest.raises(LoaderError, match="'canonical_parts' must be"):
        _check_fields({**big, "canonical_parts": MAX_CANONICAL_PARTS + 1})


@pytest.mark.parametrize("field, value", [("windows", 65), ("windows", 15), ("records", 5)])  # huge: capped child
def test_a_state_whose_shard_entry_differs_from_the_checked_file_is_refused_before_the_epoch_is_let_go(
        store, tmp_path, field, value):
    """A file this process checked is not checked again, so a (re-signed) entry saying 10^12 windows
    built the order's tables without bound after the epoch was let go (MemoryError, found by
    tests/loader/test_properties_state.py), and 65 windows for a shard of 16 loaded."""
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        first = it.next().label[0].asnumpy().tolist()
        state = it.state_dict()
        shards = [dict(s) for s in state["shards"]]
        shards[0][field] = value
        with pytest.raises(LoaderError, match="entry of shard 2024-04-01 .* differs from the store's"):
            it.load_state_dict(_signed(state, shards=shards))
        second = it.next().label[0].asnumpy().tolist()
    with ShardIter(store, B, cache_dir=tmp_path / "c", **KW) as it:
        assert [it.next().label[0].asnumpy().tolist() for _ in range(2)] == [first, second]


def test_a_state_carries_its_date_selection_into_the_next_epochs(tmp_path):
    """A state saved by an iterator on some dates resumes in one made without them, and the epochs
    after it read those dates still (the review of issue 56: a state saved without its dates read
    every date from the next epoch on)."""
    make_store(tmp_path / "s", {"2024-01-02": 10, "2024-01-03": 10, "2024-01-04": 10})
    with ShardIter(tmp_path / "s", 4, seed=2, dates=("2024-01-03", "2024-01-03"), cache_dir=tmp_path / "c") as it:
        it.next()
        state = it.state_dict()
    with ShardIter(tmp_path / "s", 4, seed=2, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(state)
        assert sum(4 - b.pad for b in it) == 10 - 4
        it.reset()
        ids = sorted(i for b in it for i in batch_ids(b))
    assert ids == list(range(10, 20))  # 2024-01-03's windows, each once

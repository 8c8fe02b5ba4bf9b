"""A worker reading an object store fetches only the shards its part reads (issue 36): the split is
worked out from the manifest's window counts, the shards the part's bounds fall inside are opened
with the plan, the others stream segment by segment, and the part reads exactly the windows a
worker reading a folder reads. Shown on a store folder whose location is made to behave as a
download's (the S3 path itself: test_s3_loader)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_store

from loader import ShardIter
from loader.source.location import FolderLocation
from loader.source.plan import part_shards

# 240 windows: of 8 parts, most bounds fall on a shard's edge (30, 90, 120, ...), one inside (60);
# of 5 parts, all inside a shard (48, 96, ...) and, packed by 4, inside a record.
COUNTS = {f"2024-03-{d:02d}": n for d, n in zip(range(1, 11), (30, 20, 30, 10, 30, 30, 10, 20, 30, 30))}


def rows(batches) -> list:
    """Every real row of the batches (x and labels), sorted: what was read, in any order."""
    out = []
    for b in batches:
        n = b.data[0].shape[0] - b.pad
        cols = [b.data[0].asnumpy().reshape(len(b.data[0]), -1)] + [a.asnumpy().reshape(len(a), -1) for a in b.label]
        out += [r.tobytes() for r in np.concatenate(cols, axis=1)[:n]]
    return sorted(out)


def expected(manifest: dict, parts: int, part: int) -> tuple[set, set]:
    """(dates the plan opens, dates the part fetches), worked out independently: the part's plan
    opens the shards its own bounds fall inside, and, where the manifest does not say a bound
    inside a record stays put (packed records of an older manifest), each shard another part's
    bound falls inside; the part fetches those and every shard its samples live in."""
    shards = manifest["shards"]
    cum = np.cumsum([0] + [s["windows"] for s in shards])
    bounds = [p * int(cum[-1]) // parts for p in range(parts + 1)]
    lo, hi = bounds[part], bounds[part + 1]
    inside = {b: {s["date"] for s, a, z in zip(shards, cum[:-1], cum[1:]) if a < b < z} for b in bounds}
    opened = inside[lo] | inside[hi]
    for b in bounds[1:-1]:
        opened |= {d for d in inside[b] for s in shards if s["date"] == d
                   and s["records"] != s["windows"] and not s.get("distinct")}
    return opened, opened | {s["date"] for s, a, z in zip(shards, cum[:-1], cum[1:]) if a < hi and z > lo}


@pytest.mark.parametrize("pack,older", [(1, False), (4, False), (4, True)])
def test_a_part_opens_its_edge_shards_fetches_only_its_own_and_reads_its_windows(tmp_path, monkeypatch, pack, older):
    store = tmp_path / "s"
    make_store(store, COUNTS, pack=pack)
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    if older:  # a manifest written before shards said whether their records are told apart
        for s in manifest["shards"]:
            assert s.pop("distinct") is True
        path.write_text(json.dumps(manifest))
    assert all(("distinct" in s) == (pack > 1 and not older) for s in manifest["shards"])
    kw = dict(seed=3, cache_dir=tmp_path / "cache", readers=2, shuffle_buffer=16, native_batch=4)
    fetched: set = set()
    real_fetch = FolderLocation.fetch

    def fetch(self, shards, **kw):
        fetched.update(s.date for s in shards)
        return real_fetch(self, shards, **kw)

    for parts in (5, 8):
        for part in range(parts):
            with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                want = list(it)
                want_rows, want_pads = rows(want), [b.pad for b in want]
            with monkeypatch.context() as m:
                m.setattr(FolderLocation, "downloads", True)
                m.setattr(FolderLocation, "fetch", fetch)
                fetched.clear()
                with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                    plan = it.reader.plan
                    opened = {s.date for s, fd in zip(plan.shards, plan.files.fds) if fd >= 0}
                    got = list(it)
            assert (opened, fetched) == expected(manifest, parts, part), (parts, part)
            whole = part_shards(plan.shards, (parts, part))  # what is fetched ahead of a new generation
            assert {s.date for s, r in zip(plan.shards, whole) if r} == fetched
            assert len(fetched) < len(COUNTS)
            assert [b.pad for b in got] == want_pads and rows(got) == want_rows, (parts, part)


@pytest.mark.parametrize("same_labels", [False, True])
def test_a_shard_says_whether_its_records_are_told_apart(tmp_path, same_labels):
    """Runs that start on the same row are told apart by their first label; with the same labels
    too they are not, and the manifest must not let a loader put a bound inside one unread."""
    import datetime as dt

    from fake_gen import raw_for

    from shardgen.format import LabelSpec, Layout, Schema
    from shardgen.process import RunSpec, sliding_windows
    from shardgen.produce.writer import write_shard

    t, c, labels = 6, 3, [LabelSpec("a", 1), LabelSpec("b", 2)]
    schema = Schema.create(time_steps=t, num_inputs=c, data_name="seq_var", labels=labels,
                           layout=Layout("runs", 8, t + 7))
    day = dt.date(2024, 1, 2)
    spec = sliding_windows(raw_for(day.isoformat(), 40, c + 3), day, time_steps=t, num_inputs=c, labels=labels)
    labs = {k: np.repeat(v, 12, axis=0) for k, v in spec.labels.items()}
    if not same_labels:
        labs["a"] = labs["a"] + (np.tile(np.arange(12, dtype=np.float32), len(spec.starts)) * 1000
                                 ).reshape(labs["a"].shape)
    spec = RunSpec(spec.rows, np.repeat(spec.starts, 12), labs, t)
    sidecar = write_shard(tmp_path, day, spec, None, schema, fsync=False)
    assert sidecar.records < sidecar.windows
    assert sidecar.distinct is (not same_labels)
    assert sidecar.entry().to_json().get("distinct") is (not same_labels)


def test_a_parts_units_are_its_records_and_their_bytes(tmp_path):
    """What a streamed part reads, by shard (loader.pipeline.segments.part_units): exactly its
    records, and the bytes their files take in the cache (what a cache_limit's budget counts)."""
    from loader.pipeline.segments import part_units
    from loader.pipeline.stream import plan_part

    store = tmp_path / "s"
    make_store(store, COUNTS, pack=4)
    for parts, part in ((5, 0), (5, 2), (5, 4), (8, 3)):
        with ShardIter(store, 5, num_parts=parts, part_index=part, cache_dir=tmp_path / "cache") as it:
            plan = it.reader.plan
            split = plan_part(plan, it.reader.params)
            units = part_units(plan, split.first, split.stop)
            shards = range(plan.shard_of(split.first), plan.shard_of(split.stop - 1) + 1)
            assert [u.shard for u in units] == list(shards)
            assert sum(u.hi - u.lo for u in units) == split.stop - split.first
            assert [u.nbytes for u in units] == [plan.shards[k].bytes for k in shards]  # whole files in the cache
            sf = plan.shard_first
            assert [(u.lo, u.hi) for u in units][1:-1] == [(0, sf[k + 1] - sf[k]) for k in shards][1:-1]

"""A worker reading an object store fetches only the shards its part reads (issue 36): the split is
worked out from the manifest's window counts, and the batches are exactly those of a worker that
read every shard. Shown on a store folder whose location is made to behave as a download's (the
S3 path is covered end to end by test_s3_loader's dist_sync test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_store

from loader import ShardIter
from loader.source.location import FolderLocation

# 240 windows: of 8 parts, most bounds fall on a shard's edge (30, 90, 120, ...), one inside (60);
# of 5 parts, all inside a shard (48, 96, ...) and, packed by 4, inside a record.
COUNTS = {f"2024-03-{d:02d}": n for d, n in zip(range(1, 11), (30, 20, 30, 10, 30, 30, 10, 20, 30, 30))}


def arrays(it):
    return [np.concatenate([b.data[0].asnumpy().ravel()] + [a.asnumpy().ravel() for a in b.label]) for b in it]


def expected_reads(manifest: dict, parts: int, part: int) -> set:
    """Dates part ``part`` must open, worked out independently: those its samples live in, and
    where the manifest does not say a bound inside a record stays (packed records of an older
    manifest), every shard another part's bound falls inside."""
    shards = manifest["shards"]
    cum = np.cumsum([0] + [s["windows"] for s in shards])
    bounds = [p * int(cum[-1]) // parts for p in range(parts + 1)]
    lo, hi = bounds[part], bounds[part + 1]
    out = {s["date"] for s, a, b in zip(shards, cum[:-1], cum[1:]) if a < hi and b > lo}
    for b in bounds[1:-1]:
        for s, a, z in zip(shards, cum[:-1], cum[1:]):
            if a < b < z and s["records"] != s["windows"] and not s.get("distinct"):
                out.add(s["date"])
    return out


@pytest.mark.parametrize("pack,older", [(1, False), (4, False), (4, True)])
def test_a_part_opens_only_its_shards_and_reads_the_same_batches(tmp_path, monkeypatch, pack, older):
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
    for parts in (5, 8):
        for part in range(parts):
            with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                assert all(fd >= 0 for fd in it.reader.plan.files.fds)
                want = arrays(it)
            monkeypatch.setattr(FolderLocation, "downloads", True)
            try:
                with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                    plan = it.reader.plan
                    opened = {s.date for s, fd in zip(plan.shards, plan.files.fds) if fd >= 0}
                    got = arrays(it)
            finally:
                monkeypatch.setattr(FolderLocation, "downloads", False)
            assert opened == expected_reads(manifest, parts, part), (parts, part)
            assert len(opened) < len(COUNTS)
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), (parts, part)


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

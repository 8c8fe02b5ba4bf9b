"""A worker reading an object store fetches only the shards its part reads (issue 36), worked out
from the manifest's window counts alone, and reads exactly the batches a worker reading a folder
reads: the order is a value (loader.pipeline.order), the same for every store. Shown on a store
folder whose location is made to behave as a download's (the S3 path itself: test_s3_loader)."""

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


def arrays(batches) -> list:
    """Every batch's arrays and pad, in order."""
    return [([a.asnumpy().tobytes() for a in b.data + b.label], b.pad) for b in batches]


def expected(manifest: dict, parts: int, part: int) -> set:
    """The dates part ``part`` fetches, worked out independently: the shards its samples
    ``[part * N // parts, (part + 1) * N // parts)`` (store order) live in."""
    shards = manifest["shards"]
    cum = np.cumsum([0] + [s["windows"] for s in shards])
    lo, hi = part * int(cum[-1]) // parts, (part + 1) * int(cum[-1]) // parts
    return {s["date"] for s, a, z in zip(shards, cum[:-1], cum[1:]) if a < hi and z > lo}


@pytest.mark.parametrize("pack,older", [(1, False), (4, False), (4, True)])
def test_a_part_fetches_only_its_own_shards_and_reads_the_folder_s_batches(tmp_path, monkeypatch, pack, older):
    store = tmp_path / "s"
    make_store(store, COUNTS, pack=pack)
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    if older:  # a manifest written before shards said whether their records are told apart: no matter now
        for s in manifest["shards"]:
            assert s.pop("distinct") is True
        path.write_text(json.dumps(manifest))
    kw = dict(seed=3, cache_dir=tmp_path / "cache", readers=2, shuffle_buffer=16, native_batch=4)
    fetched: set = set()
    real_fetch = FolderLocation.fetch

    def fetch(self, shards, **kw):
        fetched.update(s.date for s in shards)
        return real_fetch(self, shards, **kw)

    for parts in (5, 8):
        for part in range(parts):
            with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                want = arrays(it)
            with monkeypatch.context() as m:
                m.setattr(FolderLocation, "downloads", True)
                m.setattr(FolderLocation, "fetch", fetch)
                fetched.clear()
                with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                    got = arrays(it)
                    ahead = {s.date for s in it.reader._part_of(it.reader.manifest)}  # fetched ahead of a new one
            assert fetched == expected(manifest, parts, part), (parts, part)
            assert ahead == fetched
            assert len(fetched) < len(COUNTS)
            assert got == want, (parts, part)


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
